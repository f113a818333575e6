"""The ZeRO stages (Rajbhandari et al. 2020) on torch.distributed, applied to a built model
from outside, and the optimizer each stage needs.

    stage    what each of N ranks keeps 1/N of       how
    ddp      nothing (every rank holds everything)   DistributedDataParallel + AdamW
    zero1    optimizer state                         DDP + ZeroRedundancyOptimizer(AdamW)
    zero2    optimizer state, gradients              FSDP2 fully_shard(reshard_after_forward=False)
    fsdp     optimizer state, gradients, weights     FSDP2 fully_shard (ZeRO-3)

ZeRO-2 through FSDP2 keeps the gathered weights between forward and backward (no second
all-gather), so its peak holds the full weights of the model during a step; between steps each
rank holds only its shard, gradients are reduce-scattered, and the optimizer updates the shard.
ZeroRedundancyOptimizer partitions whole parameters across ranks (greedily, by size), so its
shares are close to, not exactly, 1/N; the FSDP2 stages split every parameter's first dimension.

    model = apply_zero(model, "zero2")
    optimizer = build_zero_optimizer(model, "zero2", lr=3e-4, weight_decay=0.1)
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from logitlab.parallel.setup import DistInfo, current_info

ZeroStage = Literal["ddp", "zero1", "zero2", "fsdp"]
ZERO_STAGES = ("ddp", "zero1", "zero2", "fsdp")
STAGE_NUMBER = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}


def check_stage(stage: str) -> str:
    if stage not in ZERO_STAGES:
        raise ValueError(f"parallel must be one of {ZERO_STAGES} (ZeRO stage 0, 1, 2, 3), got {stage!r}")
    return stage


def apply_zero(model: nn.Module, stage: ZeroStage, info: DistInfo | None = None, *,
               mesh=None, mp_policy=None) -> nn.Module:
    """Wrap `model` for ZeRO stage `stage` (see the module docstring); build the optimizer after
    with build_zero_optimizer. mesh: the data-parallel DeviceMesh for the FSDP2 stages (default:
    every rank). Every rank starts from rank 0's weights."""
    check_stage(stage)
    info = info or current_info()
    if not dist.is_initialized():
        raise ValueError(f"parallel {stage!r} needs a process group: launch with torchrun and call "
                         "init_distributed() first")
    model = model.to(info.device)
    if stage in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(f"{stage} needs the model's layers in `model.blocks`; {type(model).__name__} has none")
    if mesh is None:
        _broadcast_from_rank0(model)
    keep = stage == "zero2"  # ZeRO-2: gathered weights stay from forward to backward
    kw = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):
        fully_shard(block, reshard_after_forward=not keep, **kw)
    fully_shard(model, reshard_after_forward=not keep, **kw)
    return model


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as logitlab's trainer forms them: matrices (ndim >= 2) decay, vectors do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_zero_optimizer(model: nn.Module, stage: ZeroStage, lr: float, weight_decay: float = 0.0,
                         betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                         param_groups: list[dict] | None = None) -> torch.optim.Optimizer:
    """AdamW for a model wrapped by apply_zero: ZeroRedundancyOptimizer around it for zero1 (each
    rank keeps and updates the moments of its partition, then broadcasts its parameters), plain
    AdamW over the (already sharded) parameters otherwise. param_groups: explicit groups
    (default: decay for matrices only)."""
    check_stage(stage)
    groups = param_groups if param_groups is not None else _param_groups(model, weight_decay)
    groups = [g for g in groups if g["params"]]
    if stage != "zero1":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    first, *rest = groups
    opt = ZeroRedundancyOptimizer(first["params"], optimizer_class=torch.optim.AdamW, lr=lr, betas=betas,
                                  eps=eps, weight_decay=first.get("weight_decay", 0.0))
    for group in rest:
        opt.add_param_group(group)
    return opt


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors this rank holds (its shard under zero1 / FSDP2)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                total += _local(value).numel() * value.element_size()
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds now, in bytes: its weights, gradients and optimizer state (local
    shards of DTensors), as the planner (parallel.planner) predicts them."""
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(_local(p).numel() * p.element_size() for p in params)
    grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)
    return {"weights": weights, "gradients": grads, "optimizer": optimizer_state_bytes(optimizer)}
