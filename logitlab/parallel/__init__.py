"""Several processes: the process group (setup.py), DDP and FSDP2 applied to a built model from
outside (wrap.py), and full states gathered for checkpoints (state.py).

N-D layouts (docs/parallelism.md): the ZeRO stages (zero.py) and their per-rank memory
(planner.py), tensor + sequence parallelism (tensor.py), pipeline schedules (pipeline.py),
activation checkpointing (activation.py), the named DeviceMesh of a ParallelPlan (mesh.py), all
applied in one fixed order by parallelize (apply.py), and sharded DCP checkpoints (sharded.py).

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "DEFAULT_TIMEOUT_S": "setup",
    "DistInfo": "setup",
    "MESH_DIMS": "mesh",
    "PARALLEL_MODES": "setup",
    "ParallelPlan": "mesh",
    "Parallelized": "apply",
    "RankFailureError": "setup",
    "RankMemory": "planner",
    "all_reduce_mean": "setup",
    "any_rank": "setup",
    "barrier": "setup",
    "bubble_fraction": "planner",
    "clip_grad_norm": "wrap",
    "clip_grad_norm_nd": "apply",
    "current_info": "setup",
    "destroy": "setup",
    "fsdp_bf16_supported": "wrap",
    "full_optimizer_state_dict": "state",
    "full_state_dict": "state",
    "init_distributed": "setup",
    "is_main_process": "setup",
    "load_full_state_dict": "state",
    "load_sharded": "sharded",
    "parallelize": "apply",
    "plan_all_stages": "planner",
    "plan_grad_accum": "wrap",
    "plan_rank_memory": "planner",
    "rank_failure_guard": "setup",
    "rank_slice": "wrap",
    "read_model_state": "sharded",
    "save_sharded": "sharded",
    "shard_for_rank": "wrap",
    "sync_gradients": "wrap",
    "unwrap": "wrap",
    "wrap_model": "wrap",
}

__all__ = ["DEFAULT_TIMEOUT_S", "DistInfo", "MESH_DIMS", "PARALLEL_MODES", "ParallelPlan", "Parallelized",
           "RankFailureError", "RankMemory", "all_reduce_mean", "any_rank", "barrier", "bubble_fraction",
           "clip_grad_norm", "clip_grad_norm_nd", "current_info", "destroy", "fsdp_bf16_supported",
           "full_optimizer_state_dict", "full_state_dict", "init_distributed", "is_main_process",
           "load_full_state_dict", "load_sharded", "parallelize", "plan_all_stages", "plan_grad_accum",
           "plan_rank_memory", "rank_failure_guard", "rank_slice", "read_model_state", "save_sharded",
           "shard_for_rank", "sync_gradients", "unwrap", "wrap_model"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
