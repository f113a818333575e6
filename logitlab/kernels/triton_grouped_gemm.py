"""A grouped matrix product in Triton for a mixture of experts' expert products, forward and
backward: rows grouped by expert, each group times its own expert's matrix, in one launch.

model/moe_forms.py's grouped dispatch sorts the (token, expert) rows by expert, counts[e] rows for
expert e in turn, and multiplies every group by its expert (group_products: torch's grouped_mm
where it takes the shapes, else one product per group). Here one launch does all the groups:

    out[i] = x[i] @ W[e(i)]^T          x (n, K), W (E, N, K), out (n, N)

The rows are cut into tiles of BLOCK_M rows that never cross a group's border (a schedule built
on the device from the counts: each tile's expert, first and end row); a program takes one tile
and BLOCK_N output columns and loops over K, accumulating in float32. The backward uses the
same kernel for the rows' gradient (dx = dout @ W[e], W read through swapped strides) and a
second one for the weights' (dW[e] = dout_e^T x_e: a program per expert and output block loops
over its group's rows; an expert without rows gets a zero gradient).

`grouped_products(experts, rows, counts, ids)` is model.moe_forms.group_products through these kernels,
and `install_grouped_gemm(model)` makes every MoE layer's Experts use it (Experts.products, the
method the grouped form calls). Reference: model.moe_forms.group_products and a per-group loop of
F.linear (tests/triton/test_triton_grouped_gemm.py). Shapes: n rows, E experts, N output and
K input width of one expert's matrix.

The two passes are the custom operators logitlab::grouped_mm_forward and
logitlab::grouped_mm_backward (fake implementations for the shapes, register_autograd), as the
other kernels are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_common import check_tensor
from logitlab.model.moe import Experts, MoE
from logitlab.model.moe_forms import weigh_hidden

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, out_ptr, tile_expert, tile_start, tile_end, N, K,
                       sx0, sx1, sw0, sw1, sw2, so0, so1,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows] = x[rows] @ W[e]^T for tile pid (rows [start, end) of expert e); grid (tiles, cdiv(N, BLOCK_N))."""
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert + pid).to(tl.int64)
    start, end = tl.load(tile_start + pid), tl.load(tile_end + pid)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * sx0 + ks[None, :] * sx1,
                    mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)            # (BM, BK)
        b = tl.load(w_ptr + e * sw0 + cols[:, None] * sw1 + ks[None, :] * sw2,
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)           # (BN, BK)
        acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    tl.store(out_ptr + rows[:, None] * so0 + cols[None, :] * so1, acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < end) & (cols[None, :] < N))


@triton.jit
def _grouped_wgrad_kernel(dy_ptr, x_ptr, dw_ptr, group_start, group_end, N, K,
                          sd0, sd1, sx0, sx1, sw0, sw1, sw2,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dW[e] = dy[group e]^T @ x[group e], (N, K) block (pid_n, pid_k); grid (E, cdiv(N, BN), cdiv(K, BK))."""
    e, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(group_start + e), tl.load(group_end + e)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        d = tl.load(dy_ptr + rows[:, None] * sd0 + cols[None, :] * sd1,
                    mask=(rows[:, None] < end) & (cols[None, :] < N), other=0.0)       # (BM, BN)
        a = tl.load(x_ptr + rows[:, None] * sx0 + ks[None, :] * sx1,
                    mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)         # (BM, BK)
        acc += tl.dot(tl.trans(d.to(tl.float32)), a.to(tl.float32))
    tl.store(dw_ptr + e.to(tl.int64) * sw0 + cols[:, None] * sw1 + ks[None, :] * sw2,
             acc.to(dw_ptr.dtype.element_ty), mask=(cols[:, None] < N) & (ks[None, :] < K))


def tile_schedule(counts: torch.Tensor, block_m: int = BLOCK_M):
    """counts (E,) rows per expert -> (expert (T,), start (T,), end (T,)): tiles of at most block_m
    rows, each inside one group, covering every row once (on the counts' device)."""
    counts = counts.to(torch.int64)
    ends = counts.cumsum(0)                                                # (E,) end of each group
    tiles = (counts + block_m - 1) // block_m                              # (E,) tiles per group
    expert = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), tiles)  # (T,)
    first = (tiles.cumsum(0) - tiles)[expert]                              # (T,) the group's first tile
    j = torch.arange(len(expert), device=counts.device) - first            # (T,) tile index in its group
    start = (ends - counts)[expert] + j * block_m
    return expert.to(torch.int32), start.to(torch.int32), ends[expert].to(torch.int32)


