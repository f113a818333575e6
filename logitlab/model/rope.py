"""Rotary position embeddings (Su et al. 2021, "RoFormer"): frequencies, tables, the rotation.

Rotate-half convention as Hugging Face, with Llama-3.1 frequency scaling (a RopeScaling, read
duck-typed: this module imports nothing of logitlab).

Shapes: B batch, T positions in this call, Dh head_dim."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling=None, device=None) -> torch.Tensor:
    """Inverse frequencies (Dh/2,) float32: theta^(-2i/Dh) for i = 0 .. Dh/2 - 1.

    `scaling` (a RopeScaling or None) applies Llama-3.1's rule: with wavelength w = 2*pi/f and
    the original context C, frequencies with w < C/high_freq_factor are kept, those with
    w > C/low_freq_factor are divided by `factor`, and in between the two are blended with
    s = (C/w - low_freq_factor) / (high_freq_factor - low_freq_factor): f' = (1-s)*f/factor + s*f."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    C = scaling.original_context_length
    lo, hi, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (C / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > C / lo, inv_freq / factor, blended)
    return torch.where(wavelen < C / hi, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions 0 .. context_length-1.

    `cos`, `sin` are non-persistent float32 buffers of shape (context_length, Dh/2) (the
    rotate-half convention repeats each frequency over both halves, so half the table is
    enough). They are not in the state dict; after building on the meta device, call
    `rebuild(device)`. Module.to(dtype) leaves them float32."""

    def __init__(self, head_dim: int, context_length: int, theta: float, scaling=None):
        super().__init__()
        self.head_dim, self.context_length = head_dim, context_length
        self.theta, self.scaling = theta, scaling
        cos, sin = self._tables(None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device=device)      # (Dh/2,)
        pos = torch.arange(self.context_length, dtype=torch.int64, device=device).float()    # (ctx,)
        angles = torch.outer(pos, inv_freq)                                                   # (ctx, Dh/2)
        return angles.cos(), angles.sin()

    def rebuild(self, device=None) -> None:
        """Recompute the tables in float32 on `device` (default: where they are now)."""
        cos, sin = self._tables(device if device is not None else self.cos.device)
        self.cos, self.sin = cos, sin

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would cast the tables too; keep them float32 so a dtype round
        # trip loses nothing (apply_rope casts them to the activations' dtype at use, as HF does).
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.rebuild(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int -> (cos, sin) each (B, T, 1, Dh), broadcasting over the heads of a
        (B, T, heads, Dh) tensor, in the layout apply_rope takes: cos = [c, c], sin = [-s, s] (the
        sign of the rotation folded into the table once per forward instead of a negation per layer)."""
        # F.embedding: the plain row lookup, cheaper per call than advanced indexing
        cos, sin = F.embedding(positions, self.cos).unsqueeze(2), F.embedding(positions, self.sin).unsqueeze(2)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, Dh) by the tables of RotaryEmbedding.forward, rotate-half convention.

    cos = [c, c] and sin = [-s, s], each (B, T, 1, Dh). With x = [x1, x2] split into halves, the
    result is x*cos + [x2, x1]*sin = [x1*c - x2*s, x2*c + x1*s]: the same floating-point
    values as Hugging Face's `x*cos + rotate_half(x)*sin` (negation is exact), in four kernels
    (a swap, two products, a sum) rather than their five or a half-by-half form's seven.
    The result is in the promoted dtype of x and the tables; the model passes the tables in the
    residual stream's dtype, as Hugging Face does: bf16 weights rotate in bf16, bf16 autocast
    over float32 weights rotates in float32.

    Compiled, the same products and sums are written half by half into one concatenation,
    [x1*c + x2*(-s), x2*c + x1*s]: inductor then writes each half of the result in place instead
    of materialising the swapped copy of x first (small-Llama fp32 training step, the rotation's
    fused kernels forward + backward 24 -> 16 ms).

    Partial rotary (ModelConfig.partial_rotary_factor < 1): tables of width R < Dh rotate the first
    R dimensions of each head and pass the other Dh - R through unchanged."""
    R = cos.shape[-1]
    if R < x.shape[-1]:                                           # partial rotary: the first R dims turn
        x_rot, x_pass = x.split((R, x.shape[-1] - R), dim=-1)     # (B, T, heads, R), (..., Dh - R)
        return torch.cat((apply_rope(x_rot, cos, sin), x_pass.to(torch.result_type(x_rot, cos))), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)                                   # (B, T, heads, Dh/2) each
    if torch.compiler.is_compiling():
        (c, _), (s_neg, s) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
        return torch.cat((x1 * c + x2 * s_neg, x2 * c + x1 * s), dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin             # (B, T, heads, Dh)
