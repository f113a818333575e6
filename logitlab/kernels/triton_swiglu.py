"""Fused SwiGLU activation in Triton, forward and backward, as a differentiable custom operator:
silu(gate) * up from the gate/up projection's output in one pass.

logitlab.model.mlp.SwiGLU computes `gate, up = gate_up_proj(x).chunk(2, -1)` and then
F.silu(gate) * up: eager torch reads the (N, 2F) projection, writes silu(gate), reads it again
with up and writes the product, and autograd keeps silu(gate) for backward. Here one program
reads a block of gate and up, writes the product once, and backward recomputes the sigmoid:

    s = sigmoid(g),  silu(g) = g s,  d silu / dg = s (1 + g (1 - s))
    d_gate = dy * up * s (1 + g (1 - s)),   d_up = dy * g s

Values are computed in float32 and rounded once to the input dtype (eager rounds silu(gate)
first, then the product: the two differ by a rounding in bf16). Reference: F.silu(gate) * up
(tests/triton/test_triton_swiglu.py). Shapes: N rows, F the hidden width.

The two passes are the custom operators logitlab::swiglu_forward and logitlab::swiglu_backward
(torch.library.custom_op, with fake implementations for the shapes and register_autograd), so
torch.compile keeps each as one opaque op instead of breaking its graph at the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_common import check_tensor

SWIGLU_BLOCK = 1024                                               # hidden units per program


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, out_ptr, F, gu_stride, out_stride, BLOCK: tl.constexpr):
    """gu (N, 2F): gate in columns [0, F), up in [F, 2F) -> out (N, F); grid (N, cdiv(F, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, gu_ptr, dgu_ptr, F, dy_stride, gu_stride, BLOCK: tl.constexpr):
    """dy (N, F), gu (N, 2F) -> dgu (N, 2F) (contiguous like gu): d_gate, then d_up."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + F + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    d_gate = dy * u * s * (1.0 + g * (1.0 - s))
    d_up = dy * g * s
    ty = dgu_ptr.dtype.element_ty
    tl.store(dgu_ptr + row * gu_stride + cols, d_gate.to(ty), mask=mask)
    tl.store(dgu_ptr + row * gu_stride + F + cols, d_up.to(ty), mask=mask)


@torch.library.custom_op("logitlab::swiglu_forward", mutates_args=())
def _forward_op(rows: torch.Tensor) -> torch.Tensor:
    """rows (N, 2F) contiguous, gate | up -> silu(gate) * up (N, F)."""
    N, F = rows.shape[0], rows.shape[1] // 2
    out = torch.empty(N, F, dtype=rows.dtype, device=rows.device)
    _swiglu_fwd_kernel[(N, triton.cdiv(F, SWIGLU_BLOCK))](rows, out, F, rows.stride(0), out.stride(0),
                                                          BLOCK=SWIGLU_BLOCK)
    return out


@_forward_op.register_fake
def _forward_fake(rows):
    return rows.new_empty((rows.shape[0], rows.shape[1] // 2))


@torch.library.custom_op("logitlab::swiglu_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """dy (N, F), rows (N, 2F) contiguous -> d rows (N, 2F): d_gate, then d_up."""
    N, F = rows.shape[0], rows.shape[1] // 2
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dgu = torch.empty_like(rows)
    _swiglu_bwd_kernel[(N, triton.cdiv(F, SWIGLU_BLOCK))](dy, rows, dgu, F, dy.stride(0), rows.stride(0),
                                                          BLOCK=SWIGLU_BLOCK)
    return dgu


@_backward_op.register_fake
def _backward_fake(dy, rows):
    return rows.new_empty(rows.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])                               # only the input: the sigmoid is recomputed


def _backward(ctx, dy):
    (rows,) = ctx.saved_tensors
    return _backward_op(dy, rows)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (..., 2F) holding the gate then the up projection (SwiGLU's
    gate_up_proj output) -> (..., F), differentiable, by the Triton kernels."""
    check_tensor("gate_up", gate_up)
    if gate_up.ndim == 0 or gate_up.shape[-1] % 2 or gate_up.shape[-1] == 0:
        raise ValueError(f"gate_up must end in an even, non-zero width 2F, got shape {tuple(gate_up.shape)}")
    F2 = gate_up.shape[-1]
    out = _forward_op(gate_up.reshape(-1, F2).contiguous())       # (N, F)
    return out.view(*gate_up.shape[:-1], F2 // 2)
