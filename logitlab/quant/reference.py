"""Weight-only quantization as plain tensor math: quantize, dequantize, matmul.

reference.py owns the numbers every other part of the package must reproduce; each function is
a few lines a reader checks by eye. Weights are (N, K): N output features (rows), K input
features (columns), as nn.Linear stores them; x is (..., K).

int8, per output channel, symmetric (one scale per row):
    s_n = max_k |w_nk| / 127             (rounded to bf16, so every route reads the same scale)
    q_nk = clamp(round(w_nk / s_n), -127, 127)                  int8
    w_nk ~ q_nk * s_n                  error at most s_n / 2 per weight
    y = x @ (q * s)^T = (x @ q^T) * s  the scale of row n multiplies output column n

int4, group-wise along K, asymmetric (a scale and an integer zero point per group of G columns):
    lo = min(0, min w), hi = max(0, max w) over the group    (the range holds 0, so z is in 0..15)
    s = (hi - lo) / 15  (bf16),  z = clamp(round(-lo / s), 0, 15)
    q = clamp(round(w / s) + z, 0, 15)                          4 bits, two per byte
    w ~ (q - z) * s

Two 4-bit values share a byte: column 2j in the low nibble, column 2j+1 in the high one
(pack_int4 / unpack_int4).

llama.cpp's block formats (GGUF), 32 weights per block along K with a float16 scale d:
    Q8_0: d = max |w| / 127, q = round(w / d) in -127..127,   w ~ q * d
    Q4_0: d = m / -8 where m is the block's weight of largest magnitude (sign kept),
          q = clamp(round(w / d) + 8, 0, 15),                  w ~ (q - 8) * d

int8 activations (the int8dot products, routes.py): a row of x is quantized as it arrives by Q8_0's
rule, the scale kept in float32, and multiplied by int8 weights in integers:
    qx_mk, d_mb = Q8_0 of x_m, block b          each x moves by at most d_mb / 2 (max |x| / 254)
    y_mn = s_n * sum_b d_mb * sum_{k in b} qx_mk * q_nk         (the inner sums exact, int32)
so y_mn is within sum_b d_mb / 2 * sum_{k in b} |q_nk * s_n| of the weight-only int8 product.
Shapes: N output features, K input features, G group size, B blocks per row = K // 32, M rows of x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127
INT4_LEVELS = 15                    # q in 0..15
GROUP_SIZES = (32, 64, 128)
GGUF_BLOCK = 32                     # weights per Q8_0 / Q4_0 block
TINY = 1e-30                        # the scale of an all-zero row or group (any positive number: q = 0)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """Scales are stored in bf16: rounded once here, read exactly by every route afterwards."""
    return t.clamp_min(TINY).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# int8, per output channel
# --------------------------------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q (N, K) int8, scales (N,) bf16)."""
    w = w.float()
    scales = _bf16(w.abs().amax(dim=1) / INT8_MAX)                          # (N,)
    q = (w / scales.float()[:, None]).round().clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(q (N, K) int8, scales (N,)) -> w (N, K) in `dtype`: q * s row by row."""
    return (q.float() * scales.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (q * s)^T -> (..., N) in x's dtype: the weight dequantized, then a plain
    matmul in x's dtype (the product every route must equal up to summation order)."""
    return F.linear(x, dequantize_int8(q, scales, x.dtype))


# --------------------------------------------------------------------------------------------
# int4, group-wise with zero points
# --------------------------------------------------------------------------------------------

def check_group_size(K: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if K % group_size:
        raise ValueError(f"in_features ({K}) must be divisible by group_size ({group_size})")


def quantize_int4(w: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (q (N, K) uint8 in 0..15, scales (N, K/G) bf16, zeros (N, K/G) uint8)."""
    N, K = w.shape
    check_group_size(K, group_size)
    groups = w.float().reshape(N, K // group_size, group_size)                # (N, K/G, G)
    lo = groups.amin(dim=-1).clamp(max=0.0)                                   # (N, K/G)
    hi = groups.amax(dim=-1).clamp(min=0.0)
    scales = _bf16((hi - lo) / INT4_LEVELS)
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, INT4_LEVELS)                           # (N, K/G)
    q = ((groups / s[..., None]).round() + zeros[..., None]).clamp(0, INT4_LEVELS)
    return q.reshape(N, K).to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype=torch.float32) -> torch.Tensor:
    """(q (N, K) in 0..15, scales, zeros (N, K/G)) -> w (N, K) in `dtype`: (q - z) * s per group."""
    N, K = q.shape
    G = K // scales.shape[1]
    groups = q.float().reshape(N, K // G, G)                                  # (N, K/G, G)
    w = (groups - zeros.float()[..., None]) * scales.float()[..., None]
    return w.reshape(N, K).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) in 0..15 -> (N, K/2) uint8: column 2j in the low nibble, 2j+1 in the high one."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> q (N, K) uint8 in 0..15 (pack_int4's inverse)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ ((q - z) * s)^T -> (..., N) in x's dtype, q unpacked from (N, K/2) bytes."""
    return F.linear(x, dequantize_int4(unpack_int4(packed), scales, zeros, x.dtype))


# --------------------------------------------------------------------------------------------
# llama.cpp's Q8_0 and Q4_0 blocks (GGUF)
# --------------------------------------------------------------------------------------------

def _blocks(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) -> (N, K/32, 32) float32."""
    N, K = w.shape
    if K % GGUF_BLOCK:
        raise ValueError(f"Q8_0 / Q4_0 need in_features divisible by {GGUF_BLOCK}, got {K}")
    return w.float().reshape(N, K // GGUF_BLOCK, GGUF_BLOCK)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block). llama.cpp divides by the float32 scale and
    stores its float16 rounding; so do these functions, to give its numbers exactly."""
    return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))


