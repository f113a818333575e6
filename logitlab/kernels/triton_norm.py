"""Fused RMSNorm forward and backward in Triton, as a differentiable custom operator.

Forward is kernels.triton_basics.rms_norm_forward (one row per program; it saves 1/rms per row,
rstd). Backward, for y = w * xhat with xhat = x * rstd:

    dxhat = dy * w,   dx = rstd * (dxhat - xhat * mean(dxhat * xhat)),   dw = sum over rows of dy * xhat

One pass over dy and x: a program walks a strip of rows, writes dx per row and keeps a partial
dw (D,) in registers; the partials (P, D) are summed by torch (P programs, a few per GPU core),
so no atomics and the same result every run. The reference is logitlab.model.norms.RMSNorm
(tests/triton/test_triton_norm_loss.py); as there, xhat is rounded to x's dtype before w.

The two passes are the custom operators logitlab::rms_norm_forward and logitlab::rms_norm_backward
(torch.library.custom_op, with fake implementations for the shapes and register_autograd), so
torch.compile keeps each as one opaque op instead of breaking its graph at the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_basics import MAX_ROW, rms_norm_forward
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


@torch.library.custom_op("logitlab::rms_norm_forward", mutates_args=())
def _forward_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, D) contiguous, weight (D,) -> (y (N, D) in the dtype of weight * x, rstd (N,) float32)."""
    return rms_norm_forward(x, weight, eps)


@_forward_op.register_fake
def _forward_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.result_type(weight, x)), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("logitlab::rms_norm_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x (N, D), weight (D,), rstd (N,) -> (dx (N, D) in x's dtype, dw (D,) in weight's dtype)."""
    return rms_norm_backward(dy.contiguous(), x, weight.contiguous(), rstd)


@_backward_op.register_fake
def _backward_fake(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _backward_op(dy, x, weight, rstd)
    return dx, dw, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of x (..., D) with weight (D,), differentiable in both, by the Triton kernels; the
    same values as logitlab.model.norms.RMSNorm(D, eps) with that weight."""
    check_tensor("x", x)
    check_tensor("weight", weight, ndim=1)
    D = x.shape[-1]
    if weight.shape[0] != D or not 0 < D <= MAX_ROW:
        raise ValueError(f"weight has {weight.shape[0]} entries for rows of {D} (at most {MAX_ROW})")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    y, _ = _forward_op(x.reshape(-1, D).contiguous(), weight, float(eps))    # (N, D)
    return y.view(x.shape)
