"""Hugging Face names of a multi-head latent attention layer's tensors, both ways (keymap.py calls
these for DeepseekV3ForCausalLM; transformer.py documents logitlab's keys).

Under model.layers.{i}.self_attn. DeepSeek-V3 stores q_a_proj, q_a_layernorm, q_b_proj (or q_proj
without a query rank), kv_a_proj_with_mqa (rows: the latent, then the RoPE key), kv_a_layernorm,
kv_b_proj (per head: key rows, then value rows) and o_proj: logitlab's attn.* tensors as they are,
under shorter names, so the map is a table. Its checkpoints also carry the multi-token-prediction
module as layer num_hidden_layers (model.layers.61.* in DeepSeek-V3), which is not part of the
causal LM: drop_mtp_layers leaves it out, as transformers does. Pure functions; imports nothing.
"""

from __future__ import annotations

import re

# Hugging Face module under model.layers.{i}. -> logitlab module under blocks.{i}.
MLA_NAMES = {"self_attn.q_proj": "attn.q_proj", "self_attn.q_a_proj": "attn.q_a_proj",
             "self_attn.q_a_layernorm": "attn.q_a_norm", "self_attn.q_b_proj": "attn.q_b_proj",
             "self_attn.kv_a_proj_with_mqa": "attn.kv_a_proj", "self_attn.kv_a_layernorm": "attn.kv_a_norm",
             "self_attn.kv_b_proj": "attn.kv_b_proj", "self_attn.o_proj": "attn.o_proj"}
_TO_HF = {v: k for k, v in MLA_NAMES.items()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(\w+)")


def deepseek_v3_architecture(c, bad) -> str:
    """"DeepseekV3ForCausalLM" when that class runs the MLA config `c` exactly; bad(field, value,
    arch) raises for a feature it cannot hold."""
    arch = "DeepseekV3ForCausalLM"
    need = dict(norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=False, norm_zero_centered=False)
    if c.is_moe:
        need.update(router="sigmoid_topk", router_bias=False, expert_bias=False, expert_act="swiglu",
                    shared_expert_gate=False, capacity_factor=None)
    for field, value in need.items():
        if getattr(c, field) != value:
            bad(field, getattr(c, field), arch)
    k = c.mlp_kinds.count("dense")
    if c.mlp_kinds != ("dense",) * k + ("moe",) * (c.n_layers - k):
        bad("mlp_types", c.mlp_types, f"{arch} (dense layers first, then MoE: first_k_dense_replace)")
    if c.is_moe and c.shared_expert_d_ff % c.moe_d_ff:
        bad("shared_expert_d_ff", c.shared_expert_d_ff, f"{arch} (n_shared_experts experts of moe_d_ff)")
    return arch


def mla_name_from_hf(key: str) -> str | None:
    """The logitlab name of one Hugging Face MLA tensor (model.layers.{i}.self_attn.<part>.<leaf>),
    or None for any other tensor."""
    m = _LAYER.fullmatch(key)
    if m is None or m.group(2) not in MLA_NAMES:
        return None
    return f"blocks.{m.group(1)}.{MLA_NAMES[m.group(2)]}.{m.group(3)}"


def mla_name_to_hf(i: str, sub: str, leaf: str) -> str | None:
    """The Hugging Face name of logitlab's blocks.{i}.<sub>.<leaf> when sub is an MLA module, else None."""
    return f"model.layers.{i}.{_TO_HF[sub]}.{leaf}" if sub in _TO_HF else None


def drop_mtp_layers(state: dict, n_layers: int) -> dict:
    """`state` without the layers past the model's n_layers (DeepSeek's multi-token-prediction module)."""
    def kept(key: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", key)
        return m is None or int(m.group(1)) < n_layers

    return {k: v for k, v in state.items() if kept(k)}
