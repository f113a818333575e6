"""DDP and FSDP2 applied to a built, single-device model from outside, the gradient sync of
accumulated micro-steps, global-norm clipping over sharded gradients, and the batch arithmetic
(global batch = micro-batch x grad_accum x world size)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from logitlab.parallel.setup import PARALLEL_MODES, DistInfo, ParallelMode, current_info

# --------------------------------------------------------------------------------------------
# Wrapping the model
# --------------------------------------------------------------------------------------------

def fsdp_bf16_supported(device: torch.device) -> bool:
    """bf16 mixed precision under FSDP2 is used on CUDA devices that support bf16 only."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def wrap_model(model: nn.Module, mode: ParallelMode, mixed_precision: bool = False,
               info: DistInfo | None = None) -> nn.Module:
    """Apply data parallelism to a built model, from outside; build the optimizer afterwards.

    "none": the model itself (one process only). "ddp": DistributedDataParallel (rank 0's weights
    broadcast, gradients averaged). "fsdp": FSDP2 `fully_shard` on each of `model.blocks`, then on
    the root (embeddings, final norm, a tied head as one parameter); each rank keeps 1/world_size
    of every parameter, gradient and optimizer moment, as sharded DTensors replacing the
    parameters. mixed_precision: FSDP2 gathers weights in bf16 and reduces gradients in fp32 on
    CUDA devices with bf16, else fp32 with a warning; for "ddp" precision is the loop's autocast."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel mode must be one of {PARALLEL_MODES}, got {mode!r}")
    info = info or current_info()
    if mode == "none":
        if info.distributed:
            raise ValueError(f"parallel mode 'none' with world_size {info.world_size} would train "
                             f"{info.world_size} unrelated copies; use 'ddp' or 'fsdp'")
        return model
    if not dist.is_initialized():
        raise ValueError(f"parallel mode {mode!r} needs a process group: launch with torchrun "
                         "and call init_distributed() first (or use mode 'none')")
    model = model.to(info.device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"fsdp needs the model's layers in `model.blocks` (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    # fully_shard keeps each rank's own slice of the tensor it finds there, so every rank must
    # start from the same weights; copy rank 0's (DDP does the same at construction).
    _broadcast_from_rank0(model)
    policy = MixedPrecisionPolicy()
    if mixed_precision:
        if fsdp_bf16_supported(info.device):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            warnings.warn(f"mixed_precision: bf16 is not supported for FSDP on {info.device}; "
                          "training in fp32", stacklevel=2)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile (FSDP2 wraps in place: the same object)."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        model = model.module if ddp else model._orig_mod  # DDP / torch.compile's OptimizedModule
    return model


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


@contextlib.contextmanager
def sync_gradients(model: nn.Module, sync: bool) -> Iterator[None]:
    """Run one micro-step's backward inside this; `sync` is True only on the last micro-step.

    On the other micro-steps gradients are accumulated locally without communication (DDP:
    no_sync(); FSDP2: set_requires_gradient_sync(False)); the last one averages the accumulated
    sum across ranks once. Numerically the same as syncing every micro-step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with (contextlib.nullcontext() if sync else model.no_sync()):
            yield
    elif _is_fsdp(model):
        inner = unwrap(model)
        inner.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip gradients to a global L2 norm of max_norm (None or <= 0: measure only) and return
    the norm before clipping. Same value on every rank: under DDP the gradients are already
    averaged; under FSDP2 the shards' squares are summed over ranks (a DTensor, made full here)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm and max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# --------------------------------------------------------------------------------------------
# Data: the same global batch for every world size
# --------------------------------------------------------------------------------------------

def plan_grad_accum(global_batch: int, micro_batch: int, world_size: int) -> int:
    """grad_accum so that micro_batch x grad_accum x world_size == global_batch (else ValueError)."""
    if min(global_batch, micro_batch, world_size) <= 0:
        raise ValueError(f"global_batch ({global_batch}), micro_batch ({micro_batch}) and world_size "
                         f"({world_size}) must be > 0")
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ValueError(f"global_batch ({global_batch}) must be divisible by micro_batch ({micro_batch}) "
                         f"x world_size ({world_size}) = {per_step}")
    return global_batch // per_step


def rank_slice(n_rows: int, info: DistInfo, micro_step: int = 0, grad_accum: int = 1) -> slice:
    """Rows of a global batch of n_rows that this rank uses on micro-step `micro_step`.

    The global batch is cut into grad_accum consecutive chunks of world_size x b rows, and
    chunk k into world_size consecutive pieces of b rows: rank r's rows on micro-step k are
    [(k·W + r)·b, (k·W + r + 1)·b). Every row is used once per step, whatever W is."""
    parts = grad_accum * info.world_size
    if n_rows % parts:
        raise ValueError(f"global batch of {n_rows} rows cannot be split into grad_accum ({grad_accum}) "
                         f"x world_size ({info.world_size}) = {parts} equal parts")
    if not 0 <= micro_step < grad_accum:
        raise ValueError(f"micro_step ({micro_step}) must be in [0, grad_accum={grad_accum})")
    b = n_rows // parts
    start = (micro_step * info.world_size + info.rank) * b
    return slice(start, start + b)


def shard_for_rank(rows, info: DistInfo, micro_step: int = 0, grad_accum: int = 1):
    """This rank's part of the global batch `rows` (a tensor, array or list; first dim = rows).

    Pass the cheap thing when possible: the global batch's window start offsets, drawn with the
    same seed on every rank, so each rank reads only its own windows from the token file."""
    return rows[rank_slice(len(rows), info, micro_step, grad_accum)]


