"""The parts of a Transformer block, and the block: norms, rotary positions, attention, MLPs.

layers.py owns the per-token and per-head arithmetic: RMSNorm, LayerNorm, rotary position
embeddings (RoPE, rotate-half convention as Hugging Face, with Llama-3.1 frequency scaling),
causal self-attention (MHA / GQA, optional per-head QK-norm, a fused SDPA path and an eager
reference path that can return the attention weights), the two MLP kinds (GELU, SwiGLU) and
the Block that joins them with norms and residual adds (pre- or post-norm), and the Linear
layer they all use (nn.Linear whose bf16 products run as float32 GEMMs on CPUs where bf16 GEMMs
are slower: set_bf16_matmul). How blocks are
stacked, masks built and the KV cache advanced is model.py's business; this module imports
nothing of logitlab (the cache is duck-typed: `update(layer, k, v)`).

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model,
H query heads, Hkv key/value heads, G = H // Hkv, Dh head_dim, F d_ff.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ATTN_IMPLS = ("sdpa", "eager")
# SDPA reads grouped K/V heads without copying them since torch 2.5 (enable_gqa); older
# versions get the K/V heads repeated first.
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


# ------------------------------------------------------------------------------------------
# Linear layers: bf16 products through float32 GEMMs where the CPU is faster that way
# ------------------------------------------------------------------------------------------

BF16_MATMUL_MODES = ("auto", "native", "fp32")
_bf16_matmul = "auto"
# Without AMX, a CPU's bf16 GEMM (oneDNN, even with AVX512-BF16) runs at about half its float32
# rate (85 vs 170 GFLOP/s per core here). A float32 GEMM over the bf16-rounded operands computes
# the same thing: the product of two bf16 numbers is exact in float32, and bf16 kernels
# accumulate in float32 too; only the summation order differs, as between any two kernels.
_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
_CPU_HAS_AMX = bool(_amx()) if _amx is not None else False
# Rows below which converting the weight to float32 costs more than the faster GEMM saves
# (measured per shape at 1 thread: the crossover is at 32-64 rows for weights that stay in the
# caches, 128-256 rows for GPT-2's 50257 x 768 LM head, whose conversion streams from DRAM).
_FP32_GEMM_MIN_ROWS = 128
_FP32_GEMM_MIN_ROWS_LARGE = 512
_LARGE_WEIGHT = 1 << 22                                            # elements (16 MiB in fp32)


def set_bf16_matmul(mode: str) -> None:
    """How bf16 matrix products of the model's linear layers run on CPU (under bf16 autocast, or
    with bf16 weights and activations): "native" = the bf16 kernels; "fp32" = a float32 GEMM
    over the operands rounded to bf16, the result rounded to bf16 (the same values up to
    summation order; gradients rounded to bf16 as autocast's are); "auto" (the default) = "fp32"
    on CPUs without AMX, where it is 1.5-1.8x faster at training shapes, else "native". Products
    with few rows (a decode step) always run natively. GPUs are never affected."""
    global _bf16_matmul
    if mode not in BF16_MATMUL_MODES:
        raise ValueError(f"bf16 matmul mode must be one of {BF16_MATMUL_MODES}, got {mode!r}")
    _bf16_matmul = mode


def bf16_matmul_mode() -> str:
    """The current set_bf16_matmul mode."""
    return _bf16_matmul


def _bf16_via_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when this product should run as a float32 GEMM over bf16-rounded operands."""
    if x.device.type != "cpu" or _bf16_matmul == "native" or (_bf16_matmul == "auto" and _CPU_HAS_AMX):
        return False
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return False
    elif x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    rows = x.numel() // x.shape[-1]
    large = weight.numel() > _LARGE_WEIGHT
    return rows >= (_FP32_GEMM_MIN_ROWS_LARGE if large else _FP32_GEMM_MIN_ROWS)


@torch.library.custom_op("logitlab::bf16_addmm_via_fp32", mutates_args=())
def _bf16_addmm_via_fp32(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """round_bf16(a (M, K)) @ round_bf16(b (K, N)) [+ round_bf16(bias (N,))] -> (M, N) bf16, by a
    float32 GEMM; the operands may be bf16 already (then the rounding is exact).

    An operator of its own (opaque to torch.compile), so that its operands are really rounded to
    bf16 and its result is rounded to bf16 whether it runs eagerly or compiled: inductor would
    otherwise fuse a bf16 -> float32 round trip into its neighbours and skip the rounding. A
    float32 weight goes in as it is and is rounded inside: outside, a compiled training graph
    kept the bf16 copy of every weight from forward to backward (its partitioner counts saving
    the weight itself as a cost, though the Parameter is held anyway): GPT-2 small, 250 MB more
    at the step's peak than eager."""
    with torch.autocast("cpu", enabled=False):
        a32, b32 = a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()
        bias32 = None if bias is None else bias.to(torch.bfloat16).float()
        out = torch.mm(a32, b32) if bias32 is None else torch.addmm(bias32, a32, b32)
    return out.to(torch.bfloat16)


@_bf16_addmm_via_fp32.register_fake
def _(a, b, bias):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


class _Bf16LinearViaFp32(torch.autograd.Function):
    """y = round_bf16(x_bf16 @ w_bf16^T + b_bf16) through float32 GEMMs, forward and backward.

    Saves the bf16 input (as autocast does) and the weight itself (a Parameter, no copy); each
    gradient is a bf16 product cast to its input's dtype, as under autocast."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        N, K = weight.shape
        xb = x.to(torch.bfloat16).reshape(-1, K)                   # (M, K)
        y = torch.ops.logitlab.bf16_addmm_via_fp32(xb, weight.t(), bias)   # weight rounded inside
        ctx.save_for_backward(xb, weight)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], N)                            # (..., N) bf16

    @staticmethod
    def backward(ctx, grad_y):
        xb, weight = ctx.saved_tensors
        N, K = weight.shape
        gy = grad_y.to(torch.bfloat16).reshape(-1, N)              # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:                                # (M, N) @ (N, K)
            grad_x = torch.ops.logitlab.bf16_addmm_via_fp32(gy, weight, None)
            grad_x = grad_x.to(ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:                                # (N, M) @ (M, K)
            grad_w = torch.ops.logitlab.bf16_addmm_via_fp32(gy.t(), xb, None).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = gy.float().sum(0).to(torch.bfloat16).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with bf16 products on CPU through float32 GEMMs where that is faster (see
    set_bf16_matmul)."""
    if _bf16_via_fp32(x, weight):
        return _Bf16LinearViaFp32.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, state-dict keys, hooks) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# ------------------------------------------------------------------------------------------
# Norms
# ------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension (Zhang & Sennrich 2019).

    The statistics are computed in float32 and the normalised value is cast back to the input
    dtype before the weight multiplies it, exactly as Llama / Hugging Face do, so bf16 runs
    match theirs bit for bit."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one call, bit for bit the three-op form on
        # a float32 input (the weight goes in too: the same products). Other dtypes are normalised
        # in float32 and rounded to x's dtype before the weight, as Hugging Face does (handing
        # F.rms_norm a bf16 x directly rounds eps to bf16 on older torch releases).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LayerNorm(nn.Module):
    """y = weight * (x - mean) / sqrt(var + eps) + bias over the last dimension (Ba et al. 2016).

    Always with a bias, as GPT-2 has; the state-dict keys are `weight` and `bias`."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """`kind` is ModelConfig.norm: "rmsnorm" or "layernorm"."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return LayerNorm(dim, eps)
    raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {kind!r}")


# ------------------------------------------------------------------------------------------
# Rotary position embeddings (Su et al. 2021, "RoFormer")
# ------------------------------------------------------------------------------------------

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
    fused kernels forward + backward 24 -> 16 ms)."""
    x1, x2 = x.chunk(2, dim=-1)                                   # (B, T, heads, Dh/2) each
    if torch.compiler.is_compiling():
        (c, _), (s_neg, s) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
        return torch.cat((x1 * c + x2 * s_neg, x2 * c + x1 * s), dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin             # (B, T, heads, Dh)


# ------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------

def repeat_kv(x: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(B, Hkv, S, Dh) -> (B, Hkv*G, S, Dh): each key/value head serves G consecutive query
    heads (query head h reads kv head h // G), as Hugging Face's repeat_kv."""
    if n_groups == 1:
        return x
    B, Hkv, S, Dh = x.shape
    return x[:, :, None].expand(B, Hkv, n_groups, S, Dh).reshape(B, Hkv * n_groups, S, Dh)


