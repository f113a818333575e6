"""RoPE frequency scaling: one pure function per Hugging Face `rope_type`.

Every kind maps (dim, theta, scaling, seq_len) to the rotary inverse frequencies f_i (dim/2,)
float32 and an attention scaling a (a float): the cos/sin tables are cos(p * f_i) * a and
sin(p * f_i) * a, so q.k picks up a^2, the logit temperature YaRN and LongRoPE apply. `dim` is the
number of rotated dimensions (rotary_dim), theta the base, `scaling` a RopeScaling (read
duck-typed: this module imports nothing of logitlab). The unscaled frequencies are

    f_i = theta^(-2i/dim),  i = 0 .. dim/2 - 1,  wavelength w_i = 2*pi / f_i.

`seq_len` is read only by the two kinds whose tables depend on the sequence at run time
("dynamic" and "longrope"); it may be a Python int or a 0-d tensor (no host sync, so a compiled
forward stays one graph). `rope_tables` turns any kind into cos/sin for a tensor of positions.
The arithmetic follows transformers' ROPE_INIT_FUNCTIONS step for step (same float32 operations),
so tables agree with theirs to the last bit or within an ulp.
"""

from __future__ import annotations

import math

import torch


def _exponents(dim: int, device=None) -> torch.Tensor:
    """2i / dim for i = 0 .. dim/2 - 1, float32 (dim/2,)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def default_inv_freq(dim: int, theta: float, scaling=None, seq_len=None, device=None):
    """No scaling: f_i = theta^(-2i/dim), attention scaling 1."""
    return 1.0 / (theta ** _exponents(dim, device)), 1.0


def linear_inv_freq(dim: int, theta: float, scaling, seq_len=None, device=None):
    """Position interpolation (Chen et al. 2023): positions squeezed by s = factor, i.e.
    f_i' = f_i / s, so position p turns as p / s did. Attention scaling 1."""
    inv_freq, _ = default_inv_freq(dim, theta, device=device)
    return inv_freq / scaling.factor, 1.0


def ntk_inv_freq(dim: int, theta: float, scaling, seq_len=None, device=None):
    """Static NTK-aware scaling (bloc97 2023): a larger base theta' = theta * s^(dim / (dim - 2))
    with s = factor, so the lowest frequency is divided by s (interpolated) while the highest
    stays nearly unchanged (extrapolated). Same as a plain RoPE with rope_theta = theta'."""
    return default_inv_freq(dim, ntk_theta(dim, theta, scaling.factor), device=device)


def ntk_theta(dim: int, theta: float, factor: float) -> float:
    """The static NTK-aware base theta * factor^(dim / (dim - 2))."""
    return theta * factor ** (dim / (dim - 2))


