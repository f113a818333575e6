"""Expert parallelism (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): the experts of
every mixture-of-experts layer spread over the `ep` ranks of an expert-parallel group, each rank
holding E / ep of them, and every token sent to the rank that holds each of its experts and its
result sent back, by two all-to-all exchanges per layer. Applied to a built model from outside
(apply.py calls it after tensor parallelism, before activation checkpointing and FSDP2).

What changes in a layer, and what does not. The router, the shared expert and the capacity
check run on this rank's own tokens, as in one process. Only the routed experts' products move:

    1. the (token, slot) assignments sorted by expert (model.moe.sort_by_expert): experts
       0..E/ep-1 live on ep rank 0, the next E/ep on rank 1, ..., so the sorted rows are
       already cut into one contiguous piece per destination rank;
    2. the counts per expert go to their ranks (an all-to-all of ep x E/ep integers), so that
       every rank knows how many rows it will receive from each source, for each local expert;
    3. the rows go (all_to_all_single with those split sizes: uneven, one host sync);
    4. the received rows, ordered by source then local expert, are put in local-expert order
       and run through this rank's experts (Experts.products on their local shards);
    5. the results take the way back (steps 4 and 3 reversed), are weighted by the router and
       added to their tokens.

The two exchanges are an autograd.Function whose backward is the opposite exchange, so the
gradient of an expert's weights sums the contributions of every rank's tokens. Both run on
torch.distributed.all_to_all_single: gloo's CPU all-to-all (which takes uneven split sizes)
in the tests, NCCL's on GPUs, the same code.

The weights: each experts tensor (E, ...) becomes a DTensor sharded on its expert dimension over
the ep mesh (Shard(0)); a rank's products read its local (E / ep, ...) piece. Its state-dict keys
and global shapes are the model's, so a sharded checkpoint (sharded.py) reloads on any other ep
degree, data-parallel layout or one process. FSDP2 then shards those pieces over the remaining
data-parallel ranks (apply.py: mesh.expert_dp_mesh, on dim 1, the experts' own dim already being
split). The gradients: a rank's experts see the rows of every rank of its ep group, so their
gradient sums ep ranks' losses; it is divided by ep on the way back (_local), and FSDP2's mean
over the other data-parallel ranks makes it the mean over all of them, as for every other weight.

Shapes: N tokens of this rank, D d_model, E experts, El = E / ep local experts, K per token,
n assignments this rank sends, m it receives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from logitlab.model.moe import Experts, MoE, sort_by_expert


class _AllToAll(torch.autograd.Function):
    """rows (n, D) cut into `send` pieces, piece r to rank r of `group` -> the (m, D) rows every
    rank sent here, `recv` from each, in rank order. Backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of rows (n, D): send[r] rows to rank r, recv[r] from it."""
    return _AllToAll.apply(rows, send, recv, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts (ep, El): this rank's rows for each local expert of each rank -> (ep, El): what each
    source rank sends here, for each of this rank's experts."""
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts.contiguous(), group=group)
    return got


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, t, scale: float):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local(t: torch.Tensor | None, ep: int) -> torch.Tensor | None:
    """This rank's piece of an expert tensor (a DTensor sharded over ep; a plain tensor as it is),
    its gradient divided by ep. Each rank's loss is the mean over its own tokens and the training
    loss the mean over the data-parallel ranks, so an expert's gradient must be the mean of the
    ranks' contributions: this rank's experts receive the sum over the ep ranks of its group
    (the all-to-all's rows), hence 1 / ep here; FSDP2 then averages over the groups (apply.py)."""
    if t is None:
        return None
    local = t.to_local() if hasattr(t, "to_local") else t
    return _ScaleGrad.apply(local, 1.0 / ep) if local.requires_grad else local


