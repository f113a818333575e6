"""Hugging Face config.json <-> ModelConfig: config_from_hf / config_to_hf.

hf_config.py reads and writes the config.json of every supported Hugging Face class (GPT-2,
Llama, Mistral, Qwen2, Qwen3, Qwen3.5), choosing the class from typed features (keymap's
`hf_architecture`). Features logitlab cannot run exactly are refused by name. With keymap.py and
families.py it is the only place that names model families. It never touches the disk.
"""

from __future__ import annotations

import math

from logitlab.model.config import ModelConfig, conform
from logitlab.model.keymap import hf_architecture

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
_LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# Qwen3.5: the causal LM, and the image-text checkpoints whose text_config and
# model.language_model.* tensors are that same causal LM (the vision tower is not loaded)
_QWEN3_5 = {"Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5ForConditionalGeneration": "qwen3_5"}
SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel", *_LLAMA_LIKE, *_QWEN3_5)


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        by_type = {"gpt2": "GPT2LMHeadModel", **{v: k for k, v in {**_LLAMA_LIKE, **_QWEN3_5}.items()}}
        if hf.get("model_type") in by_type:
            return by_type[hf["model_type"]]
        raise ValueError(f"config.json names no architecture (architectures={archs!r}, "
                         f"model_type={hf.get('model_type')!r}); supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _need(hf: dict, key: str, source: str = "config.json"):
    if key not in hf or hf[key] is None:
        raise ValueError(f"{source} lacks required field {key!r}")
    return hf[key]


def _refuse(arch: str, feature: str, value) -> None:
    raise ValueError(f"{arch}: unsupported feature {feature}={value!r} (logitlab has no switch that "
                     "runs it exactly)")


# The JSON type of every key config_from_hf reads; null means absent (the default applies).
_HF_TYPES = {
    "architectures": list[str], "model_type": str, "vocab_size": int, "tie_word_embeddings": bool,
    "eos_token_id": int | list[int], "bos_token_id": int | list[int],
    "n_positions": int, "n_embd": int, "n_layer": int, "n_head": int, "n_inner": int,
    "layer_norm_epsilon": float, "activation_function": str, "scale_attn_weights": bool,
    "scale_attn_by_inverse_layer_idx": bool, "add_cross_attention": bool,
    "max_position_embeddings": int, "hidden_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int, "intermediate_size": int,
    "rms_norm_eps": float, "hidden_act": str, "rope_theta": float, "rope_scaling": dict,
    "rope_parameters": dict, "attention_bias": bool, "mlp_bias": bool, "sliding_window": int,
    "use_sliding_window": bool, "layer_types": list[str], "max_window_layers": int,
    "linear_conv_kernel_dim": int, "linear_key_head_dim": int, "linear_value_head_dim": int,
    "linear_num_key_heads": int, "linear_num_value_heads": int, "full_attention_interval": int,
    "attn_output_gate": bool, "partial_rotary_factor": float, "text_config": dict,
}
# ... and of the rope_scaling / rope_parameters entries it reads
_ROPE_TYPES = {"rope_type": str, "type": str, "rope_theta": float, "factor": float, "low_freq_factor": float,
               "high_freq_factor": float, "original_max_position_embeddings": int,
               "partial_rotary_factor": float, "beta_fast": float, "beta_slow": float, "mscale": float,
               "mscale_all_dim": float, "attention_factor": float, "truncate": bool,
               "short_factor": list[float], "long_factor": list[float]}
# Hugging Face rope_type -> the keys each reads besides factor and the original length; the key
# names are logitlab's RopeScaling fields too ("ntk" has no Hugging Face rope_type: it is written as
# a plain RoPE of the equivalent base)
_ROPE_KEYS = {"linear": (), "dynamic": (), "llama3": ("low_freq_factor", "high_freq_factor"),
              "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
              "longrope": ("short_factor", "long_factor", "attention_factor")}

def _checked_hf(hf, source: str) -> dict:
    """`hf` with every key config_from_hf reads type-checked (_HF_TYPES, _ROPE_TYPES; a mismatch
    is a ValueError naming the key and `source`) and null-valued keys dropped."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: expected a JSON object at the top level, got a {type(hf).__name__}")
    out = {key: value for key, value in hf.items() if value is not None}
    for key, value in out.items():
        if key in _HF_TYPES:
            conform(value, _HF_TYPES[key], f"{key!r} in {source}")
    for where in ("rope_scaling", "rope_parameters"):
        for key, value in out.get(where, {}).items():
            if key in _ROPE_TYPES and value is not None:
                conform(value, _ROPE_TYPES[key], f"'{where}.{key}' in {source}")
    return out


def _rope_from_hf(arch: str, hf: dict, source: str) -> tuple[float, dict | None]:
    """rope_theta and the RoPE scaling (as RopeScaling fields) from either the classic keys
    (rope_theta, rope_scaling) or the newer nested `rope_parameters`, for every rope_type of
    _ROPE_KEYS. As transformers does: a missing `factor` of yarn / longrope is max_position_embeddings
    over the original length; the original length of llama3 / yarn / longrope defaults to a top-level
    original_max_position_embeddings, else max_position_embeddings; dynamic's original length is
    max_position_embeddings itself (see _rope_context)."""
    params = hf.get("rope_parameters") or {}
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return theta, None
    if kind not in _ROPE_KEYS:
        _refuse(arch, f"{where}.rope_type", kind)
    context = hf.get("max_position_embeddings")
    original = scaling.get("original_max_position_embeddings")
    if kind in ("llama3", "yarn", "longrope"):
        original = hf.get("original_max_position_embeddings") or original or context
    elif kind == "dynamic":
        original = context
    factor = scaling.get("factor")
    if factor is None and kind in ("yarn", "longrope") and context and original:
        factor = context / original
    needed = {"factor": factor, "original_max_position_embeddings": original if kind != "linear" else 0,
              **({k: scaling.get(k) for k in _ROPE_KEYS[kind]} if kind in ("llama3", "longrope") else {})}
    missing = [key for key, value in needed.items() if value is None and key != "attention_factor"]
    if missing:
        raise ValueError(f"{source}: {where} of rope_type {kind!r} lacks {', '.join(missing)}")
    fields = {key: scaling[key] for key in _ROPE_KEYS[kind] if scaling.get(key) is not None}
    if kind == "longrope":                                         # resolved now: it depends on the lengths
        fields["attention_factor"] = scaling.get("attention_factor") or _longrope_attention(factor, original)
    return theta, dict(rope_type=kind, factor=float(factor), **fields,
                       **({"original_context_length": original} if kind != "linear" else {}))


def _longrope_attention(factor: float, original: int) -> float:
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _rope_context(context: int, scaling: dict | None) -> int:
    """The context logitlab accepts: max_position_embeddings, except under dynamic NTK, whose
    frequencies change only past max_position_embeddings (the original length in transformers):
    there it is original x factor, the length the scaling is meant to reach."""
    if scaling is None or scaling["rope_type"] != "dynamic":
        return context
    return max(context, math.ceil(context * scaling["factor"]))


def _rope_to_hf(c: ModelConfig) -> dict:
    """rope_theta, rope_scaling and, for dynamic NTK, max_position_embeddings (its original length)
    of config.json. Static NTK ("ntk") is written as the plain RoPE of its enlarged base, which
    computes the same frequencies."""
    if c.rope_interleaved:
        raise ValueError("rope_interleaved=True (RoFormer / Meta layout) cannot be written as a Hugging Face "
                         "checkpoint as is; convert it with logitlab.model.positions.convert_rope_layout first")
    r = c.rope_scaling
    if r is None:
        return dict(rope_theta=c.rope_theta, rope_scaling=None)
    if r.rope_type == "ntk":
        from logitlab.model.rope_scaling import ntk_theta  # (rope_scaling imports torch)

        return dict(rope_theta=ntk_theta(c.rotary_dim, c.rope_theta, r.factor), rope_scaling=None)
    out = dict(rope_type=r.rope_type, factor=r.factor)
    out.update({key: getattr(r, key) for key in _ROPE_KEYS[r.rope_type] if getattr(r, key) is not None})
    for key in ("short_factor", "long_factor"):
        if key in out:
            out[key] = list(out[key])
    extra = {}
    if r.rope_type == "dynamic":
        extra["max_position_embeddings"] = r.original_context_length
    elif r.rope_type != "linear":
        out["original_max_position_embeddings"] = r.original_context_length
    return dict(rope_theta=c.rope_theta, rope_scaling=out, **extra)


def _build(source: str, **fields) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (GPT2LMHeadModel, LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM). Features logitlab cannot run
    exactly (RoPE scalings outside _ROPE_KEYS, other activations) are refused by name; a key
    of the wrong JSON type (a string for an integer, say) is a ValueError naming it and `source`
    (the file the dict came from), and so is a config that is not a JSON object."""
    hf = _checked_hf(hf, source)
    arch = _architecture(hf)
    if arch in _QWEN3_5:
        return _qwen3_5_from_hf(arch, hf, source)
    if arch != "GPT2LMHeadModel":
        return _llama_from_hf(arch, hf, source)
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU:
        _refuse(arch, "activation_function", act)
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if hf.get(key, ok) != ok:
            _refuse(arch, key, hf[key])
    return _build(
        source, vocab_size=_need(hf, "vocab_size", source), context_length=_need(hf, "n_positions", source),
        d_model=_need(hf, "n_embd", source), n_layers=_need(hf, "n_layer", source),
        n_heads=_need(hf, "n_head", source), d_ff=hf.get("n_inner") or 4 * hf["n_embd"], norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp="gelu", gelu_approximate=_GELU[act],
        positions="learned", bias=True, qkv_bias=True, tie_embeddings=hf.get("tie_word_embeddings", True))


def _llama_from_hf(arch: str, hf: dict, source: str) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(arch, "hidden_act", hf["hidden_act"])
    context = _need(hf, "max_position_embeddings", source)
    layer_types, window = _windows_from_hf(arch, hf, context)
    family = _LLAMA_LIKE[arch]
    attention_bias = hf.get("attention_bias", False)
    mlp_bias = hf.get("mlp_bias", False)
    if family == "qwen2":  # q, k, v always carry biases; o and the MLP never do
        bias, qkv_bias = False, True
    elif family == "llama" and attention_bias == mlp_bias:  # attention_bias covers q, k, v and o
        bias = qkv_bias = attention_bias
    elif attention_bias or mlp_bias:  # an o_proj bias without MLP biases has no logitlab switch
        _refuse(arch, "attention_bias/mlp_bias", (attention_bias, mlp_bias))
    else:
        bias = qkv_bias = False
    theta, scaling = _rope_from_hf(arch, hf, source)
    context = _rope_context(context, scaling)
    d_model, n_heads = _need(hf, "hidden_size", source), _need(hf, "num_attention_heads", source)
    return _build(
        source, vocab_size=_need(hf, "vocab_size", source), context_length=context, d_model=d_model,
        n_layers=_need(hf, "num_hidden_layers", source), n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or (d_model // n_heads if n_heads > 0 else None),
        d_ff=_need(hf, "intermediate_size", source),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", positions="rope",
        rope_theta=theta, rope_scaling=scaling, qk_norm=family == "qwen3", bias=bias, qkv_bias=qkv_bias,
        tie_embeddings=hf.get("tie_word_embeddings", False), layer_types=layer_types, sliding_window=window)


def _windows_from_hf(arch: str, hf: dict, context: int, n_layers: int | None = None):
    """(layer_types or None, sliding_window or None). Mistral windows every layer when
    sliding_window < the context; Qwen2/Qwen3 window the layers listed as sliding_attention (or
    those from max_window_layers on) when use_sliding_window is true."""
    n = n_layers or hf.get("num_hidden_layers") or 0
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        if window is None or window >= context:
            return None, None
        return ("sliding_attention",) * n, window
    if not hf.get("use_sliding_window", False) or window is None:
        return None, None
    start = hf.get("max_window_layers", n)
    types = tuple(hf.get("layer_types") or ["sliding_attention" if i >= start else "full_attention"
                                            for i in range(n)])
    if not set(types) <= {"full_attention", "sliding_attention"}:
        _refuse(arch, "layer_types", sorted(set(types)))
    return (types, window) if "sliding_attention" in types else (types, None)


def _qwen3_5_from_hf(arch: str, hf: dict, source: str) -> ModelConfig:
    """Qwen3.5's text model: the config itself, or the text_config of an image-text checkpoint."""
    if arch == "Qwen3_5ForConditionalGeneration":
        hf = _checked_hf(_need(hf, "text_config", source), f"text_config in {source}")
    return _build(source, **qwen3_5_fields(arch, hf, source))


def qwen3_5_fields(arch: str, hf: dict, source: str, width_key: str = "intermediate_size") -> dict:
    """The ModelConfig fields of a Qwen3.5 text config (dense, or the MoE's with its expert
    fields added by hf_config_moe); d_ff is the key `width_key` (the MoE's: moe_intermediate_size)."""
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(arch, "hidden_act", hf["hidden_act"])
    for key in ("attention_bias",):
        if hf.get(key, False):
            _refuse(arch, key, hf[key])
    if not hf.get("attn_output_gate", True):
        _refuse(arch, "attn_output_gate", False)
    params = hf.get("rope_parameters") or {}
    theta, scaling = _rope_from_hf(arch, hf, source)      # any rope_type, as for Llama and Qwen3
    n = _need(hf, "num_hidden_layers", source)
    every = hf.get("full_attention_interval", 4)
    types = tuple(hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                            for i in range(n)])
    return dict(
        vocab_size=_need(hf, "vocab_size", source),
        context_length=_rope_context(_need(hf, "max_position_embeddings", source), scaling), rope_scaling=scaling,
        d_model=_need(hf, "hidden_size", source), n_layers=n, n_heads=_need(hf, "num_attention_heads", source),
        n_kv_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim", 256),
        d_ff=_need(hf, width_key, source), norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu", positions="rope", rope_theta=theta,
        partial_rotary_factor=params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)),
        qk_norm=True, norm_zero_centered=True, attn_gate="elementwise", bias=False, qkv_bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", False), layer_types=types,
        linear_n_k_heads=hf.get("linear_num_key_heads", 16), linear_n_v_heads=hf.get("linear_num_value_heads", 32),
        linear_k_head_dim=hf.get("linear_key_head_dim", 128), linear_v_head_dim=hf.get("linear_value_head_dim", 128),
        linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4))


