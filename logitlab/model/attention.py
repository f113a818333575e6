"""Self-attention, causal (a decoder) or bidirectional (an encoder): MHA / GQA, optional per-head
QK-norm, a fused SDPA path and an eager reference path that can return the attention weights.

The KV cache is duck-typed (`update(layer, k, v)`); masks are built by the Transformer.

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model,
H query heads, Hkv key/value heads, G = H // Hkv, Dh head_dim."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.hooks import needs_eager, tap
from logitlab.model.norms import make_norm
from logitlab.model.positions import ALiBi
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


def eager_attention(q, k, v, mask=None, is_causal=False, sinks=None, hook=None, scale=None):
    """The reference path: softmax(q k^T / sqrt(Dh) + mask) v, softmax in float32; `scale`, when
    given, replaces 1 / sqrt(Dh) (multi-head latent attention's, mla.softmax_scale).

    q (B, H, T, Dh); k, v (B, H, S, Dh); mask None, bool broadcastable to (B, H, T, S) with
    True = may attend, or float (added to the logits, -inf = masked: ALiBi's bias);
    is_causal masks key s > query t (only valid when T == S).
    sinks (H,) or None: a learned logit per head that joins each row's softmax denominator and
    takes no value (gpt-oss): weights = exp(scores) / (sum exp(scores) + exp(sink)), so a head
    can put its attention "nowhere" and the row's weights sum to less than 1.
    hook: None or hook(name, tensor) -> tensor, given the scores after the mask (name "scores") and the
    weights (name "pattern"): an Attention module's hook points (hooks.py).
    Returns (out (B, H, T, Dh), weights (B, H, T, S) in q's dtype)."""
    T, S, Dh = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = torch.matmul(q, k.transpose(-2, -1))                      # (B, H, T, S)
    scores = scores / math.sqrt(Dh) if scale is None else scores * scale
    if is_causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.is_floating_point():
        scores = scores + mask
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if hook is not None:
        scores = hook("scores", scores)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        B, H = scores.shape[:2]
        sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)   # (B, H, T, 1)
        full = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
        weights = full[..., :S].to(q.dtype)                                # the sink's share dropped
    if hook is not None:
        weights = hook("pattern", weights)
    return torch.matmul(weights, v), weights


def window_mask(q_slot, k_slot, window=None, attn_mask=None):
    """Which key each query may read, from their slots on the sequence's timeline.

    q_slot (T,) and k_slot (S,) int (a k_slot < 0 is an empty cache slot); window W or None;
    attn_mask None or bool (B, S_all) over timeline slots (False = padding). Query t reads key s
    when 0 <= k_slot[s] <= q_slot[t], and, with a window, k_slot[s] > q_slot[t] - W (W keys,
    itself included). A query always reads its own slot, so no row is all masked.
    Returns bool (1 or B, 1, T, S), True = may attend."""
    qs, ks = q_slot[:, None], k_slot[None, :]                          # (T, 1), (1, S)
    allowed = (ks >= 0) & (ks <= qs)                                   # (T, S)
    if window is not None:
        allowed = allowed & (ks > qs - window)
    own = ks == qs
    if attn_mask is None:
        return (allowed | own)[None, None]                             # (1, 1, T, S)
    pad = attn_mask[:, k_slot.clamp(min=0)]                            # (B, S)
    return ((allowed[None] & pad[:, None, :]) | own[None])[:, None]    # (B, 1, T, S)


class Attention(nn.Module):
    """Self-attention: one q/k/v projection, optional QK-norm, RoPE, SDPA or eager, o_proj.

    qkv_proj: D -> (H + 2*Hkv)*Dh, its output rows are q (H*Dh), then k (Hkv*Dh), then v
    (Hkv*Dh): one matrix product instead of three (GQA when Hkv < H). o_proj: H*Dh -> D.
    QK-norm (Qwen3) is an RMSNorm over Dh applied to each head of q and k before RoPE; without
    it, q and k are rotated together in one pass over the first H + Hkv heads.

    Variants, each a config switch:
    - sliding window (a layer of type "sliding_attention"): a query reads only the last W keys;
    - output gate (attn_gate, Qiu et al. 2025; Qwen3.5): out = attention(x) * sigmoid(gate_proj(x)),
      per element (H*Dh gates) or per head (H gates), before o_proj;
    - sinks (attn_sinks, gpt-oss): a learned logit per head in the softmax denominator;
    - ALiBi (positions="alibi"): a distance bias per head, passed to SDPA as a float mask;
    - bidirectional (attention="bidirectional", an encoder): is_causal is never applied, so a query
      reads every key the mask allows (the Transformer's mask then holds only padding)."""

    HOOKS = {"q": "(B, T, H, Dh) queries after QK-norm and RoPE", "k": "(B, T, Hkv, Dh) this call's keys after "
             "QK-norm and RoPE", "v": "(B, T, Hkv, Dh) this call's values", "scores": "(B, H, T, S) q.k / "
             "sqrt(Dh) after the mask (-inf: masked); runs the layer's eager path", "pattern": "(B, H, T, S) "
             "the attention weights; runs the layer's eager path", "z": "(B, T, H, Dh) each head's output, "
             "what o_proj reads (after the output gate)"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config, layer_type: str = "full_attention"):
        super().__init__()
        D, H, Hkv, Dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.n_groups = H, Hkv, Dh, H // Hkv
        self.window = config.sliding_window if layer_type == "sliding_attention" else None
        self.qkv_proj = nn.Linear(D, (H + 2 * Hkv) * Dh, bias=config.qkv_bias)
        self.o_proj = nn.Linear(H * Dh, D, bias=config.bias)
        if config.qk_norm:
            self.q_norm = make_norm("rmsnorm", Dh, config.norm_eps, config.norm_zero_centered, config.norm_affine)
            self.k_norm = make_norm("rmsnorm", Dh, config.norm_eps, config.norm_zero_centered, config.norm_affine)
        else:
            self.q_norm = self.k_norm = None
        gates = {"none": 0, "headwise": H, "elementwise": H * Dh}[config.attn_gate]
        self.gate_proj = nn.Linear(D, gates, bias=config.qkv_bias) if gates else None
        self.sinks = nn.Parameter(torch.zeros(H)) if config.attn_sinks else None
        self.rope_interleaved = config.rope_interleaved
        self.alibi = ALiBi(H) if config.positions == "alibi" else None
        self.causal = config.attention == "causal"

    def forward(self, x, rope=None, *, cache=None, layer: int = 0, mask=None, is_causal=False,
                impl: str = "sdpa", need_weights: bool = False, key_rope=None, value_embed=None):
        """x (B, T, D) -> (out (B, T, D), weights (B, H, T, S) or None).

        rope: (cos, sin) each (B, T, 1, Dh) from RotaryEmbedding, or None (no rotary positions).
        cache: anything with `update(layer, k_new, v_new) -> (k_all, v_all)` of shape
        (B, Hkv, S, Dh), or None (then S = T). mask: bool (B or 1, 1, T, S), True = may attend,
        or None; is_causal: use the plain lower-triangular mask (only when T == S and mask is None).
        A sliding window layer with a cache builds its own mask from the slots the cache returns
        (cache.key_slots, mask then carries the padding as `(attn_mask, q_slot)`).
        key_rope: (cos, sin) (1, S, 1, Dh) for caches that keep keys unrotated (cache.rotates_keys,
        StreamingLLM): keys are then rotated after the cache, at their slots in it.
        need_weights forces the eager path and returns the attention weights.
        value_embed: (B, Hkv, T, Dh) or None, added to this call's values before the cache
        (ValueEmbedding, ModelConfig.value_embeddings)."""
        B, T, D = x.shape
        H, Dh = self.n_heads, self.head_dim
        is_causal = is_causal and self.causal                      # an encoder's query reads later keys too
        q, k, v = self._project(x, None if key_rope is not None else rope)     # (B, H|Hkv, T, Dh)
        if value_embed is not None:                                # the recipe's value embedding
            v = v + value_embed.to(v.dtype)                        # (B, Hkv, T, Dh)
        if cache is not None:
            k, v = cache.update(layer, k, v)                       # (B, Hkv, S, Dh)
            if k.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            if key_rope is not None:                               # rotate at the slots of the cache
                q = apply_rope(q.transpose(1, 2), *rope, self.rope_interleaved).transpose(1, 2).to(k.dtype)
                k = apply_rope(k.transpose(1, 2), *key_rope, self.rope_interleaved).transpose(1, 2).to(q.dtype)
        if self.window is not None:
            mask, is_causal = self._window_mask(mask, cache, layer, T, k.shape[2], x.device)
        if self.alibi is not None:
            mask, is_causal = self._alibi_mask(mask, is_causal, cache, layer, T, k.shape[2], q), False
        # a hook on the scores or the pattern asks for the eager path, as need_weights does
        out, weights = self._attend(q, k, v, mask, is_causal, impl, need_weights or needs_eager(self))
        out = out.transpose(1, 2).reshape(B, T, H * Dh)            # (B, H, T, Dh) -> (B, T, H*Dh)
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(x))                # (B, T, H*Dh) or (B, T, H)
            out = (out.view(B, T, H, Dh) * gate.view(B, T, H, -1)).view(B, T, H * Dh)
        out = tap(self, "z", out, (B, T, H, Dh))
        return self.o_proj(out), (weights if need_weights else None)

    def _project(self, x, rope):
        """x (B, T, D) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh): QK-norm and RoPE applied."""
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
                q, k = apply_rope(q, *rope, self.rope_interleaved), apply_rope(k, *rope, self.rope_interleaved)
        else:
            qk, v = qkv.split((H + Hkv, Hkv), dim=2)               # q and k rotate together
            if rope is not None:
                qk = apply_rope(qk, *rope, self.rope_interleaved)
            q, k = qk.split((H, Hkv), dim=2)
        if q.dtype != dtype:                                       # rotated in float32 under autocast
            q, k = q.to(dtype), k.to(dtype)
        q, k, v = tap(self, "q", q), tap(self, "k", k), tap(self, "v", v)     # hook points: hooks.py
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _window_mask(self, mask, cache, layer, T, S, device):
        """The sliding-window mask of this layer: (mask, is_causal) for SDPA / eager."""
        slots = cache.key_slots(layer) if cache is not None else None
        if isinstance(mask, tuple):                                # (attn_mask (B, S_all) or None, q_slot)
            attn_mask, q_slot = mask
        else:
            attn_mask, q_slot = None, torch.arange(S - T, S, device=device)
        if slots is None:
            slots = torch.arange(S, device=device)
        return window_mask(q_slot, slots, self.window, attn_mask), False

    def _alibi_mask(self, mask, is_causal, cache, layer, T, S, q):
        """ALiBi's float mask (B|1, H, T, S) from this layer's bool mask (or is_causal) and the
        timeline slots of queries and keys (a sliding window cache's key_slots, else S - T .. S - 1
        and 0 .. S - 1)."""
        slots = cache.key_slots(layer) if self.window is not None and cache is not None else None
        k_slot = slots if slots is not None else torch.arange(S, device=q.device)
        q_slot = torch.arange(S - T, S, device=q.device) if slots is None else slots[-T:]
        return self.alibi.bias(q_slot, k_slot, mask, is_causal, q.dtype)

    def _attend(self, q, k, v, mask, is_causal, impl, need_weights):
        """q (B, H, T, Dh), k, v (B, Hkv, S, Dh) -> (out (B, H, T, Dh), weights or None).

        Fast paths installed from outside (kernels.triton_install) override this method: keep its
        signature."""
        if need_weights or impl == "eager" or self.sinks is not None:
            # sinks: SDPA has no extra softmax column, so the reference path computes them
            hook = None if self._taps is None else lambda name, t: tap(self, name, t)
            return eager_attention(q, repeat_kv(k, self.n_groups), repeat_kv(v, self.n_groups),
                                   mask, is_causal, self.sinks, hook)
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                  enable_gqa=self.n_groups > 1), None
        return F.scaled_dot_product_attention(q, repeat_kv(k, self.n_groups), repeat_kv(v, self.n_groups),
                                              attn_mask=mask, is_causal=is_causal), None