def eager_attention(q, k, v, mask=None, is_causal=False):
    """The reference path: softmax(q k^T / sqrt(Dh) + mask) v, softmax in float32.

    q (B, H, T, Dh); k, v (B, H, S, Dh); mask None or bool broadcastable to (B, H, T, S) with
    True = may attend; is_causal masks key s > query t (only valid when T == S).
    Returns (out (B, H, T, Dh), weights (B, H, T, S) in q's dtype)."""
    T, S, Dh = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(Dh)      # (B, H, T, S)
    if is_causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v), weights


class Attention(nn.Module):
    """Causal self-attention: one q/k/v projection, optional QK-norm, RoPE, SDPA or eager, o_proj.

    qkv_proj: D -> (H + 2*Hkv)*Dh, its output rows are q (H*Dh), then k (Hkv*Dh), then v
    (Hkv*Dh): one matrix product instead of three (GQA when Hkv < H). o_proj: H*Dh -> D.
    QK-norm (Qwen3) is an RMSNorm over Dh applied to each head of q and k before RoPE; without
    it, q and k are rotated together in one pass over the first H + Hkv heads."""

    def __init__(self, config):
        super().__init__()
        D, H, Hkv, Dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.n_groups = H, Hkv, Dh, H // Hkv
        self.qkv_proj = Linear(D, (H + 2 * Hkv) * Dh, bias=config.qkv_bias)
        self.o_proj = Linear(H * Dh, D, bias=config.bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(Dh, config.norm_eps)
            self.k_norm = RMSNorm(Dh, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, rope=None, *, cache=None, layer: int = 0, mask=None, is_causal=False,
                impl: str = "sdpa", need_weights: bool = False):
        """x (B, T, D) -> (out (B, T, D), weights (B, H, T, S) or None).

        rope: (cos, sin) each (B, T, 1, Dh) from RotaryEmbedding, or None (no rotary positions).
        cache: anything with `update(layer, k_new, v_new) -> (k_all, v_all)` of shape
        (B, Hkv, S, Dh), or None (then S = T). mask: bool (B or 1, 1, T, S), True = may attend,
        or None; is_causal: use the plain lower-triangular mask (only when T == S and mask is None).
        need_weights forces the eager path and returns the attention weights."""
        B, T, D = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, Dh)        # (B, T, H + 2*Hkv, Dh)
        dtype = qkv.dtype  # projection output dtype (bf16 under autocast); q, k are kept in it
        # split (not three slices): backward then joins the three gradients with one cat instead
        # of adding three zero-filled (B, T, H + 2*Hkv, Dh) tensors.
        if self.q_norm is not None:
            q, k, v = qkv.split((H, Hkv, Hkv), dim=2)              # (B, T, H|Hkv, Dh) views
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        else:
            qk, v = qkv.split((H + Hkv, Hkv), dim=2)               # q and k rotate together
            if rope is not None:
                qk = apply_rope(qk, *rope)
            q, k = qk.split((H, Hkv), dim=2)
        if q.dtype != dtype:                                       # rotated in float32 under autocast
            q, k = q.to(dtype), k.to(dtype)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, H|Hkv, T, Dh)
        if cache is not None:
            k, v = cache.update(layer, k, v)                       # (B, Hkv, S, Dh) views
            if k.dtype != dtype:
                k, v = k.to(dtype), v.to(dtype)
        weights = None
        if need_weights or impl == "eager":
            out, weights = eager_attention(q, repeat_kv(k, self.n_groups), repeat_kv(v, self.n_groups),
                                           mask, is_causal)
        elif _SDPA_GQA:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                 enable_gqa=self.n_groups > 1)      # (B, H, T, Dh)
        else:
            out = F.scaled_dot_product_attention(q, repeat_kv(k, self.n_groups), repeat_kv(v, self.n_groups),
                                                 attn_mask=mask, is_causal=is_causal)
        out = out.transpose(1, 2).reshape(B, T, H * Dh)            # (B, H, T, Dh) -> (B, T, H*Dh)
        return self.o_proj(out), (weights if need_weights else None)


