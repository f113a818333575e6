"""What multi-head latent attention costs and keeps (accounting.py counts the model; this module
says what differs for an MLA layer, mla.py): its parameters by formula, the values its cache holds
per token, its attention FLOPs per key, the activations it keeps for training, and the KV-cache
comparison `logitlab params` shows, against multi-head and grouped-query attention of the same
heads. Standard attention's numbers come out of the same functions, so accounting.py calls them
for every model.

Per layer (R latent, Rq query rank, Dn + Dr = Dh a query/key head, Dv a value head, H heads):
    parameters: D·Rq + Rq·H·Dh (queries; without Rq: D·H·Dh) + D·(R + Dr) + R·H·(Dn + Dv) + H·Dv·D
    cache per token: R + Dr values (the latent and one RoPE key), where multi-head attention of the
        same heads keeps H·(Dh + Dv) (every head's key and value) and GQA Hkv·(Dh + Dv)
"""

from __future__ import annotations

from logitlab.model.config import ModelConfig

# the grouped-query attention the comparison shows: 8 query heads per key/value head, as Llama 3
GQA_GROUP = 8


def attention_formula(config: ModelConfig) -> int:
    """The weight matrices of one attention layer: MLA's projections (the module docstring), or
    2·D·H·Dh + 2·D·Hkv·Dh (q, o and k, v) plus an output gate's D·H·Dh or D·H."""
    c = config
    D, H, Dh = c.d_model, c.n_heads, c.head_dim
    if not c.is_mla:
        gate = {"none": 0, "headwise": D * H, "elementwise": D * H * Dh}[c.attn_gate]
        return 2 * D * H * Dh + 2 * D * c.n_kv_heads * Dh + gate
    R, Dn, Dr, Dv = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    queries = D * H * Dh if c.q_lora_rank is None else D * c.q_lora_rank + c.q_lora_rank * H * Dh
    return queries + D * (R + Dr) + R * H * (Dn + Dv) + H * Dv * D


def cache_values_per_token(config: ModelConfig) -> int:
    """Values one attention layer caches per token: R + Dr with MLA, else 2·Hkv·Dh (a key and a value
    per key/value head)."""
    c = config
    return c.kv_lora_rank + c.qk_rope_head_dim if c.is_mla else 2 * c.n_kv_heads * c.head_dim


def flops_per_key(config: ModelConfig) -> int:
    """Attention FLOPs of one query against one key: q.k over Dh and p·v over the value width, 2 FLOPs
    per multiply-add, every head: 4·H·Dh, or with MLA (expanded form) 2·H·(Dh + Dv)."""
    c = config
    return 2 * c.n_heads * (c.head_dim + (c.v_head_dim if c.is_mla else c.head_dim))


def activation_elements(config: ModelConfig) -> int:
    """Values an attention layer keeps per token for the backward pass, both norms' inputs and
    outputs (4·D) included (accounting.activation_elements_per_token counts the rest of the block).
    Standard attention: q (H·Dh), k and v (2·Hkv·Dh), the output (H·Dh), QK-norm inputs, the output
    gate before and after its sigmoid. MLA: the query rank's output and its normed value (2·Rq); q
    (H·Dh); kv_a_proj's output (R + Dr) and the normed latent (R); kv_b_proj's output (H·(Dn + Dv))
    and the keys with their RoPE part (H·Dh); the attention output (H·Dv)."""
    c = config
    if not c.is_mla:
        q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        gate = {"none": 0, "headwise": c.n_heads, "elementwise": q}[c.attn_gate]
        return 4 * c.d_model + 2 * q + 2 * kv + (q + kv if c.qk_norm else 0) + 2 * gate
    H, Dh, R, Dr, Dv = c.n_heads, c.head_dim, c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim
    queries = 2 * c.q_lora_rank if c.q_lora_rank else 0
    return 4 * c.d_model + queries + H * Dh + (2 * R + Dr) + H * (c.qk_nope_head_dim + Dv) + H * Dh + H * Dv


def cache_comparison(config: ModelConfig, dtype_bytes: int) -> dict | None:
    """MLA's KV cache per token (all layers) against attention with the same heads (H heads, keys
    of Dh and values of Dv): multi-head (a key and a value for each of the H heads) and grouped-query
    with Hkv = H / GQA_GROUP; `gqa_equivalent_kv_heads` is the Hkv whose cache equals MLA's. None for
    a model without MLA."""
    c = config
    if not c.is_mla:
        return None
    L, H, per_head = c.layer_kinds.count("full_attention"), c.n_heads, c.head_dim + c.v_head_dim
    values = {"mla": cache_values_per_token(c), "gqa": max(1, H // GQA_GROUP) * per_head, "mha": H * per_head}
    out = {f"{kind}_per_token": n * L * dtype_bytes for kind, n in values.items()}
    out.update({f"{kind}_values_per_layer": n for kind, n in values.items()},
               gqa_kv_heads=max(1, H // GQA_GROUP), mha_over_mla=values["mha"] / values["mla"],
               gqa_over_mla=values["gqa"] / values["mla"], gqa_equivalent_kv_heads=values["mla"] / per_head)
    return out
