"""How the training loop talks to other processes: ParallelHooks, filled in from outside
(train.layouts.parallel_hooks chooses them for a job). The defaults are one plain process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass
class ParallelHooks:
    """How the loop talks to other processes; the defaults are a single plain process.

    `rank` and `world_size` are this process's data-parallel coordinates: the rows of each
    global batch and the validation windows it reads. In a data-parallel job they are its rank
    in the job; under tensor or pipeline parallelism several processes share one data-parallel
    rank, and `is_main` names the one writing process (rank 0 of the job).

    Collective hooks (all_reduce, clip, model_state, optimizer_state, load_state, save) are
    called on every rank at the same points; model_state / optimizer_state return full CPU
    states on rank 0 (in the single-process layout, so a run saved with N ranks resumes with M).

    An N-D layout (train.layouts.sharded_hooks) also sets `setup` (the run's set-up, with
    sharded checkpoints instead of gathered ones), `forward_backward` (a micro-step's forward and
    backward, which a pipeline schedule runs as one), `evaluate` and `save`.

    Under torchrun `launcher_gone` says whether the launcher died (parallel.setup.launcher_gone):
    the ranks agree on it with the stop flags and stop after the same step, with a checkpoint."""

    rank: int = 0
    world_size: int = 1
    wrap: Callable | None = None               # model -> wrapped module (DDP / FSDP2), in place or not
    all_reduce: Callable | None = None         # float (None: no loss on this rank) -> mean over ranks
    clip: Callable | None = None               # (wrapped, max_norm) -> pre-clip global norm
    model_state: Callable | None = None        # wrapped -> full state dict (rank 0)
    optimizer_state: Callable | None = None    # (wrapped, optimizer) -> full optimizer state (rank 0)
    load_state: Callable | None = None         # (wrapped, model_state, optimizer, optimizer_state) -> None
    barrier: Callable | None = None            # wait for every rank (after rank 0 saved)
    sync: Callable | None = None               # (wrapped, sync: bool) -> context for a micro-step's backward
    agree: Callable | None = None              # (*flags: bool) -> each flag OR'd over ranks (stop together)
    is_main: bool | None = None                # the writing process (default: rank == 0)
    devices: int | None = None                 # processes in the job, for MFU (default: world_size)
    layout: str | None = None                  # the layout, in words, for display
    setup: Callable | None = None              # build.setup's signature -> Run (sharded checkpoints)
    forward_backward: Callable | None = None   # (wrapped, x, y, sync, scale) -> loss tensor | None
    evaluate: Callable | None = None           # run -> validation loss (every rank)
    save: Callable | None = None               # (run, state) -> checkpoint path on the main rank, else None
    launcher_gone: Callable | None = None      # () -> whether the launcher died (stop as for SIGTERM)

    @property
    def main(self) -> bool:
        return self.rank == 0 if self.is_main is None else self.is_main


def _launched_distributed() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