# ------------------------------------------------------------------------------------------
# MLPs
# ------------------------------------------------------------------------------------------

_GELU_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu; compiled, the tanh approximation is written as x * sigmoid(2u), which equals
    0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), since 1 + tanh(u) = 2 sigmoid(2u).
    Inductor's CPU code evaluates tanh several times slower than exp: compiled forward + backward
    over a (1024, 3072) float32 tensor took 18.4 ms with F.gelu and 8.8 ms in this form (1 thread),
    within 5e-7 of F.gelu. It is evaluated in float32, as F.gelu does for bf16 (inductor fuses the
    casts). Eager calls F.gelu (one kernel beats five)."""
    if approximate == "tanh" and torch.compiler.is_compiling():
        y = x.float()
        return (y * torch.sigmoid(_GELU_TANH_SCALE * (y + 0.044715 * (y * y * y)))).to(x.dtype)
    return F.gelu(x, approximate=approximate)


class GeluMLP(nn.Module):
    """down_proj(gelu(up_proj(x))): D -> F -> D (GPT-2; approximate="tanh" is GPT-2's gelu_new)."""

    def __init__(self, config):
        super().__init__()
        self.approximate = config.gelu_approximate
        self.up_proj = Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down_proj = Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu(self.up_proj(x), self.approximate))


