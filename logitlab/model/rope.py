"""Rotary position embeddings (Su et al. 2021, "RoFormer"): frequencies, tables, the rotation.

Rotate-half convention as Hugging Face (or RoFormer's interleaved pairs), with every frequency
scaling of rope_scaling.py (a RopeScaling, read duck-typed).

Shapes: B batch, T positions in this call, Dh head_dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.rope_scaling import RUNTIME_KINDS, rope_frequencies, rope_tables


def rope_inv_freq(head_dim: int, theta: float, scaling=None, device=None) -> torch.Tensor:
    """Inverse frequencies (Dh/2,) float32: theta^(-2i/Dh) for i = 0 .. Dh/2 - 1, rescaled by
    `scaling` (a RopeScaling or None) as rope_scaling.rope_frequencies does (the table a
    run-time kind uses up to its original context). Llama 3.1's rule, for example: with
    wavelength w = 2*pi/f and the original context C, frequencies with w < C/high_freq_factor
    are kept, those with w > C/low_freq_factor are divided by `factor`, and in between the two
    are blended with s = (C/w - low_freq_factor) / (high_freq_factor - low_freq_factor):
    f' = (1-s)*f/factor + s*f."""
    return rope_frequencies(head_dim, theta, scaling, device=device)[0]


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions 0 .. context_length-1.

    `cos`, `sin` are non-persistent float32 buffers of shape (context_length, Dh/2) (the
    rotate-half convention repeats each frequency over both halves, so half the table is
    enough), already multiplied by the scaling's attention factor (YaRN, LongRoPE). They are not
    in the state dict; after building on the meta device, call `rebuild(device)`. Module.to(dtype)
    leaves them float32.

    Kinds whose frequencies depend on the sequence at run time (rope_scaling.RUNTIME_KINDS) pick
    per call from L = max(positions) + 1 over the whole batch, as transformers does: "longrope"
    between two tables (short below the original context, long above); "dynamic" uses the table
    up to the original context and computes theta_L's frequencies for the call beyond it. Under a
    KV cache the keys already cached keep the rotation of the call that wrote them (an older, smaller
    base), while the new queries and keys turn under the current one: exactly transformers'
    behaviour in cached decoding. A StreamingLLM cache (unrotated keys) re-rotates every key at
    the current base instead.

    interleaved: the tables repeat each frequency over an adjacent pair (RoFormer / Meta layout)
    instead of over both halves; apply_rope must then be told `interleaved=True`."""

    def __init__(self, head_dim: int, context_length: int, theta: float, scaling=None, interleaved: bool = False):
        super().__init__()
        self.head_dim, self.context_length = head_dim, context_length
        self.theta, self.scaling, self.interleaved = theta, scaling, interleaved
        self.runtime = scaling is not None and scaling.rope_type in RUNTIME_KINDS
        self._register(self._tables(None))

    def _register(self, tables: dict) -> None:
        for name, table in tables.items():
            self.register_buffer(name, table, persistent=False)

    def _tables(self, device) -> dict:
        """{"cos", "sin"} (ctx, Dh/2) float32, plus "cos_long", "sin_long" for longrope."""
        pos = torch.arange(self.context_length, dtype=torch.int64, device=device)              # (ctx,)
        s = self.scaling
        if not self.runtime:
            cos, sin = rope_tables(self.head_dim, self.theta, s, pos)
            return {"cos": cos, "sin": sin}
        inv_freq, attention = rope_frequencies(self.head_dim, self.theta, s, None, device)   # below C
        out = dict(zip(("cos", "sin"), (t * attention for t in _angles(pos, inv_freq))))
        if s.rope_type == "longrope":
            long, _ = rope_frequencies(self.head_dim, self.theta, s, s.original_context_length + 1, device)
            out.update(zip(("cos_long", "sin_long"), (t * attention for t in _angles(pos, long))))
        return out

    def rebuild(self, device=None) -> None:
        """Recompute the tables in float32 on `device` (default: where they are now)."""
        for name, table in self._tables(device if device is not None else self.cos.device).items():
            setattr(self, name, table)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would cast the tables too; keep them float32 so a dtype round
        # trip loses nothing (apply_rope casts them to the activations' dtype at use, as HF does).
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.rebuild(self.cos.device)
        return self

    def half_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int -> (cos, sin) each (B, T, Dh/2) float32, for this call's length."""
        # F.embedding: the plain row lookup, cheaper per call than advanced indexing
        cos, sin = F.embedding(positions, self.cos), F.embedding(positions, self.sin)
        if not self.runtime:
            return cos, sin
        s = self.scaling
        longer = positions.max() + 1 > s.original_context_length                      # 0-d bool, no sync
        if s.rope_type == "longrope":
            return (torch.where(longer, F.embedding(positions, self.cos_long), cos),
                    torch.where(longer, F.embedding(positions, self.sin_long), sin))
        dcos, dsin = rope_tables(self.head_dim, self.theta, s, positions)              # "dynamic"
        return torch.where(longer, dcos, cos), torch.where(longer, dsin, sin)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int -> (cos, sin) each (B, T, 1, Dh), broadcasting over the heads of a
        (B, T, heads, Dh) tensor, in the layout apply_rope takes: cos = [c, c], sin = [-s, s] (the
        sign of the rotation folded into the table once per forward instead of a negation per layer);
        interleaved: cos = [c0, c0, c1, c1, ...], sin = [-s0, s0, -s1, s1, ...]."""
        cos, sin = self.half_tables(positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)                                   # (B, T, 1, Dh/2)
        if self.interleaved:
            return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(pos.float(), inv_freq)                                         # (ctx, Dh/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
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
    R dimensions of each head and pass the other Dh - R through unchanged.

    interleaved (RoFormer / Meta layout, tables from RotaryEmbedding(interleaved=True)): each
    adjacent pair (x0, x1) turns, [x0*c - x1*s, x1*c + x0*s]; the pair swap replaces the halves'."""
    R = cos.shape[-1]
    if R < x.shape[-1]:                                           # partial rotary: the first R dims turn
        x_rot, x_pass = x.split((R, x.shape[-1] - R), dim=-1)     # (B, T, heads, R), (..., Dh - R)
        out = apply_rope(x_rot, cos, sin, interleaved)
        return torch.cat((out, x_pass.to(out.dtype)), dim=-1)        # out: x_rot and the tables' promoted dtype
    if interleaved:
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)   # (x1, x0, x3, x2, ...)
        return x * cos + swapped * sin
    x1, x2 = x.chunk(2, dim=-1)                                   # (B, T, heads, Dh/2) each
    if torch.compiler.is_compiling():
        (c, _), (s_neg, s) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
        return torch.cat((x1 * c + x2 * s_neg, x2 * c + x1 * s), dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin             # (B, T, heads, Dh)
