"""Several processes: the process group (setup.py), DDP and FSDP2 applied to a built model from
outside (wrap.py), and full states gathered for checkpoints (state.py)."""

from logitlab.parallel.setup import (
    DEFAULT_TIMEOUT_S,
    PARALLEL_MODES,
    DistInfo,
    RankFailureError,
    all_reduce_mean,
    barrier,
    current_info,
    destroy,
    init_distributed,
    is_main_process,
    rank_failure_guard,
)
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

__all__ = ["DEFAULT_TIMEOUT_S", "PARALLEL_MODES", "DistInfo", "RankFailureError", "all_reduce_mean", "barrier",
           "clip_grad_norm", "current_info", "destroy", "fsdp_bf16_supported", "full_optimizer_state_dict",
           "full_state_dict", "init_distributed", "is_main_process", "load_full_state_dict", "plan_grad_accum",
           "rank_failure_guard", "rank_slice", "shard_for_rank", "sync_gradients", "unwrap", "wrap_model"]
