"""Several processes: the process group (setup.py), DDP and FSDP2 applied to a built model from
outside (wrap.py), and full states gathered for checkpoints (state.py).

N-D layouts (docs/parallelism.md): the ZeRO stages (zero.py) and their per-rank memory
(planner.py), tensor + sequence parallelism (tensor.py), pipeline schedules (pipeline.py),
activation checkpointing (activation.py), the named DeviceMesh of a ParallelPlan (mesh.py), all
applied in one fixed order by parallelize (apply.py), and sharded DCP checkpoints (sharded.py)."""

from logitlab.parallel.apply import Parallelized, clip_grad_norm_nd, parallelize
from logitlab.parallel.mesh import MESH_DIMS, ParallelPlan
from logitlab.parallel.planner import RankMemory, bubble_fraction, plan_all_stages, plan_rank_memory
from logitlab.parallel.setup import (
    DEFAULT_TIMEOUT_S,
    PARALLEL_MODES,
    DistInfo,
    RankFailureError,
    all_reduce_mean,
    any_rank,
    barrier,
    current_info,
    destroy,
    init_distributed,
    is_main_process,
    rank_failure_guard,
)
from logitlab.parallel.sharded import load_sharded, read_model_state, save_sharded
from logitlab.parallel.state import full_optimizer_state_dict, full_state_dict, load_full_state_dict
from logitlab.parallel.wrap import (
    clip_grad_norm,
    fsdp_bf16_supported,
    plan_grad_accum,
    rank_slice,
    shard_for_rank,
    sync_gradients,
    unwrap,
    wrap_model,
)

__all__ = ["DEFAULT_TIMEOUT_S", "MESH_DIMS", "PARALLEL_MODES", "DistInfo", "ParallelPlan", "Parallelized",
           "RankFailureError", "RankMemory", "all_reduce_mean", "any_rank", "barrier", "bubble_fraction",
           "clip_grad_norm", "clip_grad_norm_nd", "current_info", "destroy", "fsdp_bf16_supported",
           "full_optimizer_state_dict", "full_state_dict", "init_distributed", "is_main_process",
           "load_full_state_dict", "load_sharded", "parallelize", "plan_all_stages", "plan_grad_accum",
           "plan_rank_memory", "rank_failure_guard", "rank_slice", "read_model_state", "save_sharded",
           "shard_for_rank", "sync_gradients", "unwrap", "wrap_model"]
