"""One call that parallelises a built Transformer by a ParallelPlan, in a fixed order (as
torchtitan's parallelize_llama does): pipeline stages cut first (each rank keeps its layers),
then tensor/sequence parallelism, expert parallelism, activation checkpointing, torch.compile,
and data parallelism last (FSDP2 over the dp dimensions of the mesh, the experts of an
expert-parallel model over the dp ranks their ep groups leave; or DDP / ZeRO-1 in a pure
data-parallel job).

    par = parallelize(model, ParallelPlan(tp=2, dp_shard=2), info)
    optimizer = par.build_optimizer(lr=3e-4, weight_decay=0.1)
    loss = par.forward_backward(x, y)    # this replica's rows of the step: x, y (B, T)
    norm = par.clip_grad_norm(1.0); optimizer.step(); optimizer.zero_grad()
    mean = par.global_loss(loss)         # the whole global batch's loss, on every rank

The fused q|k|v and gate|up projections are always split into their parts first (see
tensor.py), so the parameter names are the same whatever the layout: a sharded checkpoint
written by one layout loads into any other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from logitlab.parallel import pipeline as pp_mod
from logitlab.parallel.activation import apply_activation_checkpointing
from logitlab.parallel.expert import apply_expert_parallel, expert_modules
from logitlab.parallel.mesh import ParallelPlan, build_mesh, dp_coordinates, dp_mesh, expert_dp_mesh, expert_mesh
from logitlab.parallel.setup import DistInfo, current_info
from logitlab.parallel.tensor import (
    apply_tensor_parallel,
    loss_parallel_context,
    split_fused_projections,
    vocab_parallel_loss,
)
from logitlab.parallel.wrap import sync_gradients
from logitlab.parallel.zero import _broadcast_from_rank0, _param_groups, apply_zero, build_zero_optimizer


@dataclass
class Parallelized:
    """A model parallelised by `parallelize`: what this rank runs and how to step it."""

    plan: ParallelPlan
    info: DistInfo
    mesh: object
    modules: list[nn.Module]             # what this rank trains: the wrapped model, or its pipeline stages
    dp: DistInfo                         # this rank's data-parallel coordinates (for shard_for_rank)
    schedule: object = None
    stages: list = field(default_factory=list)
    timers: list = field(default_factory=list)
    expert_mesh: object = None           # (pp, dp_replicate, efsdp, ep, tp) when ep > 1 (mesh.expert_mesh)

    @property
    def model(self) -> nn.Module:
        """The (single) wrapped module; under pipeline parallelism the first of this rank's stages."""
        return self.modules[0]

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    @property
    def has_loss(self) -> bool:
        """Whether this rank computes the loss (every rank, or the last pipeline stage's)."""
        return not self.pipelined or any(i == self.n_stages - 1 for i, _ in self.stages)

    @property
    def n_stages(self) -> int:
        return self.plan.pp * self.plan.virtual_stages

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data-parallel ranks (in place; every rank calls it): what an
        MoE's balancing loss needs to count its experts' loads over the global batch."""
        if not self.info.distributed:
            return tensor
        if self.plan.tp > 1 or self.plan.pp > 1:
            raise ValueError("sum_over_dp: with --tp or --pp the ranks of a replica share rows; a sum over all "
                             "ranks would count them more than once")
        dist.all_reduce(tensor)
        return tensor

    def build_optimizer(self, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8,
                        param_groups=None):
        """AdamW over this rank's parameters (ZeroRedundancyOptimizer for parallel='zero1').
        param_groups: holder -> AdamW groups (default: decay for matrices only), where holder is
        the module this rank trains (its pipeline stages in one nn.ModuleList)."""
        stage = self.plan.parallel if self.info.distributed and self.plan.dp > 1 else "ddp"
        holder = self.holder()
        groups = param_groups(holder) if param_groups is not None else _param_groups(holder, weight_decay)
        return build_zero_optimizer(holder, stage, lr, weight_decay, betas, eps, param_groups=groups)

    def holder(self) -> nn.Module:
        """The one module holding what this rank trains (its stages in an nn.ModuleList)."""
        return nn.ModuleList(self.modules) if len(self.modules) > 1 else self.modules[0]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool = True,
                         scale: float = 1.0, loss_fn=None) -> torch.Tensor | None:
        """Forward and backward of this replica's rows x, y (B, T); gradients accumulate (scaled
        by `scale`, e.g. 1 / grad_accum); `sync=False` skips the data-parallel reduction (all but
        the last micro-step). loss_fn(x, y) -> the loss to differentiate, calling the wrapped
        model itself (an MoE's router losses; default: the cross-entropy of model(x)); not
        under pipeline parallelism, whose schedule computes the loss.
        -> the mean loss of these rows (None on pipeline ranks without the last stage)."""
        device = self.info.device
        x, y = x.to(device), y.to(device)
        if loss_fn is not None and self.pipelined:
            raise ValueError("forward_backward: a loss_fn is not available under pipeline parallelism")
        if self.pipelined:
            with _pipeline_sync(self.modules, sync):
                losses = pp_mod.run_schedule(self.schedule, self.stages, self.n_stages, x, y, scale)
            return torch.stack(losses).mean() if losses else None
        model = self.model
        with sync_gradients(model, sync), loss_parallel_context(_inner(model)):
            loss = vocab_parallel_loss(model(x), y) if loss_fn is None else loss_fn(x, y)
            (loss * scale).backward()
        return loss.detach()

    def global_loss(self, local: torch.Tensor | None) -> float:
        """The mean of the loss over the global batch, on every rank (every rank calls it)."""
        if not self.info.distributed:
            return float(local)
        value = torch.zeros((), dtype=torch.float64, device=self.info.device)
        if local is not None and self.has_loss:
            value += float(local)
        dist.all_reduce(value)
        return float(value) / (self.plan.dp * self.plan.tp)

    def clip_grad_norm(self, max_norm: float | None) -> float:
        group = self.mesh["pp"].get_group() if self.pipelined else None
        return clip_grad_norm_nd(self.parameters(), max_norm, group)


@contextlib.contextmanager
def _pipeline_sync(modules: list[nn.Module], sync: bool):
    """The data-parallel gradient sync of a pipeline step's stages on or off (sync_gradients for each)."""
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(sync_gradients(module, sync))
        yield


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _mp_policy(mixed_precision: bool, device: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _data_parallel(module: nn.Module, plan: ParallelPlan, mesh, info: DistInfo, mixed_precision: bool,
                   emesh=None):
    if plan.dp == 1:
        return module
    policy = _mp_policy(mixed_precision, info.device)
    if plan.parallel in ("ddp", "zero1"):
        return apply_zero(module, plan.parallel, info)
    if emesh is not None:
        _shard_experts(module, plan, emesh, policy)
    return apply_zero(module, plan.parallel, info, mesh=dp_mesh(plan, mesh), mp_policy=policy)


def _shard_experts(module: nn.Module, plan: ParallelPlan, emesh, policy) -> None:
    """FSDP2 for the experts of an expert-parallel model, before their blocks: over the dp ranks
    the ep groups leave (mesh.expert_dp_mesh), on dim 1 (dim 0, the experts, is already split
    over ep), the gradient averaged over those ranks (expert.py has divided it by ep already)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for experts in expert_modules(module):
        fully_shard(experts, mesh=expert_dp_mesh(plan, emesh), mp_policy=policy,
                    reshard_after_forward=plan.parallel == "fsdp", shard_placement_fn=lambda p: Shard(1))


def _shard_one(module: nn.Module, plan: ParallelPlan, mesh, seq_len: int | None, emesh=None) -> nn.Module:
    if plan.tp > 1:
        apply_tensor_parallel(module, mesh["tp"], plan.sequence_parallel, seq_len, sharded_logits=plan.pp == 1)
    if emesh is not None:
        apply_expert_parallel(module, emesh["ep"])
    apply_activation_checkpointing(module, plan.activation_checkpointing)
    if plan.compile:
        for block in (module.blocks.values() if isinstance(module.blocks, nn.ModuleDict) else module.blocks):
            block.compile()
    return module


def _check_recipe_options(config, plan: ParallelPlan) -> None:
    """The training recipe's model options that these layouts do not run yet: a pipeline stage
    computes neither value embeddings (a later stage has no token ids) nor the logits' soft cap,
    and tensor parallelism does not split a value-embedding table by heads."""
    ve = getattr(config, "value_embeddings", "none") != "none"
    cap = getattr(config, "logit_softcap", None) is not None
    if plan.pp > 1 and (ve or cap):
        raise ValueError("--pp does not run value_embeddings or logit_softcap yet; train this model with "
                         "ddp, zero2, fsdp or --tp")
    if plan.tp > 1 and ve:
        raise ValueError("--tp does not split value_embeddings by heads yet; train this model with ddp, zero2 or fsdp")


def parallelize(model: nn.Module, plan: ParallelPlan, info: DistInfo | None = None, *,
                seq_len: int | None = None, mixed_precision: bool = False) -> Parallelized:
    """Apply `plan` to a built model (same weights expected on every rank: rank 0's are
    broadcast first), in the order pipeline, TP, EP, activation checkpointing, compile, data
    parallel. Build the optimizer afterwards (Parallelized.build_optimizer)."""
    info = info or current_info()
    plan = plan.resolve(info.world_size)
    _check_recipe_options(model.config, plan)
    model = split_fused_projections(model.to(info.device))
    if not info.distributed:
        _shard_one(model, plan, None, seq_len)   # resolve() made every dimension 1
        return Parallelized(plan, info, None, [model], DistInfo())
    _broadcast_from_rank0(model)
    mesh = build_mesh(plan, info)
    dp = dp_coordinates(plan, mesh)
    if plan.pp == 1:
        emesh = expert_mesh(plan, mesh)
        module = _shard_one(model, plan, mesh, seq_len, emesh)
        module = _data_parallel(module, plan, mesh, info, mixed_precision, emesh)
        return Parallelized(plan, info, mesh, [module], dp, expert_mesh=emesh)
    if plan.tp > 1 and plan.sequence_parallel:
        raise ValueError("sequence parallel inside pipeline stages is not supported here; use --pp with plain --tp")
    pp_rank = mesh["pp"].get_local_rank()
    stages = pp_mod.build_stages(model, pp_rank, plan.pp, plan.virtual_stages)
    wrapped = [(i, _data_parallel(_shard_one(m, plan, mesh, seq_len), plan, mesh, info, mixed_precision))
               for i, m in stages]
    timers = [pp_mod.StageTimer(m) for _, m in wrapped]
    schedule = pp_mod.build_schedule(wrapped, plan.pp * plan.virtual_stages, plan.pp_schedule,
                                     plan.microbatches(), info.device, mesh["pp"].get_group())
    return Parallelized(plan, info, mesh, [m for _, m in wrapped], dp, schedule, wrapped, timers)


@torch.no_grad()
def clip_grad_norm_nd(params, max_norm: float | None, pp_group=None) -> float:
    """Clip to a global L2 norm over every rank's gradients, whatever their layout (plain,
    DTensors on different meshes, pipeline stages on different ranks), and return the norm
    before clipping; torch's clip_grad_norm_ formula (coefficient max_norm / (norm + 1e-6), at most 1)."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if hasattr(g, "device_mesh") else "plain"
        groups.setdefault(key, []).append(g)
    device = grads[0].device if grads else current_info().device
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total_sq += norm.double() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = float(total_sq.sqrt())
    if max_norm and max_norm > 0:
        coef = min(max_norm / (total + 1e-6), 1.0)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


__all__ = ["Parallelized", "clip_grad_norm_nd", "parallelize"]