def _q8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q (N, K) int8, d (N, K/32) float32): Q8_0's rule, the scale not yet rounded."""
    blocks = _blocks(w)
    d = blocks.abs().amax(dim=-1) / INT8_MAX                                   # (N, B) float32
    x = blocks * _inverse(d)[..., None]
    q = x.sign() * (x.abs() + 0.5).floor()                                    # round half away from 0
    return q.clamp(-INT8_MAX, INT8_MAX).reshape(w.shape).to(torch.int8), d


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q (N, K) int8, d (N, K/32) float16)."""
    q, d = _q8_blocks(w)
    return q, d.to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(q (N, K) int8, d (N, K/32)) -> w (N, K): q * d per block."""
    N, K = q.shape
    w = q.float().reshape(N, K // GGUF_BLOCK, GGUF_BLOCK) * d.float()[..., None]
    return w.reshape(N, K).to(dtype)


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q (N, K) uint8 in 0..15, d (N, K/32) float16)."""
    blocks = _blocks(w)
    index = blocks.abs().argmax(dim=-1, keepdim=True)                          # the largest magnitude
    m = blocks.gather(-1, index)[..., 0]                                       # (N, B), sign kept
    d = m / -8                                                                 # (N, B) float32
    q = (blocks * _inverse(d)[..., None] + 8.5).floor().clamp(0, INT4_LEVELS)  # round half up
    return q.reshape(w.shape).to(torch.uint8), d.to(torch.float16)


def dequantize_q4_0(q: torch.Tensor, d: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(q (N, K) in 0..15, d (N, K/32)) -> w (N, K): (q - 8) * d per block."""
    N, K = q.shape
    w = (q.float().reshape(N, K // GGUF_BLOCK, GGUF_BLOCK) - 8) * d.float()[..., None]
    return w.reshape(N, K).to(dtype)


# --------------------------------------------------------------------------------------------
# int8 activations (the int8dot products: int8 weights times int8 activations)
# --------------------------------------------------------------------------------------------

def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (q (M, K) int8, d (M, K/32) float32): Q8_0's rule applied to a row of
    activations as it arrives, the scale kept in float32. A block holding a NaN or an infinity gets
    d = NaN and q = 0, so that every product it enters is NaN."""
    q, d = _q8_blocks(x)
    bad = ~_blocks(x).isfinite().all(dim=-1)                                   # (M, B)
    q = q.masked_fill(bad.repeat_interleave(GGUF_BLOCK, dim=-1), 0)
    return q, d.masked_fill(bad, float("nan"))


def _int8_activations_times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., K) quantized per block of 32 (quantize_activations), dequantized, @ w (N, K)^T in
    float32 -> (..., N) in x's dtype."""
    K = x.shape[-1]
    qx, d = quantize_activations(x.reshape(-1, K))                             # (M, K), (M, K/32)
    y = F.linear(dequantize_q8_0(qx, d), w)                                    # (M, N) float32
    return y.view(*x.shape[:-1], w.shape[0]).to(x.dtype)


def int8dot_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ (q * s)^T with x first quantized per block of 32 (quantize_activations) ->
    (..., N) in x's dtype: both sides dequantized, then a float32 matmul. The fast route computes
    y_mn = s_n * sum_b d_mb * (sum over block b of qx_mk * q_nk), the inner sums in int32."""
    return _int8_activations_times(x, dequantize_int8(q, scales))


def int4dot_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The same with an int4 weight (packed (N, K/2), scales and zeros (N, K/G)): x quantized per
    block of 32, times ((q - z) * s)^T; the fast route sums q_nk * qx_mk per block in int32."""
    return _int8_activations_times(x, dequantize_int4(unpack_int4(packed), scales, zeros))