def _qwen3_5_rope(c: ModelConfig) -> dict:
    """Qwen3.5's nested rope_parameters, plus max_position_embeddings under dynamic NTK: the theta,
    the partial rotary factor and the scaling's own keys (as _rope_to_hf writes them) in one dict."""
    rope = _rope_to_hf(c)
    params = {"rope_type": "default", **(rope["rope_scaling"] or {}), "rope_theta": rope["rope_theta"],
              "partial_rotary_factor": c.partial_rotary_factor}
    return {"rope_parameters": params, **({"max_position_embeddings": rope["max_position_embeddings"]}
                                          if "max_position_embeddings" in rope else {})}


def _qwen3_5_to_hf(c: ModelConfig, dtype: str) -> dict:
    return dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=c.vocab_size,
                max_position_embeddings=c.context_length, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
                intermediate_size=c.d_ff, hidden_act="silu", rms_norm_eps=c.norm_eps,
                tie_word_embeddings=c.tie_embeddings, attention_bias=False, attention_dropout=0.0,
                layer_types=list(c.layer_kinds), linear_conv_kernel_dim=c.linear_conv_kernel,
                linear_key_head_dim=c.linear_k_head_dim, linear_value_head_dim=c.linear_v_head_dim,
                linear_num_key_heads=c.linear_n_k_heads, linear_num_value_heads=c.linear_n_v_heads,
                initializer_range=c.init_std, torch_dtype=dtype, **_qwen3_5_rope(c))


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict:
    """A Hugging Face config.json dict for `config` (classic rope_theta / rope_scaling keys, which
    both old and new transformers read). The vocabulary is written unpadded (vocab_size rows)."""
    c = config
    if c.attention != "causal":          # every class written here masks causally: refuse, not a silent decoder
        raise ValueError(f"attention={c.attention!r} cannot be exported as a Hugging Face checkpoint: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} are all causal (decoder-only) models")
    arch = hf_architecture(c)
    if arch == "Qwen3_5ForCausalLM":
        return _qwen3_5_to_hf(c, dtype)
    if arch == "GPT2LMHeadModel":
        act = "gelu_new" if c.gelu_approximate == "tanh" else "gelu"
        return dict(architectures=[arch], model_type="gpt2", vocab_size=c.vocab_size,
                    n_positions=c.context_length, n_ctx=c.context_length, n_embd=c.d_model,
                    n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff, activation_function=act,
                    layer_norm_epsilon=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=c.init_std,
                    torch_dtype=dtype)
    model_type = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
                  "MistralForCausalLM": "mistral"}.get(arch, "llama")
    out = dict(architectures=[arch], model_type=model_type, vocab_size=c.vocab_size,
               max_position_embeddings=c.context_length, hidden_size=c.d_model,
               num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
               num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.d_ff,
               hidden_act="silu", rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
               attention_dropout=0.0, initializer_range=c.init_std, torch_dtype=dtype)
    out.update(_rope_to_hf(c))
    windowed = c.sliding_window is not None
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=c.bias, mlp_bias=c.bias)
    elif arch == "MistralForCausalLM":
        out.update(sliding_window=c.sliding_window)
    else:
        out.update(use_sliding_window=windowed, sliding_window=c.sliding_window,
                   layer_types=list(c.layer_kinds), max_window_layers=c.n_layers)
        if arch == "Qwen3ForCausalLM":
            out.update(attention_bias=False)
    return out
