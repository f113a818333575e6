"""Hugging Face config.json <-> ModelConfig for the mixture-of-experts families, and the entry
points that cover every family: config_from_hf / config_to_hf (families.py exports these).

Mixtral (every layer an MoE of `num_local_experts`, softmax then top-k renormalised, an optional
window on every layer), Qwen3-MoE (QK-norm; `norm_topk_prob`; dense layers where `mlp_only_layers`
or `decoder_sparse_step` say, of width `intermediate_size`), Qwen3.5-MoE (the hybrid Qwen3.5 text
model with an MoE and a gated shared expert in every layer; also the text_config of its image-text
checkpoints) and gpt-oss (sinks, biased attention, alternating sliding and full layers, YaRN, a
biased router whose top-k logits are softmaxed, biased experts with the clamped SwiGLU). The dense
families are hf_config.py's; this module adds the expert fields, and names the config.json key
behind each size of any family (hf_field_names, for a loader's messages). DeepSeek-V3 (multi-head
latent attention with DeepSeekMoE) is hf_config_mla.py's, dispatched from here. It never touches the disk.
"""

from __future__ import annotations

import dataclasses

from logitlab.model import hf_config as dense
from logitlab.model.config import ModelConfig, conform
from logitlab.model.hf_config_mla import ARCHITECTURE as _DEEPSEEK_V3
from logitlab.model.hf_config_mla import MODEL_TYPE as _DEEPSEEK_V3_TYPE
from logitlab.model.hf_config_mla import deepseek_v3_from_hf, deepseek_v3_to_hf
from logitlab.model.keymap import hf_architecture

_MOE = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe", "GptOssForCausalLM": "gpt_oss",
        "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
        _DEEPSEEK_V3: _DEEPSEEK_V3_TYPE}                       # DeepSeek-V3: hf_config_mla.py
SUPPORTED_ARCHITECTURES = (*dense.SUPPORTED_ARCHITECTURES, *_MOE)
# the JSON type of every MoE key read here (null: the default applies)
_TYPES = {"num_local_experts": int, "num_experts": int, "num_experts_per_tok": int, "moe_intermediate_size": int,
          "shared_expert_intermediate_size": int, "norm_topk_prob": bool, "decoder_sparse_step": int,
          "mlp_only_layers": list[int], "router_aux_loss_coef": float, "router_jitter_noise": float,
          "swiglu_alpha": float, "swiglu_limit": float, "attention_bias": bool, "quantization_config": dict}


