"""Triton from the ground up: a vector add, a fused row softmax and a fused RMSNorm forward.

Each is one kernel and a small wrapper that checks its input, allocates the output and launches
a grid of programs; each must equal its eager reference (torch's `x + y`, `torch.softmax` in
float32, logitlab.model.norms.RMSNorm), tests/triton/test_triton_basics.py checks that they do.

The ideas, in the order a reader meets them:
- a program (one instance of the kernel) owns one block of the data: its id (tl.program_id)
  picks the block, tl.arange lists the offsets inside it;
- a block's length is a power of two, so the last block of a length that is not one hangs over
  the end: loads and stores take a mask (offsets < n), and masked loads return `other`;
- fusion: a row softmax reads its row once, keeps max, exponentials and sum in registers, and
  writes the result once, where eager torch makes a pass over memory per operation.
Statistics are kept in float32 whatever the input dtype, as the eager references do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_common import block_size, check_tensor

VECTOR_BLOCK = 1024                                                # elements per program
MAX_ROW = 1 << 16                                                  # a row must fit one program


# ------------------------------------------------------------------------------------------
# 1. Vector add: one block of BLOCK elements per program
# ------------------------------------------------------------------------------------------

@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)                       # (BLOCK,) this program's slots
    mask = offs < n                                                # the last block hangs over n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two tensors of one shape and dtype (the sum rounded once to that dtype)."""
    check_tensor("x", x)
    check_tensor("y", y)
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"vector_add needs one shape and dtype, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(y.shape)} {y.dtype}")
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    grid = (triton.cdiv(n, VECTOR_BLOCK),)
    _add_kernel[grid](x, y, out, n, BLOCK=VECTOR_BLOCK)
    return out


# ------------------------------------------------------------------------------------------
# 2. Fused softmax: one row per program, read once, written once
# ------------------------------------------------------------------------------------------

@triton.jit
def _softmax_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                            # row * stride may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # padding lanes read -inf: exp(-inf) = 0 adds nothing to the sum
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)                                      # the largest exponent is 0
    e = tl.exp(x)
    y = e / tl.sum(e, axis=0)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension, computed in float32 and rounded to x's dtype, as
    torch.softmax(x.float(), -1).to(x.dtype). A row of -inf gives NaN, as torch's does."""
    check_tensor("x", x)
    n_cols = x.shape[-1]
    if not 0 < n_cols <= MAX_ROW:
        raise ValueError(f"softmax rows must have 1 to {MAX_ROW} entries, got {n_cols}")
    rows = x.reshape(-1, n_cols)                                   # (N, C)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _softmax_kernel[(rows.shape[0],)](rows, out, n_cols, rows.stride(0), out.stride(0),
                                      BLOCK=block_size(n_cols, 1))
    return out.view(x.shape)


# ------------------------------------------------------------------------------------------
# 3. Fused RMSNorm forward: y = weight * x / sqrt(mean(x^2) + eps), one row per program
# ------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, x_stride, y_stride, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                            # row * stride may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)     # padding lanes add 0
    # the normalised value is rounded to x's dtype before the weight multiplies it (as RMSNorm)
    xhat = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, (xhat * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """RMSNorm over the last dimension: x (..., D), weight (D,) -> (y (..., D), rstd (N,) float32)
    with N the number of rows; y has the dtype torch gives weight * x (RMSNorm's). rstd =
    1 / sqrt(mean(x^2) + eps) per row, which a backward pass reuses (kernels.triton_norm)."""
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=1)
    D = x.shape[-1]
    if weight.shape[0] != D or not 0 < D <= MAX_ROW:
        raise ValueError(f"weight has {weight.shape[0]} entries for rows of {D} (at most {MAX_ROW})")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    rows = x.reshape(-1, D)                                        # (N, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.result_type(weight, x), device=x.device)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    _rms_norm_fwd_kernel[(rows.shape[0],)](rows, weight.contiguous(), y, rstd, D, rows.stride(0),
                                           y.stride(0), eps, BLOCK=block_size(D, 1))
    return y.view(x.shape), rstd