def _launch_mm(x, w_strides, w, N, K, counts, out):
    expert, start, end = tile_schedule(counts)
    if len(expert):
        grid = (len(expert), triton.cdiv(N, BLOCK_N))
        _grouped_mm_kernel[grid](x, w, out, expert, start, end, N, K, x.stride(0), x.stride(1), *w_strides,
                                 out.stride(0), out.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


@torch.library.custom_op("logitlab::grouped_mm_forward", mutates_args=())
def _forward_op(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (n, K) grouped by expert, w (E, N, K), counts (E,) -> (n, N)."""
    E, N, K = w.shape
    return _launch_mm(x, (w.stride(0), w.stride(1), w.stride(2)), w, N, K, counts, x.new_empty(x.shape[0], N))


@_forward_op.register_fake
def _forward_fake(x, w, counts):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("logitlab::grouped_mm_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                 counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (n, N) -> (dx (n, K) = dy @ W[e] per row, dw (E, N, K) = dy_e^T x_e per expert)."""
    E, N, K = w.shape
    dx = _launch_mm(dy, (w.stride(0), w.stride(2), w.stride(1)), w, K, N, counts, x.new_empty(x.shape))
    dw = torch.empty_like(w)
    ends = counts.to(torch.int64).cumsum(0)
    starts = (ends - counts.to(torch.int64)).to(torch.int32)
    grid = (E, triton.cdiv(N, BLOCK_N), triton.cdiv(K, BLOCK_K))
    _grouped_wgrad_kernel[grid](dy, x, dw, starts, ends.to(torch.int32), N, K, dy.stride(0), dy.stride(1),
                                x.stride(0), x.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
                                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return dx, dw


@_backward_op.register_fake
def _backward_fake(dy, x, w, counts):
    return x.new_empty(x.shape), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, w, counts = ctx.saved_tensors
    dx, dw = _backward_op(dy.contiguous(), x, w, counts)
    return dx, dw, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (n, K) grouped by expert (counts[e] rows for expert e in turn), w (E, N, K) -> (n, N),
    row i times W[e(i)]^T; differentiable in x and w."""
    check_tensor("x", x, ndim=2)
    check_tensor("w", w, ndim=3)
    if x.shape[1] != w.shape[2] or counts.shape != (w.shape[0],) or int(counts.sum()) != x.shape[0]:
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and counts {tuple(counts.shape)} "
                         f"(summing to {int(counts.sum())}) do not fit: x (n, K), w (E, N, K), counts (E,) "
                         "summing to n")
    return _forward_op(x, w, counts)


def grouped_products(ex: Experts, rows: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor,
                     stacked: tuple | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """model.moe_forms.group_products by the Triton kernels: rows (n, D) grouped by expert ->
    (n, D), each row times scale[i] when given (on the narrower side, as there)."""
    w1, b1, w2, b2 = stacked or ex.stacked()
    h = grouped_mm(rows, w1, counts)                                       # (n, 2F)
    if b1 is not None:
        h = h + b1[ids]
    a = ex.act(h)                                                          # (n, F)
    early = scale is not None and weigh_hidden(w2, b2)
    if early:
        a = a * scale[:, None]
    y = grouped_mm(a, w2, counts)                                          # (n, D)
    if b2 is not None:
        y = y + b2[ids]
    return y * scale[:, None] if scale is not None and not early else y


class TritonExperts(Experts):
    """Experts whose grouped products run on the Triton kernels (install_grouped_gemm)."""

    def products(self, rows, counts, ids, stacked=None, scale=None):
        return grouped_products(self, rows, counts, ids, stacked, scale)


def install_grouped_gemm(model) -> int:
    """Make every MoE layer's experts of `model` use the Triton grouped product (in place: the
    same parameters and keys) -> the number of layers changed."""
    n = 0
    for module in model.modules():
        if isinstance(module, MoE) and type(module.experts) is Experts:
            module.experts.__class__ = TritonExperts
            n += 1
    return n


__all__ = ["TritonExperts", "grouped_mm", "grouped_products", "install_grouped_gemm", "tile_schedule"]
