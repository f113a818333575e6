"""Position schemes besides RoPE: sinusoidal tables, ALiBi biases, and RoPE's two weight layouts.

- Sinusoidal (Vaswani et al. 2017): a fixed (context_length, D) table added to the token
  embeddings, PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(p / 10000^(2i/D)).
- ALiBi (Press et al. 2022): no position in the residual stream; each head h adds -m_h * (t - s)
  to the logit of query t for key s, a linear penalty on distance with a fixed slope per head.
- RoPE layouts: Hugging Face rotates the halves (i, i + R/2) of each head, RoFormer and Meta's
  original checkpoints adjacent pairs (2i, 2i + 1). The two are the same model up to a
  permutation of the q and k projection rows (rope_layout_permutation, convert_rope_layout).

Shapes: B batch, T queries in this call, S keys, H heads, D d_model, Dh head_dim, R rotary dims.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from logitlab.model.rope import TABLE_VALUES

SINUSOID_BASE = 10000.0


def sinusoidal_table(context_length: int, d_model: int, device=None) -> torch.Tensor:
    """(context_length, D) float32: PE[p, 2i] = sin(p * w_i), PE[p, 2i+1] = cos(p * w_i),
    w_i = 10000^(-2i/D)."""
    pos = torch.arange(context_length, dtype=torch.float32, device=device)                     # (ctx,)
    return sinusoidal_rows(pos, sinusoidal_frequencies(d_model, device))


def sinusoidal_frequencies(d_model: int, device=None) -> torch.Tensor:
    """(D/2,) float32: w_i = 10000^(-2i/D)."""
    return SINUSOID_BASE ** (-torch.arange(0, d_model, 2, dtype=torch.float32, device=device) / d_model)


def sinusoidal_rows(pos: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """pos (...) -> (..., D) float32, the rows of the table at those positions (freq: (D/2,))."""
    angles = pos.float()[..., None] * freq                                                # (..., D/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)                   # (..., D)


class SinusoidalPositions(nn.Module):
    """The fixed table as a module called like an nn.Embedding: positions (B, T) -> (B, T, D).

    When context_length x D is at most rope.TABLE_VALUES the table is a non-persistent buffer (no
    state-dict key) in the model's dtype, as a learned table would be; it is recomputed exactly
    whenever the dtype or device changes (not rounded from the previous dtype), and by
    `rebuild(device)` after a meta-device build. A longer context keeps only the frequencies
    (`freq`, float32) and computes each call's rows from its positions: the same values, and no
    memory that grows with a context that is never used."""

    def __init__(self, context_length: int, d_model: int, table_values: int = TABLE_VALUES):
        super().__init__()
        self.context_length, self.d_model = context_length, d_model
        self.tabled = context_length * d_model <= table_values
        self.dtype = torch.float32                                # of the rows a call returns
        self.register_buffer("freq", sinusoidal_frequencies(d_model), persistent=False)
        if self.tabled:
            self.register_buffer("table", sinusoidal_table(context_length, d_model), persistent=False)

    def rebuild(self, device=None) -> None:
        device = device if device is not None else self.freq.device
        self.freq = sinusoidal_frequencies(self.d_model, device)
        if self.tabled:
            self.table = sinusoidal_table(self.context_length, self.d_model, device).to(self.dtype)

    def _apply(self, fn, recurse=True):
        self.dtype = fn(torch.empty(0, dtype=self.dtype, device=self.freq.device)).dtype  # the model's new dtype
        super()._apply(fn, recurse)
        self.rebuild(self.freq.device)                            # exact values in the new dtype
        return self

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.tabled:
            return nn.functional.embedding(positions, self.table)  # (B, T, D)
        return sinusoidal_rows(positions, self.freq).to(self.dtype)  # (B, T, D)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """(H,) float32, the geometric slopes of Press et al.: for H a power of two, m_h = 2^(-8h/H),
    h = 1 .. H. Otherwise the slopes of the power of two n below H, then every other slope of 2n
    (the first H - n of them), as their reference code does."""
    def geometric(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(n) + geometric(2 * n)[0::2][: n_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(nn.Module):
    """The per-head slopes (a non-persistent float32 buffer) and the bias they make.

    bias(q_slot, k_slot, mask, is_causal, dtype) -> a float attention mask (B|1, H, T, S) that
    SDPA and eager attention add to the logits: -m_h * (q_slot - k_slot) where a key may be read,
    -inf where not. Distances are measured between slots of the sequence's timeline (the slots a
    KV cache or a sliding window ring buffer reports), so decoding with a cache, sliding windows
    and left padding (contiguous, masked) all see the same distances as one full forward."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def rebuild(self, device=None) -> None:
        self.slopes = alibi_slopes(self.n_heads).to(device if device is not None else self.slopes.device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.slopes.dtype != torch.float32:
            self.rebuild(self.slopes.device)
        return self

    def bias(self, q_slot, k_slot, mask=None, is_causal=False, dtype=torch.float32) -> torch.Tensor:
        """q_slot (T,), k_slot (S,) int; mask bool (B|1, 1, T, S) True = may attend, or None (then
        is_causal: key s readable when k_slot <= q_slot; else every key) -> (B|1, H, T, S) `dtype`."""
        ahead = (k_slot[None, :] - q_slot[:, None]).float()                               # (T, S): s - t <= 0
        bias = self.slopes.to(ahead.device)[:, None, None] * ahead                         # (H, T, S)
        if mask is None and is_causal:
            mask = (k_slot[None, :] <= q_slot[:, None])[None, None]                        # (1, 1, T, S)
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))                                 # (B|1, H, T, S)
        else:
            bias = bias[None]
        return bias.to(dtype)


