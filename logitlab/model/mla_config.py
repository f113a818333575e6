"""The checks of ModelConfig's multi-head latent attention fields: config.py declares the fields and
calls check_mla from ModelConfig.__post_init__; the checks live here so that config.py stays short.
Imports nothing.

Multi-head latent attention (DeepSeek-V2, V3) is on when kv_lora_rank is set. Its head widths:
Dn = qk_nope_head_dim (the part of a query/key head without position), Dr = qk_rope_head_dim (the
decoupled RoPE part, one key shared by all heads), Dv = v_head_dim; head_dim is the query/key
width Dn + Dr, the width the softmax scale reads.
"""

from __future__ import annotations

_FIELDS = ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def mla_head_dim(c) -> int:
    """Dh = Dn + Dr of an MLA config `c` (for head_dim to default to); the two must be set."""
    for name in ("qk_rope_head_dim", "qk_nope_head_dim"):
        if getattr(c, name) is None:
            raise ValueError(f"kv_lora_rank={c.kv_lora_rank} (multi-head latent attention) needs {name}")
    return c.qk_nope_head_dim + c.qk_rope_head_dim


def check_mla(c, fix) -> None:
    """The MLA fields of ModelConfig `c`. Without kv_lora_rank none of them may be set; with it,
    the widths are positive, head_dim is Dn + Dr (derived before head_dim's own default, see
    ModelConfig.__post_init__), v_head_dim defaults to Dn, and the attention features MLA does not
    combine with (every head its own keys: n_kv_heads == n_heads; RoPE on the Dr part alone; no
    QK-norm, output gate, sinks, value embeddings, sliding windows or Gated DeltaNet layers) are
    refused by name."""
    if c.kv_lora_rank is None:
        for name in _FIELDS:
            if getattr(c, name) is not None:
                raise ValueError(f"{name}={getattr(c, name)!r} is set but kv_lora_rank is null "
                                 "(multi-head latent attention is off)")
        return
    if c.v_head_dim is None:
        fix("v_head_dim", c.qk_nope_head_dim)
    for name in ("kv_lora_rank", *_FIELDS):
        value = getattr(c, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if c.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be even: RoPE turns pairs")
    if c.head_dim != mla_head_dim(c):
        raise ValueError(f"head_dim ({c.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim = "
                         f"{mla_head_dim(c)} with multi-head latent attention")
    needs = {"positions": "rope", "n_kv_heads": c.n_heads, "partial_rotary_factor": 1.0, "qk_norm": False,
             "attn_gate": "none", "attn_sinks": False, "value_embeddings": "none"}
    for name, value in needs.items():
        if getattr(c, name) != value:
            raise ValueError(f"multi-head latent attention (kv_lora_rank={c.kv_lora_rank}) needs {name}={value!r}, "
                             f"got {getattr(c, name)!r}")
    if c.layer_types is not None:
        raise ValueError(f"multi-head latent attention needs every layer full_attention, got layer_types with "
                         f"{', '.join(sorted(set(c.layer_types) - {'full_attention'}))}")
