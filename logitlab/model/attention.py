"""Causal self-attention: MHA / GQA, optional per-head QK-norm, a fused SDPA path and an eager
reference path that can return the attention weights.

The KV cache is duck-typed (`update(layer, k, v)`); masks are built by the Transformer.

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model,
H query heads, Hkv key/value heads, G = H // Hkv, Dh head_dim."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.norms import RMSNorm
from logitlab.model.rope import apply_rope

ATTN_IMPLS = ("sdpa", "eager")
# SDPA reads grouped K/V heads without copying them since torch 2.5 (enable_gqa); older
# versions get the K/V heads repeated first.
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


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
        self.qkv_proj = nn.Linear(D, (H + 2 * Hkv) * Dh, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=config.bias)
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