def _moe_arch(hf) -> str | None:
    if not isinstance(hf, dict):
        return None
    archs = hf.get("architectures") or []
    if archs:
        return archs[0] if archs[0] in _MOE else None
    return {v: k for k, v in _MOE.items()}.get(hf.get("model_type"))


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict of any supported class
    (SUPPORTED_ARCHITECTURES); the dense families are hf_config.config_from_hf's."""
    arch = _moe_arch(hf)
    if arch is None:
        archs = hf.get("architectures") if isinstance(hf, dict) else None
        if isinstance(archs, list) and archs and archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        return dense.config_from_hf(hf, source)
    raw, hf = hf, dense._checked_hf(hf, source)                        # raw: its nulls kept
    if arch == "Qwen3_5MoeForConditionalGeneration":
        hf = dense._checked_hf(dense._need(hf, "text_config", source), f"text_config in {source}")
    for key, value in hf.items():
        if key in _TYPES:
            conform(value, _TYPES[key], f"{key!r} in {source}")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method")
        raise ValueError(f"{source}: the weights are quantized (quantization_config.quant_method={method!r}); "
                         "logitlab loads floating-point checkpoints: dequantize them first")
    if arch == _DEEPSEEK_V3:
        return deepseek_v3_from_hf(raw, source)
    if hf.get("router_jitter_noise", 0.0):
        dense._refuse(arch, "router_jitter_noise", hf["router_jitter_noise"])
    fields = {"MixtralForCausalLM": _mixtral, "Qwen3MoeForCausalLM": _qwen3_moe,
              "GptOssForCausalLM": _gpt_oss}.get(arch, _qwen3_5_moe)(arch, hf, source)
    experts = dense._need(hf, "num_local_experts" if "num_local_experts" in hf else "num_experts", source)
    fields.update(n_experts=experts, n_experts_per_token=dense._need(hf, "num_experts_per_tok", source),
                  router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    return dense._build(source, **fields)


# ModelConfig field -> the config.json keys it is read from (GPT-2's, then the others')
_FIELD_KEYS = {"vocab_size": ("vocab_size",), "context_length": ("n_positions", "max_position_embeddings"),
               "d_model": ("n_embd", "hidden_size"), "n_layers": ("n_layer", "num_hidden_layers"),
               "n_heads": ("n_head", "num_attention_heads"), "d_ff": ("n_inner", "intermediate_size")}


def hf_field_names(hf: dict) -> dict[str, str]:
    """ModelConfig field -> the config.json key it came from ("n_layers" -> "num_hidden_layers", or
    "text_config.num_hidden_layers" for an image-text checkpoint), for messages about the file."""
    if not isinstance(hf, dict):
        return {}
    inner = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else None
    config, prefix = (inner, "text_config.") if inner is not None else (hf, "")
    gpt2 = "n_layer" in config or "n_embd" in config
    names = {name: prefix + (keys[0] if gpt2 else keys[-1]) for name, keys in _FIELD_KEYS.items()}
    # an MoE's: Mixtral and gpt-oss name the experts num_local_experts, Qwen num_experts
    names["n_experts"] = prefix + ("num_local_experts" if "num_local_experts" in config else "num_experts")
    names["moe_d_ff"] = prefix + ("moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size")
    return names


def _llama_like(arch: str, hf: dict, source: str, **overrides) -> dict:
    """The attention and sizes of a Llama-like MoE config, as ModelConfig fields."""
    if hf.get("hidden_act", "silu") != "silu":
        dense._refuse(arch, "hidden_act", hf["hidden_act"])
    theta, scaling = dense._rope_from_hf(arch, hf, source)
    d_model, n_heads = dense._need(hf, "hidden_size", source), dense._need(hf, "num_attention_heads", source)
    context = dense._rope_context(dense._need(hf, "max_position_embeddings", source), scaling, source)
    base = dict(vocab_size=dense._need(hf, "vocab_size", source), context_length=context,
                d_model=d_model, n_layers=dense._need(hf, "num_hidden_layers", source), n_heads=n_heads,
                n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=hf.get("head_dim") or d_model // n_heads,
                norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", positions="rope",
                rope_theta=theta, rope_scaling=scaling, bias=False, qkv_bias=False,
                tie_embeddings=hf.get("tie_word_embeddings", False))
    return {**base, **overrides}


def _mixtral(arch: str, hf: dict, source: str) -> dict:
    width = dense._need(hf, "intermediate_size", source)
    fields = _llama_like(arch, hf, source, d_ff=width, moe_d_ff=width, norm_topk_prob=True)
    window = hf.get("sliding_window")
    if window is not None and window < fields["context_length"]:   # one window on every layer, as Mistral
        fields.update(layer_types=("sliding_attention",) * fields["n_layers"], sliding_window=window)
    return fields


def _qwen3_moe(arch: str, hf: dict, source: str) -> dict:
    for key in ("attention_bias", "use_sliding_window"):
        if hf.get(key, False):
            dense._refuse(arch, key, hf[key])
    n, step = dense._need(hf, "num_hidden_layers", source), hf.get("decoder_sparse_step", 1)
    dense_layers = set(hf.get("mlp_only_layers") or [])
    kinds = tuple("dense" if i in dense_layers or (i + 1) % step else "moe" for i in range(n))
    return _llama_like(arch, hf, source, qk_norm=True, d_ff=dense._need(hf, "intermediate_size", source),
                       moe_d_ff=dense._need(hf, "moe_intermediate_size", source), mlp_types=kinds,
                       norm_topk_prob=hf.get("norm_topk_prob", False))


def _gpt_oss(arch: str, hf: dict, source: str) -> dict:
    if not hf.get("attention_bias", True):
        dense._refuse(arch, "attention_bias", False)
    width = dense._need(hf, "intermediate_size", source)
    n = dense._need(hf, "num_hidden_layers", source)
    kinds = tuple(hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
    if not set(kinds) <= {"sliding_attention", "full_attention"}:
        dense._refuse(arch, "layer_types", sorted(set(kinds)))
    fields = _llama_like(arch, hf, source, d_ff=width, moe_d_ff=width, bias=True, qkv_bias=True, attn_sinks=True,
                         head_dim=hf.get("head_dim", 64), norm_eps=hf.get("rms_norm_eps", 1e-5),
                         router="topk_softmax", router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                         swiglu_alpha=hf.get("swiglu_alpha", 1.702), swiglu_limit=hf.get("swiglu_limit", 7.0))
    if "sliding_attention" in kinds:
        fields.update(layer_types=kinds, sliding_window=dense._need(hf, "sliding_window", source))
    else:
        fields.update(layer_types=kinds)
    return fields


def _qwen3_5_moe(arch: str, hf: dict, source: str) -> dict:
    fields = dense.qwen3_5_fields(arch, hf, source, "moe_intermediate_size")
    shared = dense._need(hf, "shared_expert_intermediate_size", source)
    fields.update(moe_d_ff=fields["d_ff"], shared_expert_d_ff=shared,
                  shared_expert_gate=True, norm_topk_prob=True)
    return fields


# ------------------------------------------------------------------------------------------
# ModelConfig -> config.json
# ------------------------------------------------------------------------------------------

def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict:
    """A Hugging Face config.json dict for `config`, of any family (the class is chosen from its
    typed features, keymap.hf_architecture); the dense families are hf_config.config_to_hf's."""
    c = config
    if not (c.is_moe or c.is_mla):
        return dense.config_to_hf(c, dtype)
    arch = hf_architecture(c)
    if arch == _DEEPSEEK_V3:
        if c.attention != "causal":
            raise ValueError(f"attention={c.attention!r} cannot be exported as a Hugging Face {arch} checkpoint")
        return deepseek_v3_to_hf(c, dtype)
    moe = dict(num_experts_per_tok=c.n_experts_per_token, router_aux_loss_coef=c.router_aux_loss_coef,
               output_router_logits=False)
    if arch == "Qwen3_5MoeForCausalLM":
        out = dense._qwen3_5_to_hf(c, dtype)
        del out["intermediate_size"]
        return {**out, "architectures": [arch], "model_type": "qwen3_5_moe_text", "num_experts": c.n_experts,
                "moe_intermediate_size": c.moe_d_ff, "shared_expert_intermediate_size": c.shared_expert_d_ff, **moe}
    dense_twin = dataclasses.replace(c, n_experts=0, n_experts_per_token=None, moe_d_ff=None, mlp_types=None,
                                     attn_sinks=False, bias=False, qkv_bias=False, qk_norm=False,
                                     layer_types=None, sliding_window=None, **_dense_defaults())
    out = dense.config_to_hf(dense_twin, dtype)                         # Llama's keys: sizes, norms, RoPE
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key, None)
    out.update(architectures=[arch], model_type=_MOE[arch], **moe)
    if arch == "MixtralForCausalLM":
        out.update(num_local_experts=c.n_experts, intermediate_size=c.moe_d_ff, sliding_window=c.sliding_window)
    elif arch == "Qwen3MoeForCausalLM":
        out.update(num_experts=c.n_experts, moe_intermediate_size=c.moe_d_ff, intermediate_size=c.d_ff,
                   norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, use_sliding_window=False,
                   mlp_only_layers=[i for i, kind in enumerate(c.mlp_kinds) if kind == "dense"])
    else:   # nested rope_parameters: left without them, transformers gives gpt-oss its YaRN default
        rope = {"rope_type": "default", **(out.pop("rope_scaling") or {}), "rope_theta": out.pop("rope_theta")}
        out.update(num_local_experts=c.n_experts, intermediate_size=c.moe_d_ff, attention_bias=True,
                   layer_types=list(c.layer_kinds), sliding_window=c.sliding_window, swiglu_alpha=c.swiglu_alpha,
                   swiglu_limit=c.swiglu_limit, rope_parameters=rope)
    return out


def _dense_defaults() -> dict:
    """The MoE fields at their dense defaults (so the twin passes ModelConfig's checks)."""
    names = ("router", "norm_topk_prob", "router_bias", "expert_bias", "expert_act", "shared_expert_d_ff",
             "shared_expert_gate", "capacity_factor")
    return {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in names}
