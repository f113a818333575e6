"""What `logitlab train` does differently on the ranks torchrun starts (cli/train.py's cmd_train
calls it): a resume that asks for another number of ranks than the run had gets its mesh
inferred where it can be."""

from __future__ import annotations

import dataclasses
import os


def env_world_size() -> int:
    """WORLD_SIZE, which torchrun sets for its ranks."""
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"environment variable WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


_MESH_FLAGS = ("tp", "pp", "ep", "dp_replicate", "dp_shard")


def fit_resumed_mesh(args, cfg, world_size: int):
    """A resume under torchrun takes the run's layout (run.json) where it fits this job's world
    size. Where it does not (the run started on another number of ranks) and no mesh flag was
    given, the data-parallel dimensions are inferred: --dp-shard takes the ranks that --tp,
    --pp and --dp-replicate leave, and --dp-replicate falls back to 1 when those do not divide
    the world size. --tp and --pp cut the model, so they are never guessed (any layout reads a
    sharded checkpoint: give them). The inferred values go into `args`, where the resume reads them."""
    def fits(c) -> bool:
        try:
            c.parallel_plan().resolve(world_size)
            return True
        except ValueError:
            return False

    if fits(cfg) or any(hasattr(args, name) for name in _MESH_FLAGS):
        return cfg  # fits, or the user chose the mesh: parallel_hooks names any mismatch
    for inferred in (dataclasses.replace(cfg, dp_shard=-1), dataclasses.replace(cfg, dp_shard=-1, dp_replicate=1)):
        if fits(inferred):
            args.dp_shard, args.dp_replicate = inferred.dp_shard, inferred.dp_replicate
            return inferred
    if world_size % (cfg.tp * cfg.pp):
        raise ValueError(f"--resume {args.resume}: the run's layout --tp {cfg.tp} --pp {cfg.pp} needs a multiple of "
                         f"{cfg.tp * cfg.pp} ranks, and this job has {world_size}; give --tp and --pp that fit (a "
                         "sharded checkpoint loads into any layout)")
    return cfg  # another misfit (e.g. --parallel ddp with --tp): parallel_hooks names it
