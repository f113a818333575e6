"""Hugging Face config.json <-> ModelConfig for DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head
latent attention, DeepSeekMoE's sigmoid routing over expert groups with a correction bias and a
routed scaling factor, a shared expert, dense MLPs in the first `first_k_dense_replace` layers,
YaRN, RoPE on interleaved pairs (`rope_interleave`).

hf_config_moe.py calls these for the class; the dense helpers are hf_config.py's. The keys a
missing value defaults for are read with transformers' DeepseekV3Config defaults. The
multi-token-prediction layers (`num_nextn_predict_layers`) are not part of the causal LM:
transformers does not build them and neither does logitlab (keymap_mla drops their tensors).
It never touches the disk.
"""

from __future__ import annotations

import dataclasses

from logitlab.model import hf_config as dense
from logitlab.model.config import ModelConfig, conform

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
# the JSON type of every DeepSeek key read here (null: the default applies)
_TYPES = {"kv_lora_rank": int, "q_lora_rank": int, "qk_rope_head_dim": int, "qk_nope_head_dim": int,
          "v_head_dim": int, "n_routed_experts": int, "n_shared_experts": int, "num_experts_per_tok": int,
          "moe_intermediate_size": int, "n_group": int, "topk_group": int, "first_k_dense_replace": int,
          "routed_scaling_factor": float, "norm_topk_prob": bool, "rope_interleave": bool, "scoring_func": str,
          "topk_method": str, "moe_layer_freq": int, "num_nextn_predict_layers": int}
# transformers' DeepseekV3Config defaults, for keys a config.json leaves out
_DEFAULTS = {"q_lora_rank": 1536, "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
             "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_interleave": True}


def deepseek_v3_from_hf(raw: dict, source: str) -> ModelConfig:
    """ModelConfig of a DeepseekV3ForCausalLM config.json `raw` (quantized checkpoints are refused
    before, by hf_config_moe). q_lora_rank: null is no low-rank query path; absent is the class default."""
    hf = dense._checked_hf(raw, source)
    for key, value in hf.items():
        if key in _TYPES:
            conform(value, _TYPES[key], f"{key!r} in {source}")
    get = lambda key: hf.get(key, _DEFAULTS.get(key))               # noqa: E731
    _refuse_unsupported(hf)
    n, heads = dense._need(hf, "num_hidden_layers", source), dense._need(hf, "num_attention_heads", source)
    if hf.get("num_key_value_heads", heads) != heads:                    # transformers' expand_kv gives H heads
        dense._refuse(ARCHITECTURE, "num_key_value_heads", hf["num_key_value_heads"])
    theta, scaling = dense._rope_from_hf(ARCHITECTURE, hf, source)
    fields = dict(
        vocab_size=dense._need(hf, "vocab_size", source), n_layers=n, n_heads=heads,
        context_length=dense._rope_context(dense._need(hf, "max_position_embeddings", source), scaling),
        d_model=dense._need(hf, "hidden_size", source), d_ff=dense._need(hf, "intermediate_size", source),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", positions="rope", rope_theta=theta,
        rope_scaling=scaling, rope_interleaved=get("rope_interleave"), bias=False, qkv_bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        kv_lora_rank=dense._need(hf, "kv_lora_rank", source),
        q_lora_rank=raw.get("q_lora_rank", _DEFAULTS["q_lora_rank"]),
        **{key: dense._need(hf, key, source) for key in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")})
    dense_layers = min(get("first_k_dense_replace"), n)
    if dense_layers < n:                                                 # an MoE from layer k on
        width = dense._need(hf, "moe_intermediate_size", source)
        fields.update(
            mlp_types=("dense",) * dense_layers + ("moe",) * (n - dense_layers), moe_d_ff=width,
            n_experts=dense._need(hf, "n_routed_experts", source),
            n_experts_per_token=dense._need(hf, "num_experts_per_tok", source), router="sigmoid_topk",
            n_expert_groups=get("n_group"), topk_groups=get("topk_group"),
            routed_scaling_factor=get("routed_scaling_factor"), norm_topk_prob=get("norm_topk_prob"),
            shared_expert_d_ff=width * get("n_shared_experts"))
    return dense._build(source, **fields)


def _refuse_unsupported(hf: dict) -> None:
    """Keys whose values transformers' DeepseekV3 would ignore and run otherwise (DeepSeek-V2's
    softmax routing, MoE layers at intervals) or that logitlab has no switch for."""
    if hf.get("hidden_act", "silu") != "silu":
        dense._refuse(ARCHITECTURE, "hidden_act", hf["hidden_act"])
    if hf.get("attention_bias", False):       # q_a / kv_a / o biases without MLP biases: no logitlab switch
        dense._refuse(ARCHITECTURE, "attention_bias", True)
    for key, ok in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, ok) != ok:
            dense._refuse(ARCHITECTURE, key, hf[key])


def deepseek_v3_to_hf(c: ModelConfig, dtype: str) -> dict:
    """The config.json of DeepseekV3ForCausalLM for the MLA config `c` (rope_parameters nested, as
    transformers 5 writes them; a model without experts as every layer dense). The caller has
    checked the class with keymap.hf_architecture (keymap_mla.deepseek_v3_architecture)."""
    rope = dense._rope_to_hf(dataclasses.replace(c, rope_interleaved=False))   # the layout: rope_interleave
    params = {"rope_type": "default", **(rope["rope_scaling"] or {}), "rope_theta": rope["rope_theta"]}
    moe = c.is_moe
    return dict(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=c.vocab_size,
        max_position_embeddings=rope.get("max_position_embeddings", c.context_length), hidden_size=c.d_model,
        intermediate_size=c.d_ff, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_heads, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim, qk_nope_head_dim=c.qk_nope_head_dim, v_head_dim=c.v_head_dim,
        first_k_dense_replace=c.mlp_kinds.count("dense"), n_routed_experts=c.n_experts if moe else 1,
        num_experts_per_tok=c.n_experts_per_token if moe else 1, moe_intermediate_size=c.moe_d_ff if moe else c.d_ff,
        n_shared_experts=c.shared_expert_d_ff // c.moe_d_ff if moe else 0, n_group=c.n_expert_groups,
        topk_group=c.topk_groups, routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob,
        hidden_act="silu", rms_norm_eps=c.norm_eps, rope_interleave=c.rope_interleaved, rope_parameters=params,
        attention_bias=False, attention_dropout=0.0, tie_word_embeddings=c.tie_embeddings, num_nextn_predict_layers=0,
        initializer_range=c.init_std, torch_dtype=dtype)