# ------------------------------------------------------------------------------------------
# RoPE weight layouts
# ------------------------------------------------------------------------------------------

def rope_layout_permutation(head_dim: int, rotary_dim: int | None = None, to: str = "half") -> torch.Tensor:
    """Row order (Dh,) int64 that turns one head's q or k rows from one RoPE layout into the other:
    new_rows = old_rows[perm]. to="half": interleaved pairs (2i, 2i+1) -> halves (i, i + R/2)
    (Meta -> Hugging Face); to="interleaved" the inverse. Rows past R (partial rotary) stay put."""
    R = head_dim if rotary_dim is None else rotary_dim
    if R % 2 or not 0 < R <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {R}")
    half = torch.cat((torch.arange(0, R, 2), torch.arange(1, R, 2)))                      # interleaved -> half
    if to == "interleaved":
        half = torch.argsort(half)
    elif to != "half":
        raise ValueError(f"to must be 'half' or 'interleaved', got {to!r}")
    return torch.cat((half, torch.arange(R, head_dim)))


def convert_rope_layout(state_dict: dict, config, to: str = "half"):
    """(state_dict, config) of a logitlab model in one RoPE layout -> the same model in the other:
    the q and k rows of every attention layer's qkv_proj (weight and bias) and the QK-norm weights
    permuted per head, config.rope_interleaved set to match. Logits are unchanged (up to rounding)."""
    if config.positions != "rope":
        raise ValueError(f"convert_rope_layout needs positions='rope', got {config.positions!r}")
    if config.rope_interleaved == (to == "interleaved"):
        raise ValueError(f"the model is already in the {to!r} layout")
    H, Hkv, Dh = config.n_heads, config.n_kv_heads, config.head_dim
    perm = rope_layout_permutation(Dh, config.rotary_dim, to)
    qk_rows = (torch.arange(H + Hkv)[:, None] * Dh + perm[None, :]).flatten()            # ((H+Hkv)*Dh,)
    out = {}
    for key, value in state_dict.items():
        if key.endswith(("attn.qkv_proj.weight", "attn.qkv_proj.bias")):
            value = torch.cat((value[qk_rows], value[(H + Hkv) * Dh:]))
        elif key.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
            value = value[perm]
        out[key] = value
    return out, dataclasses.replace(config, rope_interleaved=to == "interleaved")


# ------------------------------------------------------------------------------------------
# Inference-time context extension
# ------------------------------------------------------------------------------------------

EXTENSIONS = ("none", "linear", "ntk", "dynamic", "yarn")


def extended_config(config, length: int, scaling: str = "none", factor: float | None = None):
    """`config` made to accept `length` positions, its RoPE scaled for the ratio s = factor, by
    default length / config.context_length: "none" only lengthens the tables, "linear"
    interpolates positions by s, "ntk" enlarges the base, "dynamic" grows it with each call's
    length past the trained one, "yarn" blends per frequency with its temperature (the trained
    context as original_context_length). The trained weights load into the result unchanged, for
    inference without retraining or as the start of a fine-tune at `length`. Sinusoidal and ALiBi
    models (and NoPE) just get the longer context; learned positions cannot go past their table
    (ValueError). A length not past the trained one returns `config` itself."""
    if scaling not in EXTENSIONS:
        raise ValueError(f"scaling must be one of {EXTENSIONS}, got {scaling!r}")
    if factor is not None and not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    trained = config.context_length
    if length <= trained:
        return config
    if config.positions == "learned":
        raise ValueError(f"positions='learned' has a table of {trained} rows; it cannot read {length} positions")
    if scaling != "none" and config.positions != "rope":
        raise ValueError(f"scaling={scaling!r} needs positions='rope', got {config.positions!r}")
    if config.rope_scaling is not None and scaling != "none":
        raise ValueError("the config already has a rope_scaling; extend it from the unscaled model")
    if scaling == "none":
        return dataclasses.replace(config, context_length=length)
    rope_scaling = dict(rope_type=scaling, factor=float(factor or length / trained),
                        **({} if scaling in ("linear", "ntk") else {"original_context_length": trained}))
    return dataclasses.replace(config, context_length=length, rope_scaling=rope_scaling)