def dynamic_inv_freq(dim: int, theta: float, scaling, seq_len=None, device=None):
    """Dynamic NTK (emozilla 2023): the NTK base grows with the current length L,

        theta_L = theta * (s * L / C - (s - 1))^(dim / (dim - 2)),  L = max(seq_len, C),

    with s = factor and C = original_context_length: up to C the frequencies are the unscaled
    ones; beyond it they interpolate just enough for L. seq_len None means C. Attention scaling 1."""
    C, s = scaling.original_context_length, scaling.factor
    if seq_len is None:
        seq_len = C
    if isinstance(seq_len, torch.Tensor):
        seq_len = torch.maximum(seq_len, torch.tensor(C, dtype=seq_len.dtype, device=seq_len.device))
    else:
        seq_len = max(seq_len, C)
    base = theta * ((s * seq_len / C) - (s - 1)) ** (dim / (dim - 2))
    if isinstance(base, torch.Tensor):
        device = base.device
    return 1.0 / (base ** _exponents(dim, device)), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention(scaling) -> float:
    """attention_factor when given; else mscale(s, mscale) / mscale(s, mscale_all_dim) when both
    are set (DeepSeek's form), else mscale(s) = 0.1 ln s + 1 (the paper's sqrt(1/t))."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return float(yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return yarn_mscale(scaling.factor)


def yarn_correction_range(dim: int, theta: float, scaling) -> tuple[float, float]:
    """The dimension band of YaRN's ramp: dimension d turns r(d) = C / w_d times over the original
    context C; d(r) = dim * ln(C / (2*pi*r)) / (2 ln theta) is the dimension that turns r times.
    low = d(beta_fast), high = d(beta_slow) (floored / ceiled when truncate), clipped to [0, dim-1]."""
    C = scaling.original_context_length

    def dim_of(rotations: float) -> float:
        return (dim * math.log(C / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, theta: float, scaling, seq_len=None, device=None):
    """YaRN (Peng et al. 2023), "NTK-by-parts" plus a temperature. With s = factor and the ramp
    gamma_i = clamp((i - low) / (high - low), 0, 1) over i = 0 .. dim/2 - 1 (yarn_correction_range):

        f_i' = f_i / s * gamma_i + f_i * (1 - gamma_i)

    so the fast dimensions (that turn more than beta_fast times in the original context) keep
    their frequency, the slow ones (fewer than beta_slow turns) are interpolated by s, and those
    between are blended. The attention scaling is yarn_attention(scaling) (0.1 ln s + 1 by
    default), multiplying cos and sin, hence the logits by its square."""
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    low, high = yarn_correction_range(dim, theta, scaling)
    if low == high:
        high += 0.001                                              # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    keep = 1 - ramp                                                # 1: extrapolate (keep f_i)
    return interpolated * (1 - keep) + extrapolated * keep, yarn_attention(scaling)


def llama3_inv_freq(dim: int, theta: float, scaling, seq_len=None, device=None):
    """Llama 3.1: with the original context C, frequencies of wavelength w < C / high_freq_factor
    are kept, those with w > C / low_freq_factor divided by s = factor, and in between blended
    with m = (C / w - low_freq_factor) / (high_freq_factor - low_freq_factor):
    f' = (1 - m) * f / s + m * f. Attention scaling 1."""
    inv_freq, _ = default_inv_freq(dim, theta, device=device)
    C = scaling.original_context_length
    lo, hi, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (C / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > C / lo, inv_freq / factor, blended)
    return torch.where(wavelen < C / hi, inv_freq, out), 1.0


def longrope_attention(scaling) -> float:
    """attention_factor when given, else sqrt(1 + ln s / ln C) for s = factor > 1 (1 otherwise)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_context_length))


def longrope_inv_freq(dim: int, theta: float, scaling, seq_len=None, device=None):
    """LongRoPE (Ding et al. 2024; Phi-3): a searched rescale per frequency, f_i' = f_i / lambda_i,
    with lambda = long_factor when the sequence is longer than the original context C
    (seq_len > C) and short_factor otherwise. Attention scaling longrope_attention(scaling)."""
    if isinstance(seq_len, torch.Tensor):                         # traceable: pick with where
        short, _ = longrope_inv_freq(dim, theta, scaling, None, device)
        long, attention = longrope_inv_freq(dim, theta, scaling, scaling.original_context_length + 1, device)
        return torch.where(seq_len > scaling.original_context_length, long.to(seq_len.device),
                           short.to(seq_len.device)), attention
    longer = seq_len is not None and seq_len > scaling.original_context_length
    factors = torch.tensor(scaling.long_factor if longer else scaling.short_factor, dtype=torch.float32,
                           device=device)
    return 1.0 / (factors * theta ** _exponents(dim, device)), longrope_attention(scaling)


INV_FREQ = {"default": default_inv_freq, "linear": linear_inv_freq, "ntk": ntk_inv_freq,
            "dynamic": dynamic_inv_freq, "yarn": yarn_inv_freq, "llama3": llama3_inv_freq,
            "longrope": longrope_inv_freq}
# kinds whose frequencies depend on the sequence length at run time
RUNTIME_KINDS = ("dynamic", "longrope")


def rope_frequencies(dim: int, theta: float, scaling=None, seq_len=None, device=None):
    """-> (inv_freq (dim/2,) float32, attention scaling) for `scaling` (None: unscaled)."""
    kind = "default" if scaling is None else scaling.rope_type
    return INV_FREQ[kind](dim, theta, scaling, seq_len=seq_len, device=device)


def rope_tables(dim: int, theta: float, scaling, positions: torch.Tensor):
    """positions (...) int -> (cos, sin) each (..., dim/2) float32: cos(p * f_i) * a, sin(p * f_i) * a
    with (f, a) = rope_frequencies(...). The run-time kinds read seq_len = max(positions) + 1."""
    seq_len = positions.max() + 1 if scaling is not None and scaling.rope_type in RUNTIME_KINDS else None
    inv_freq, attention = rope_frequencies(dim, theta, scaling, seq_len, positions.device)
    angles = positions.float()[..., None] * inv_freq               # (..., dim/2)
    cos, sin = angles.cos(), angles.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos, sin
