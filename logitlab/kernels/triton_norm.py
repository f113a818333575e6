"""Fused RMSNorm forward and backward in Triton, as a torch.autograd.Function.

Forward is kernels.triton_basics.rms_norm_forward (one row per program; it saves 1/rms per row,
rstd). Backward, for y = w * xhat with xhat = x * rstd:

    dxhat = dy * w,   dx = rstd * (dxhat - xhat * mean(dxhat * xhat)),   dw = sum over rows of dy * xhat

One pass over dy and x: a program walks a strip of rows, writes dx per row and keeps a partial
dw (D,) in registers; the partials (P, D) are summed by torch (P programs, a few per GPU core),
so no atomics and the same result every run. The reference is logitlab.model.norms.RMSNorm
(tests/triton/test_triton_norm_loss.py); as there, xhat is rounded to x's dtype before w.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_basics import rms_norm_forward
from logitlab.kernels.triton_common import INTERPRET, block_size, check_tensor


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, N, D, rows_per_program,
                         BLOCK: tl.constexpr):
    """Rows [pid * rows_per_program, ...) of x, dy (N, D) contiguous -> dx rows, dw partial (P, D)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    first = pid.to(tl.int64) * rows_per_program                   # row * D may pass 2**31
    last = tl.minimum(first + rows_per_program, N)
    for row in range(first, last):
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        dxhat = dy * w
        dx = (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / D)) * rstd
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dw_ptr + pid * D + cols, dw, mask=mask)


def _programs(N: int, device: torch.device) -> int:
    """How many programs share the rows of the backward pass."""
    if INTERPRET or device.type != "cuda":
        return max(1, min(N, 4))
    return max(1, min(N, 4 * torch.cuda.get_device_properties(device).multi_processor_count))


def rms_norm_backward(dy, x, weight, rstd):
    """dy, x (N, D), weight (D,), rstd (N,) -> (dx (N, D) in x's dtype, dw (D,) in weight's dtype)."""
    N, D = x.shape
    P = _programs(N, x.device)
    rows = triton.cdiv(N, P)
    P = triton.cdiv(N, rows)
    dx = torch.empty_like(x)
    dw_partial = torch.empty(P, D, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(P,)](dy, x, weight, rstd, dx, dw_partial, N, D, rows, BLOCK=block_size(D, 1))
    return dx, dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """y = weight * round_x(x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        D = x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()                         # (N, D)
        y, rstd = rms_norm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy.reshape(x2.shape).contiguous(), x2, weight.contiguous(), rstd)
        return dx.view(ctx.x_shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of x (..., D) with weight (D,), differentiable in both, by the Triton kernels; the
    same values as logitlab.model.norms.RMSNorm(D, eps) with that weight."""
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} entries for rows of {x.shape[-1]}")
    return RMSNormFunction.apply(x, weight, float(eps))