class ValueEmbedding(nn.Module):
    """A token embedding table of one attention layer, added to that layer's values (the value
    embeddings of modded-nanogpt and nanochat; ModelConfig.value_embeddings): a token brings its
    own value vector into every position that attends to it, at the price of a (V_padded, Hkv*Dh)
    table and no matrix product.

    ids (B, T) -> (B, Hkv, T, Dh) = 2 * sigmoid(gate[h]) * embed(ids) for kv head h; the gate
    starts at zero, so each head takes the table at weight 1 and learns how much to keep."""

    def __init__(self, rows: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.embed = nn.Embedding(rows, n_kv_heads * head_dim)
        self.gate = nn.Parameter(torch.zeros(n_kv_heads))

    def reset_parameters(self) -> None:
        """The gate at zero (Transformer.init_weights initialises the table as the embeddings)."""
        with torch.no_grad():
            self.gate.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        Hkv, Dh = self.n_kv_heads, self.head_dim
        ve = self.embed(ids).view(B, T, Hkv, Dh).transpose(1, 2)           # (B, Hkv, T, Dh)
        return ve * (2.0 * torch.sigmoid(self.gate)).view(1, Hkv, 1, 1).to(ve.dtype)


def make_value_embeddings(config, rows: int) -> nn.ModuleDict | None:
    """A ValueEmbedding of `rows` (V_padded) rows per layer that has one (config.has_value_embedding),
    keyed by the layer's index; None without value embeddings."""
    if config.value_embeddings == "none":
        return None
    return nn.ModuleDict({str(i): ValueEmbedding(rows, config.n_kv_heads, config.head_dim)
                          for i in range(config.n_layers) if config.has_value_embedding(i)})