class SwiGLU(nn.Module):
    """down_proj(silu(gate) * up): D -> F -> D (Shazeer 2020; Llama, Qwen).

    gate_up_proj: D -> 2F, its output rows are the gate (F), then the up projection (F): one
    matrix product instead of two."""

    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = Linear(config.d_model, 2 * config.d_ff, bias=config.bias)
        self.down_proj = Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)          # (B, T, F) views each
        return self.down_proj(F.silu(gate) * up)


def make_mlp(config) -> nn.Module:
    """`config.mlp` is "gelu" or "swiglu"."""
    if config.mlp == "swiglu":
        return SwiGLU(config)
    if config.mlp == "gelu":
        return GeluMLP(config)
    raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {config.mlp!r}")


# ------------------------------------------------------------------------------------------
# The block
# ------------------------------------------------------------------------------------------

class Block(nn.Module):
    """One Transformer block: attention then MLP, each with a norm and a residual add.

    pre-norm (GPT-2, Llama):  x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))
    post-norm (Vaswani et al. 2017): x = attn_norm(x + attn(x));  x = mlp_norm(x + mlp(x))
    Dropout (config.dropout, training only) acts on each sublayer's output before the add."""

    def __init__(self, config):
        super().__init__()
        self.post_norm = config.norm_placement == "post"
        self.attn_norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.mlp = make_mlp(config)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else None

    def _drop(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dropout is None or not self.training else self.dropout(t)

    def forward(self, x, rope, *, cache=None, layer=0, mask=None, is_causal=False, impl="sdpa",
                need_weights=False):
        """x (B, T, D) -> (x (B, T, D), attention weights (B, H, T, S) or None)."""
        if self.post_norm:
            a, weights = self.attn(x, rope, cache=cache, layer=layer, mask=mask, is_causal=is_causal,
                                   impl=impl, need_weights=need_weights)
            x = self.attn_norm(x + self._drop(a))
            x = self.mlp_norm(x + self._drop(self.mlp(x)))
        else:
            a, weights = self.attn(self.attn_norm(x), rope, cache=cache, layer=layer, mask=mask,
                                   is_causal=is_causal, impl=impl, need_weights=need_weights)
            x = x + self._drop(a)
            x = x + self._drop(self.mlp(self.mlp_norm(x)))
        return x, weights