def expert_parallel_routed(moe: MoE, x: torch.Tensor, weights, experts, keep, group, ep: int) -> torch.Tensor:
    """The routed experts' weighted sum for this rank's tokens x (N, D) -> (N, D), the experts'
    products run on the ranks of `group` that hold them (steps 1-5 of the module docstring)."""
    E = moe.config.n_experts
    El = E // ep
    used, counts, _, token = sort_by_expert(experts, keep, E)              # (n,), (E,), (n,), (n,)
    got = exchange_counts(counts.view(ep, El), group)                      # (ep, El) [source, local expert]
    send, recv = counts.view(ep, El).sum(1).tolist(), got.sum(1).tolist()  # rows per destination / source
    rows = all_to_all(x[token], send, recv, group)                         # (m, D) by source, then expert
    ids = torch.arange(El, device=x.device).repeat(ep).repeat_interleave(got.reshape(-1))   # (m,) local expert
    order = torch.argsort(ids, stable=True)                                # by local expert, then source
    y = moe.experts(rows[order], got.sum(0), ids[order])                   # (m, D) this rank's experts
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)         # the inverse permutation
    y = all_to_all(y[back], recv, send, group)                             # (n, D) in the order sent
    y = y * weights.reshape(-1)[used, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


class ExpertParallelExperts(Experts):
    """The experts of an expert-parallel layer, called as a module (so that FSDP2's hooks
    gather their shards around the call): rows (m, D) grouped by local expert, counts (El,),
    ids (m,) -> each row through its expert on this rank's (El, ...) pieces (step 4)."""

    ep_size = 1

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        stacked = tuple(_local(t, self.ep_size) for t in self.stacked())  # (El, ...) this rank's experts
        return self.products(rows, counts, ids, stacked)


class ExpertParallelMoE(MoE):
    """An MoE layer whose routed experts run on the ranks of its expert-parallel group
    (expert_parallel_routed); everything else is MoE's own. Set by apply_expert_parallel."""

    ep_group = None
    ep_size = 1

    def routed(self, x, weights, experts, keep):
        return expert_parallel_routed(self, x, weights, experts, keep, self.ep_group, self.ep_size)


def check_expert_parallel(config, ep: int) -> None:
    """ValueError naming the field when `config` cannot spread its experts over `ep` ranks."""
    if not config.is_moe:
        raise ValueError(f"--ep {ep}: expert parallelism needs a mixture-of-experts model (n_experts > 0)")
    if config.n_experts % ep:
        raise ValueError(f"--ep {ep}: n_experts ({config.n_experts}) must be divisible by ep, so that every rank "
                         "holds the same number of experts")


def apply_expert_parallel(model: nn.Module, ep_mesh) -> nn.Module:
    """Spread the experts of every MoE layer of a built model over the 1-D DeviceMesh `ep_mesh`
    (each expert tensor a DTensor sharded on dim 0), in place, and switch the layers to
    ExpertParallelMoE (same parameters, keys and hooks). Every rank must hold the same weights
    (parallelize broadcasts rank 0's first). -> model."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    check_expert_parallel(model.config, ep)
    for module in model.modules():
        if not isinstance(module, MoE) or isinstance(module, ExpertParallelMoE):
            continue
        experts = module.experts
        if type(experts) is not Experts:
            raise ValueError(f"expert parallelism spreads plain experts; these are {type(experts).__name__} "
                             "(LoRA adapters or another kernel on the experts): apply --ep to the model without them")
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.__class__, experts.__class__ = ExpertParallelMoE, ExpertParallelExperts
        module.ep_group, module.ep_size, experts.ep_size = ep_mesh.get_group(), ep, ep
    return model


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The Experts module of every expert-parallel MoE layer of `model` (what apply.py shards with FSDP2 apart)."""
    return [m.experts for m in model.modules() if isinstance(m, ExpertParallelMoE)]


__all__ = ["ExpertParallelExperts", "ExpertParallelMoE", "all_to_all", "apply_expert_parallel", "check_expert_parallel",
           "exchange_counts", "expert_modules", "expert_parallel_routed"]
