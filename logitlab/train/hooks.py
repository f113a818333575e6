"""How the training loop talks to other processes: ParallelHooks (filled in from outside by
logitlab.parallel) and parallel_hooks(config) for a job torchrun started. The defaults are one
plain process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from logitlab.train.config import TrainConfig


@dataclass
class ParallelHooks:
    """How the loop talks to other processes; the defaults are a single plain process.

    Collective hooks (all_reduce, clip, model_state, optimizer_state, load_state) are called on
    every rank at the same points; model_state / optimizer_state return full CPU states on rank 0
    (in the single-process layout, so a run saved with N ranks resumes with M)."""

    rank: int = 0
    world_size: int = 1
    wrap: Callable | None = None               # model -> wrapped module (DDP / FSDP2), in place or not
    all_reduce: Callable | None = None         # float -> mean over ranks
    clip: Callable | None = None               # (wrapped, max_norm) -> pre-clip global norm
    model_state: Callable | None = None        # wrapped -> full state dict (rank 0)
    optimizer_state: Callable | None = None    # (wrapped, optimizer) -> full optimizer state (rank 0)
    load_state: Callable | None = None         # (wrapped, model_state, optimizer, optimizer_state) -> None
    barrier: Callable | None = None            # wait for every rank (after rank 0 saved)
    sync: Callable | None = None               # (wrapped, sync: bool) -> context for a micro-step's backward

    @property
    def main(self) -> bool:
        return self.rank == 0


def _launched_distributed() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def parallel_hooks(config: TrainConfig) -> ParallelHooks:
    """ParallelHooks for the job torchrun started (parallel.py: process group from the launcher's
    environment, config.parallel = "ddp" or "fsdp"); a plain process gets the defaults."""
    from logitlab import parallel as P

    if config.parallel == "none":
        return ParallelHooks()
    info = P.init_distributed(device="cpu" if config.device == "cpu" else None)
    if not info.distributed:
        return ParallelHooks()
    mixed = config.precision == "bf16" or (config.precision == "auto" and info.device.type == "cuda")
    return ParallelHooks(
        rank=info.rank, world_size=info.world_size,
        wrap=lambda m: P.wrap_model(m, config.parallel, mixed_precision=mixed, info=info),
        all_reduce=lambda v: float(P.all_reduce_mean(float(v))), clip=P.clip_grad_norm,
        model_state=P.full_state_dict, optimizer_state=P.full_optimizer_state_dict,
        load_state=P.load_full_state_dict, barrier=P.barrier, sync=P.sync_gradients)
