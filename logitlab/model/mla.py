"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-AI 2024, and DeepSeek-V3): every head's
keys and values are rebuilt from one compressed latent per position, and the cache keeps only that
latent and one rotated key, not H keys and H values.

mla.py owns the MLA layer (the block builds it instead of attention.Attention when
config.is_mla), its softmax scale and the choice of form; the cache entry is cache.LatentKV, the
fields' checks mla_config.py, the accounting accounting_mla.py.

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model, H heads,
R kv_lora_rank (the latent), Rq q_lora_rank, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dh = Dn + Dr (a query or key head), Dv v_head_dim.

    queries   q = q_b_proj(q_a_norm(q_a_proj(x)))   D -> Rq -> H*Dh   (without Rq: q_proj, D -> H*Dh)
              each head split into q_nope (Dn) and q_rope (Dr); q_rope rotated
    latent    [c | k_rope] = kv_a_proj(x)            D -> R + Dr; c normed (kv_a_norm), k_rope
              rotated: ONE positional key that all H heads share (RoPE is "decoupled" from c)
    keys and values, from c alone: kv_b_proj(c)     R -> H*(Dn + Dv): per head k_nope (Dn), v (Dv)
              k = [k_nope | k_rope] (Dh per head)
    out       o_proj(attention(q, k, v))              H*Dv -> D

State-dict keys (R kv_lora_rank, Rq q_lora_rank), in place of attention's under blocks.{i}.attn.:
    q_a_proj.weight (Rq, D), q_a_norm.weight (Rq,), q_b_proj.weight (H*Dh, Rq)   or q_proj.weight (H*Dh, D)
    kv_a_proj.weight (R + Dr, D)       rows: the latent c, then the RoPE key
    kv_a_norm.weight (R,)
    kv_b_proj.weight (H*(Dn + Dv), R)  per head: Dn key rows, then Dv value rows
    o_proj.weight (D, H*Dv)

Two forms compute the same attention (tests/test_mla.py checks them against each other):

- "expanded", the reference: decompress K and V for every position, then ordinary attention
  with Dh-wide queries and keys and Dv-wide values. Training and prefill use it.
- "absorbed", for decoding: with W_UK_h (Dn, R) and W_UV_h (Dv, R) head h's rows of kv_b_proj,
      score_h(t, s) = q_nope_h . (W_UK_h c_s) + q_rope_h . k_rope_s
                    = (W_UK_h^T q_nope_h) . c_s + q_rope_h . k_rope_s,
  so a query taken into latent space, q_lat = W_UK_h^T q_nope_h (R), attends over the cached rows
  [c | k_rope] as they are: multi-query attention with one key head of width R + Dr and one value
  head, c, of width R; W_UV_h is applied after the weighted sum, z_h = W_UV_h (sum_s p_s c_s).
  A decode step then reads S*(R + Dr) cached numbers and never decompresses S*H*(Dn + Dv).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.attention import eager_attention
from logitlab.model.hooks import needs_eager, tap
from logitlab.model.norms import RMSNorm
from logitlab.model.rope import apply_rope
from logitlab.model.rope_scaling import yarn_mscale

MLA_FORMS = ("auto", "expanded", "absorbed")
# DeepSeek's reference code and transformers build the two latent norms with RMSNorm's default
# epsilon, whatever rms_norm_eps says (the block's norms read it).
LATENT_NORM_EPS = 1e-6


def softmax_scale(config) -> float:
    """The factor on q.k: 1 / sqrt(Dh), times mscale(s, mscale_all_dim)^2 under YaRN with
    mscale_all_dim set (DeepSeek's reference, as transformers' yarn_apply_mscale): YaRN's attention
    factor (rope_scaling.yarn_attention) scales only the rotated Dr dimensions, through the cos/sin
    tables; this one scales every dimension's logit. DeepSeek-V3 (factor 40, mscale = mscale_all_dim
    = 1) has a table factor of 1 and a logit factor of (0.1 ln 40 + 1)^2 = 1.874."""
    scale = 1.0 / math.sqrt(config.qk_nope_head_dim + config.qk_rope_head_dim)
    r = config.rope_scaling
    if r is not None and r.rope_type == "yarn" and r.mscale_all_dim:
        scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return scale


