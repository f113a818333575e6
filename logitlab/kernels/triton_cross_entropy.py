"""Fused LM head + cross-entropy in Triton: the mean next-token loss of h @ weight^T without
ever holding the (N, V) logits, as Liger-Kernel's FusedLinearCrossEntropy does.

With V = 248,320 the logits are the largest tensor of a training step: (B*T, V) in float32 is
1 GiB per 1,024 positions, and autograd keeps them (and their gradient) alive. Here the rows go
through in chunks of C: for each chunk the head product (C, V) is formed in the input dtype, one
Triton program per row computes its log-sum-exp online over blocks of the vocabulary, its loss,
and overwrites the row with its gradient (softmax - onehot) / n_valid in place; the chunk's
gradients for h and the weight are then two matrix products, and the chunk is dropped. The
gradients are ready when forward returns; backward scales them by the incoming gradient.
Peak extra memory: one (C, V) chunk in the input dtype plus a float32 (V, D) weight gradient,
instead of (N, V) float32 logits, their log-softmax and their gradient.

The reference is logitlab.train.loss.cross_entropy(h @ weight^T, targets): mean over targets
that are not ignore_index (-100), NaN when every target is ignored (as F.cross_entropy).
Shapes: N rows (B*T), D model width, V vocabulary, C rows per chunk.

The forward pass is the custom operator logitlab::linear_cross_entropy (torch.library.custom_op,
returning the loss and both gradients, with a fake implementation for their shapes); its
register_autograd backward only scales the saved gradients. torch.compile keeps it as one
opaque op: the count of valid targets and the range check of the targets, which read values,
happen inside it, where they break no graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_common import INTERPRET, check_tensor
from logitlab.kernels.triton_io import default_chunk_rows

IGNORE_INDEX = -100


@triton.jit
def _ce_rows_kernel(logits_ptr, stride, targets_ptr, loss_ptr, V, ignore_index, grad_scale,
                    BLOCK_V: tl.constexpr):
    """One row of logits (C, V): loss_ptr[row] = lse - logit[target] (0 when ignored); the row is
    overwritten with grad_scale * (softmax - onehot(target)) (zeros when ignored)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)   # running max (a scalar)
    acc = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)               # running sum of exp(x - m)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(acc)
    x_t = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
    scale = tl.where(valid, grad_scale, 0.0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)
        tl.store(base + offs, (g * scale).to(logits_ptr.dtype.element_ty), mask=offs < V)


def _check(h, weight, targets, ignore_index):
    check_tensor("h", h, ndim=2)
    check_tensor("weight", weight, ndim=2)
    if h.shape[1] != weight.shape[1] or h.device != weight.device:
        raise ValueError(f"h (N, D) and weight (V, D) must share D and device, got {tuple(h.shape)} on {h.device} "
                         f"and {tuple(weight.shape)} on {weight.device}")
    if targets.shape != (h.shape[0],) or targets.dtype != torch.long or targets.device != h.device:
        raise ValueError(f"targets must be int64 of shape ({h.shape[0]},) on {h.device}, got {targets.dtype} "
                         f"{tuple(targets.shape)} on {targets.device}")


def _check_targets(targets: torch.Tensor, V: int, ignore_index: int) -> None:
    """ValueError naming the first target outside [0, V) that is not ignore_index (reads values)."""
    bad = ((targets < 0) | (targets >= V)) & (targets != ignore_index)
    if bool(bad.any()):
        raise ValueError(f"targets must be in [0, {V}) or ignore_index ({ignore_index}); got "
                         f"{int(targets[bad][0])}")


@torch.library.custom_op("logitlab::linear_cross_entropy", mutates_args=())
def _forward_op(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (N, D), weight (V, D), targets (N,) -> (mean loss over valid rows, float32 scalar;
    its gradient for h (N, D) in h's dtype; for weight (V, D) in weight's dtype)."""
    N, D = h.shape
    V = weight.shape[0]
    _check_targets(targets, V, ignore_index)
    w = weight.to(h.dtype)                                         # (V, D): the head product's dtype
    n_valid = int((targets != ignore_index).sum())
    losses = torch.empty(N, dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h)
    grad_w = torch.zeros(V, D, dtype=torch.float32, device=h.device)
    block_v = min(triton.next_power_of_2(V), 1024 if INTERPRET else 4096)
    for start in range(0, N, chunk_rows):
        h_c, t_c = h[start:start + chunk_rows], targets[start:start + chunk_rows]
        logits = h_c @ w.t()                                       # (C, V) in dtype, then its gradient
        _ce_rows_kernel[(h_c.shape[0],)](logits, logits.stride(0), t_c, losses[start:start + chunk_rows],
                                         V, ignore_index, 1.0 / max(n_valid, 1), BLOCK_V=block_v)
        grad_h[start:start + chunk_rows] = logits @ w              # (C, V) @ (V, D)
        grad_w += (logits.t() @ h_c).float()                       # (V, C) @ (C, D)
    loss = losses.sum() / n_valid if n_valid else losses.sum() * float("nan")
    return loss, grad_h, grad_w.to(weight.dtype)


@_forward_op.register_fake
def _forward_fake(h, weight, targets, ignore_index, chunk_rows):
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    _, grad_h, grad_w = output
    ctx.save_for_backward(grad_h, grad_w)
    ctx.mark_non_differentiable(grad_h, grad_w)


def _backward(ctx, grad_loss, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    return grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy (nats, float32 scalar) of the logits h @ weight^T against targets, by
    chunks of rows: h (B, T, D) or (N, D), weight (V, D) (an LM head, e.g. lm_head.weight[:V]),
    targets (B, T) or (N,) in [0, V) or ignore_index. Differentiable in h and weight."""
    h2 = h.reshape(-1, h.shape[-1]) if isinstance(h, torch.Tensor) else h
    t2 = targets.reshape(-1) if isinstance(targets, torch.Tensor) else targets
    if not isinstance(t2, torch.Tensor):
        raise ValueError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    _check(h2, weight, t2, ignore_index)
    N, D = h2.shape
    chunk = default_chunk_rows(N, weight.shape[0], D) if chunk_rows is None else int(chunk_rows)
    if chunk < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return _forward_op(h2.contiguous(), weight, t2.contiguous(), int(ignore_index), chunk)[0]
