"""flash_attention: the Triton FlashAttention kernels (kernels.triton_flash_fwd, _bwd) as a
differentiable custom operator, with the checks that make a bad call fail before any kernel runs.

    out = flash_attention(q, k, v, causal=True)   # q (B, H, T, Dh); k, v (B, Hkv, S, Dh)

The reference it must equal is logitlab.model.attention.eager_attention on K/V heads repeated G
times (tests/triton/test_triton_attention.py checks out, dq, dk and dv in float32, float16 and
bfloat16). Causal here means query row i sits at position i + S - T and sees keys 0 .. i + S - T:
with S == T it is the plain lower triangle (SDPA's is_causal), with S > T it is a chunk of new
queries after S - T cached keys, and with T == 1 every key is seen (a decode step).

A decode step (T = 1 or a few queries against a long S) runs the same kernel: one query block
per head, padded to 16 rows, with the keys streamed by one program per head. That is correct
but leaves most of a GPU idle (no split over S); docs/kernels.md says when SDPA is the better
choice for it.

Inside torch.compile the kernels are two custom operators, logitlab::flash_attention_forward and
logitlab::flash_attention_backward (torch.library.custom_op), each with a fake implementation
that gives only the shapes and dtypes of its outputs, and the forward's register_autograd calls
the backward. The compiler sees one opaque op per pass and never traces the launches (their
autotuner's pre_hooks and host-side tensor descriptors are not traceable, and a pointer's
alignment is no symbol), so `torch.compile(fullgraph=True)` of a model with the kernel
installed has no graph break. Eager calls go through the same operators.
"""

from __future__ import annotations

import math

import torch

from logitlab.kernels.triton_common import check_tensor, dot_precision, upcast_dots
from logitlab.kernels.triton_flash_bwd import flash_backward
from logitlab.kernels.triton_flash_fwd import flash_forward

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def _descriptor_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself when a tensor descriptor can address it (last dim contiguous, base and strides
    16-byte aligned), else a contiguous copy."""
    size = x.element_size()
    aligned = (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
               and all((s * size) % 16 == 0 for s in x.stride()[:-1]))
    return x if aligned else x.contiguous()


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """ValueError naming the argument unless q (B, H, T, Dh), k and v (B, Hkv, S, Dh) fit the kernels."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4)
    B, H, T, Dh = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != Dh:
        raise ValueError(f"k and v must be (B={B}, Hkv, S, Dh={Dh}); got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device; got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")
    Hkv, S = k.shape[1], k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if not (MIN_HEAD_DIM <= Dh <= MAX_HEAD_DIM and Dh % 8 == 0):
        raise ValueError(f"head dim must be a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {Dh}")
    if min(B, T, S) == 0:
        raise ValueError(f"empty attention: B={B}, T={T}, S={S}")
    if causal and T > S:
        raise ValueError(f"causal attention needs T <= S (queries are the last T of S positions); got T={T}, S={S}")


@torch.library.custom_op("logitlab::flash_attention_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, T, Dh), k, v (B, Hkv, S, Dh) -> (out (B, H, T, Dh) in q's dtype, lse2 (B, H, T)
    float32: the base-2 log-sum-exp of each score row, which the backward pass reads)."""
    q, k, v = (_descriptor_ready(x) for x in (q, k, v))
    return flash_forward(q, k, v, causal, scale, upcast_dots(q.dtype), dot_precision(q.dtype))


@_forward_op.register_fake
def _forward_fake(q, k, v, causal, scale):
    B, H, T, Dh = q.shape
    return q.new_empty((B, H, T, Dh)), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("logitlab::flash_attention_backward", mutates_args=())
def _backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse2: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv), contiguous, in the shapes and dtypes of q, k, v."""
    q, k, v, out = (_descriptor_ready(x) for x in (q, k, v, out))
    do = _descriptor_ready(grad_out.to(out.dtype))
    return flash_backward(do, q, k, v, out, lse2.contiguous(), causal, scale, upcast_dots(q.dtype),
                          dot_precision(q.dtype))


@_backward_op.register_fake
def _backward_fake(grad_out, q, k, v, out, lse2, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    """Saves q, k, v, out and lse2 (B, H, T) float32; nothing T x S."""
    q, k, v, causal, scale = inputs
    out, lse2 = output
    ctx.save_for_backward(q, k, v, out, lse2)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse2)


def _backward(ctx, grad_out, grad_lse2):
    q, k, v, out, lse2 = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, q, k, v, out, lse2, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Attention of q (B, H, T, Dh) over k, v (B, Hkv, S, Dh), H a multiple of Hkv (query head h
    reads key/value head h // G), by the Triton kernels -> (B, H, T, Dh) in q's dtype.

    causal: query i sees keys up to i + S - T (see the module docstring). scale: the score
    scale, 1 / sqrt(Dh) when None. Differentiable in q, k and v."""
    check_inputs(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return _forward_op(q, k, v, bool(causal), scale)[0]