class MLA(nn.Module):
    """Multi-head latent attention: the projections of the module docstring, the expanded and the
    absorbed form. `form` ("auto", "expanded" or "absorbed"; set_mla_form) chooses: "auto" takes the
    absorbed form when the call reads cached positions (decoding: S > T) and the expanded form
    otherwise (training, prefill: decompressing its own T latents once is cheaper than absorbing).

    Biases: q_a_proj / kv_a_proj (or q_proj) when config.qkv_bias, o_proj when config.bias;
    q_b_proj and kv_b_proj never (the absorbed form folds kv_b_proj's weight into the query and
    the output, which a bias would not survive)."""

    HOOKS = {"q": "(B, T, H, Dh) queries, [q_nope | q_rope] with the RoPE part rotated",
             "latent": "(B, T, R + Dr) this call's cache rows: the normed latent and the shared rotated key",
             "scores": "(B, H, T, S) q.k times the softmax scale, after the mask; runs the eager path",
             "pattern": "(B, H, T, S) the attention weights; runs the eager path",
             "z": "(B, T, H, Dv) each head's output, what o_proj reads"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config):
        super().__init__()
        D, H = config.d_model, config.n_heads
        R, Rq, Dn, Dr, Dv = (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim,
                             config.qk_rope_head_dim, config.v_head_dim)
        self.n_heads, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = H, R, Dn, Dr, Dv
        if Rq is None:
            self.q_proj = nn.Linear(D, H * (Dn + Dr), bias=config.qkv_bias)
        else:
            self.q_a_proj = nn.Linear(D, Rq, bias=config.qkv_bias)
            self.q_a_norm = RMSNorm(Rq, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(Rq, H * (Dn + Dr), bias=False)
        self.kv_a_proj = nn.Linear(D, R + Dr, bias=config.qkv_bias)
        self.kv_a_norm = RMSNorm(R, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(R, H * (Dn + Dv), bias=False)
        self.o_proj = nn.Linear(H * Dv, D, bias=config.bias)
        self.scale = softmax_scale(config)
        self.rope_interleaved = config.rope_interleaved
        self.causal = config.attention == "causal"
        self.form = "auto"

    def forward(self, x, rope=None, *, cache=None, layer: int = 0, mask=None, is_causal=False,
                impl: str = "sdpa", need_weights: bool = False, key_rope=None, value_embed=None):
        """x (B, T, D) -> (out (B, T, D), pattern (B, H, T, S) or None); the arguments are
        attention.Attention.forward's. cache: anything with `update_latent(layer, latent_new)
        -> latent_all` of shape (B, 1, S, R + Dr) (cache.LatentKV), or None (then S = T)."""
        if key_rope is not None:
            raise ValueError("multi-head latent attention does not run with a StreamingLLM cache")
        if value_embed is not None:                                # values are rebuilt from the latent
            raise ValueError("multi-head latent attention takes no value embeddings (value_embeddings)")
        B, T, D = x.shape
        H = self.n_heads
        is_causal = is_causal and self.causal
        q_nope, q_rope = self._queries(x, rope)                    # (B, H, T, Dn), (B, H, T, Dr)
        latent = tap(self, "latent", self._latent(x, rope), (B, T, -1))   # (B, 1, T, R + Dr): [c | k_rope]
        if cache is not None:
            latent = cache.update_latent(layer, latent)            # (B, 1, S, R + Dr)
            latent = latent if latent.dtype == x.dtype else latent.to(x.dtype)
        absorbed = self.form == "absorbed" or (self.form == "auto" and latent.shape[2] > T)
        if absorbed:
            q, k, v = self._absorbed_qkv(q_nope, q_rope, latent)   # (B, H, T, R+Dr), (B, 1, S, R+Dr), (B, 1, S, R)
        else:
            q, k, v = self._expanded_qkv(q_nope, q_rope, latent)   # (B, H, T, Dh), (B, H, S, Dh), (B, H, S, Dv)
        eager = need_weights or needs_eager(self)                  # a hook on scores / pattern: eager
        z, pattern = self._attend(q, k, v, mask, is_causal, impl, eager)   # (B, H, T, R or Dv)
        if absorbed:
            z = self._values_from_latent(z)                        # (B, H, T, R) -> (B, H, T, Dv)
        z = z.transpose(1, 2).reshape(B, T, H * self.v_dim)        # (B, H, T, Dv) -> (B, T, H*Dv)
        z = tap(self, "z", z, (B, T, H, self.v_dim))
        return self.o_proj(z), (pattern if need_weights else None)

    def _queries(self, x, rope):
        """x (B, T, D) -> q_nope (B, H, T, Dn), q_rope (B, H, T, Dr) rotated."""
        B, T, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)                                     # (B, T, H*Dh)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))    # (B, T, Rq) -> (B, T, H*Dh)
        q_nope, q_rope = q.view(B, T, self.n_heads, -1).split((self.nope_dim, self.rope_dim), dim=-1)
        if rope is not None:
            q_rope = apply_rope(q_rope, *rope, self.rope_interleaved).to(q.dtype)
        if self._taps is not None:                                 # hooks.py: the query seen whole
            q = tap(self, "q", torch.cat((q_nope, q_rope), dim=-1))     # (B, T, H, Dh)
            q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        return q_nope.transpose(1, 2), q_rope.transpose(1, 2)

    def _latent(self, x, rope):
        """x (B, T, D) -> the rows the cache keeps, (B, 1, T, R + Dr): the normed latent c, then the
        rotated key k_rope that every head shares."""
        B, T, _ = x.shape
        c, k_rope = self.kv_a_proj(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)   # (B, T, R), (B, T, Dr)
        k_rope = k_rope.unsqueeze(2)                               # (B, T, 1, Dr)
        if rope is not None:
            k_rope = apply_rope(k_rope, *rope, self.rope_interleaved).to(c.dtype)
        return torch.cat((self.kv_a_norm(c).unsqueeze(2), k_rope), dim=-1).transpose(1, 2)

    def _expanded_qkv(self, q_nope, q_rope, latent):
        """The reference form: every cached latent decompressed into H keys and H values.
        -> q (B, H, T, Dh), k (B, H, S, Dh), v (B, H, S, Dv)."""
        B, _, S, _ = latent.shape
        H, Dn = self.n_heads, self.nope_dim
        c, k_rope = latent.split((self.kv_lora_rank, self.rope_dim), dim=-1)   # (B, 1, S, R), (B, 1, S, Dr)
        kv = self.kv_b_proj(c.squeeze(1)).view(B, S, H, Dn + self.v_dim).transpose(1, 2)   # (B, H, S, Dn + Dv)
        k_nope, v = kv.split((Dn, self.v_dim), dim=-1)             # (B, H, S, Dn), (B, H, S, Dv)
        k = torch.cat((k_nope, k_rope.expand(B, H, S, self.rope_dim)), dim=-1)   # (B, H, S, Dh)
        return torch.cat((q_nope, q_rope), dim=-1), k, v

    def _absorbed_qkv(self, q_nope, q_rope, latent):
        """The decode form: W_UK folded into the query, attention over the cached rows as they are.
        -> q (B, H, T, R + Dr), k = latent (B, 1, S, R + Dr), v = c (B, 1, S, R)."""
        w_uk = self._kv_b_weight()[:, :self.nope_dim]              # (H, Dn, R)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)    # (B, H, T, R)
        return torch.cat((q_latent, q_rope), dim=-1), latent, latent[..., :self.kv_lora_rank]

    def _values_from_latent(self, z_latent):
        """z_latent (B, H, T, R), the weighted sum of cached latents -> z (B, H, T, Dv) = W_UV_h z_h."""
        w_uv = self._kv_b_weight()[:, self.nope_dim:]              # (H, Dv, R)
        return torch.einsum("bhtr,hvr->bhtv", z_latent, w_uv)

    def _kv_b_weight(self):
        """kv_b_proj's weight (H*(Dn + Dv), R) as (H, Dn + Dv, R): per head, Dn key rows then Dv value rows."""
        return self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def _attend(self, q, k, v, mask, is_causal, impl, need_weights):
        """q (B, H, T, E), k (B, H or 1, S, E), v (B, H or 1, S, Ev) -> (z (B, H, T, Ev), pattern or None).
        One key/value head (the absorbed form) is read by every query head."""
        if need_weights or impl == "eager":
            hook = None if self._taps is None else lambda name, t: tap(self, name, t)
            return eager_attention(q, k, v, mask, is_causal, hook=hook, scale=self.scale)   # k, v broadcast
        if k.shape[1] == 1 < q.shape[1]:
            return self._attend_one_head(q, k, v, mask, is_causal), None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale), None

    def _attend_one_head(self, q, k, v, mask, is_causal):
        """The absorbed form's attention: the H query heads folded into the query axis, (B, H, T, E) ->
        (B, 1, H*T, E), so one attention reads the single cached key/value head as it is (SDPA's
        enable_gqa would copy it H times on a CPU). The causal mask is made explicit, aligned to the
        end: query t of T sits at slot S - T + t. -> z (B, H, T, Ev)."""
        B, H, T, E = q.shape
        S = k.shape[2]
        if is_causal:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)   # (T, S)
        if mask is not None:
            m = mask if mask.dim() == 4 else mask.view(1, 1, *mask.shape[-2:])      # (B|1, 1, T|1, S)
            mask = m.expand(m.shape[0], H, T, S).reshape(m.shape[0], 1, H * T, S)
        z = F.scaled_dot_product_attention(q.reshape(B, 1, H * T, E), k, v, attn_mask=mask, scale=self.scale)
        return z.view(B, H, T, -1)                                  # (B, 1, H*T, Ev) -> (B, H, T, Ev)


def set_mla_form(model, form: str) -> None:
    """Set the form of every MLA layer of `model`: "auto", "expanded" or "absorbed"."""
    if form not in MLA_FORMS:
        raise ValueError(f"MLA form must be one of {MLA_FORMS}, got {form!r}")
    for module in model.modules():
        if isinstance(module, MLA):
            module.form = form
