"""Model families: named presets and Hugging Face config.json <-> ModelConfig.

families.py is the only module that knows family names (GPT-2, Llama, Mistral, Qwen). Everything
else branches on the typed features of ModelConfig. It owns:

- PRESETS / get_preset(name): the published shapes of GPT-2, Llama 3 and Qwen3 checkpoints, plus
  small shapes meant for CPU training;
- config_from_hf(dict) / config_to_hf(ModelConfig): Hugging Face config.json <-> ModelConfig;
  the Hugging Face architecture is chosen from typed features (see `hf_architecture`);
- the state-dict key maps (key_layout, hf_key_to_logitlab, clean_hf_state, hf_tensors_to_logitlab,
  state_dict_from_hf / state_dict_to_hf) live in keymap.py and are importable from here too.

File reading/writing lives in logitlab.io.hf; this module never touches the disk.
"""

from __future__ import annotations

from logitlab.model.config import ModelConfig, RopeScaling, conform
from logitlab.model.keymap import (  # noqa: F401  (the key maps, importable from here as before)
    clean_hf_state,
    hf_architecture,
    hf_key_to_logitlab,
    hf_tensors_to_logitlab,
    key_layout,
    state_dict_from_hf,
    state_dict_to_hf,
)

# --------------------------------------------------------------------------------------------
# Presets (published hyper-parameters; vocabulary never padded so shapes match the checkpoints)
# --------------------------------------------------------------------------------------------


def _gpt2(d_model: int, n_layers: int, n_heads: int, **kw) -> ModelConfig:
    base = dict(vocab_size=50257, context_length=1024, d_model=d_model, n_layers=n_layers,
                n_heads=n_heads, norm="layernorm", norm_eps=1e-5, mlp="gelu", gelu_approximate="tanh",
                positions="learned", bias=True, tie_embeddings=True)
    return ModelConfig(**{**base, **kw})


def _llama(**kw) -> ModelConfig:
    base = dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, qkv_bias=False,
                tie_embeddings=False)
    return ModelConfig(**{**base, **kw})


_LLAMA3 = dict(vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0)
_QWEN3 = dict(vocab_size=151936, context_length=40960, head_dim=128, norm_eps=1e-6,
              rope_theta=1000000.0, qk_norm=True)

PRESETS: dict[str, ModelConfig] = {
    # GPT-2 (Radford et al. 2019), Hugging Face "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    # Meta-Llama-3-8B / 70B (8K context, no RoPE scaling; Llama 3.1 adds it)
    "llama3-8b": _llama(**_LLAMA3, context_length=8192, d_model=4096, n_layers=32, n_heads=32,
                        n_kv_heads=8, d_ff=14336),
    "llama3-70b": _llama(**_LLAMA3, context_length=8192, d_model=8192, n_layers=80, n_heads=64,
                         n_kv_heads=8, d_ff=28672),
    # Llama-3.2-1B: tied head, Llama-3.1 RoPE scaling to 128K context
    "llama3.2-1b": _llama(**_LLAMA3, context_length=131072, d_model=2048, n_layers=16, n_heads=32,
                          n_kv_heads=8, d_ff=8192, tie_embeddings=True,
                          rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_context_length=8192)),
    # Qwen3: head_dim 128 decoupled from D / H, per-head RMSNorm on q and k
    "qwen3-0.6b": _llama(**_QWEN3, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, d_ff=3072,
                         tie_embeddings=True),
    "qwen3-8b": _llama(**_QWEN3, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, d_ff=12288),
    # Small shapes for CPU training (vocabulary padded to 64 for speed)
    "gpt2-tiny": _gpt2(128, 4, 4, context_length=256, vocab_pad_multiple=64),
    "tiny": _llama(vocab_size=8192, context_length=256, d_model=128, n_layers=4, n_heads=4,
                   n_kv_heads=2, d_ff=384, tie_embeddings=True, vocab_pad_multiple=64),
    "small": _llama(vocab_size=8192, context_length=512, d_model=384, n_layers=6, n_heads=6,
                    n_kv_heads=2, d_ff=1024, tie_embeddings=True, vocab_pad_multiple=64),
}
PRESETS["llama-tiny"] = PRESETS["tiny"]


def get_preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a named preset, with any fields replaced: get_preset("tiny",
    vocab_size=tok.vocab_size). Fields the preset derived (head_dim = D / H, d_ff, n_kv_heads,
    qkv_bias) are derived again from the new values unless given. An unknown name lists the
    known ones; an unknown field is named."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
    if not overrides:
        return config
    fields = underived_fields(config)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown} for get_preset({name!r})")
    return ModelConfig(**{**fields, **overrides})


def underived_fields(config: ModelConfig) -> dict:
    """config as a dict with the fields ModelConfig derived (head_dim = D / H, ...) set back to
    None, so that new values of d_model or n_heads derive them again."""
    d = config.to_dict()
    for name in ("n_kv_heads", "head_dim", "d_ff", "qkv_bias"):
        if getattr(ModelConfig(**{**d, name: None}), name) == d[name]:
            d[name] = None
    return d


# --------------------------------------------------------------------------------------------
# Hugging Face config.json <-> ModelConfig
# --------------------------------------------------------------------------------------------

_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
_LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel", *_LLAMA_LIKE)


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        by_type = {"gpt2": "GPT2LMHeadModel", **{v: k for k, v in _LLAMA_LIKE.items()}}
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
    raise ValueError(f"{arch}: unsupported feature {feature}={value!r} (logitlab implements full "
                     "causal attention only)")


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
    "use_sliding_window": bool, "layer_types": list[str],
}
# ... and of the rope_scaling / rope_parameters entries it reads
_ROPE_TYPES = {"rope_type": str, "type": str, "rope_theta": float, "factor": float, "low_freq_factor": float,
               "high_freq_factor": float, "original_max_position_embeddings": int}
_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    """rope_theta and Llama-3.1 scaling (as RopeScaling fields) from either the classic keys
    (rope_theta, rope_scaling) or the newer nested `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        _refuse(arch, "rope_scaling.rope_type", kind)
    missing = [key for key in _LLAMA3_ROPE if scaling.get(key) is None]
    if missing:
        raise ValueError(f"{source}: {where} of rope_type 'llama3' lacks {', '.join(missing)}")
    return theta, dict(factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                       high_freq_factor=scaling["high_freq_factor"],
                       original_context_length=scaling["original_max_position_embeddings"])


def _build(source: str, **fields) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (GPT2LMHeadModel, LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM). Features logitlab cannot run
    exactly (sliding windows, other RoPE scalings, other activations) are refused by name; a key
    of the wrong JSON type (a string for an integer, say) is a ValueError naming it and `source`
    (the file the dict came from), and so is a config that is not a JSON object."""
    hf = _checked_hf(hf, source)
    arch = _architecture(hf)
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
    window = hf.get("sliding_window")
    windowed = hf.get("use_sliding_window", arch == "MistralForCausalLM")  # Mistral has no switch
    if window is not None and windowed and window < context:
        _refuse(arch, "sliding_window", window)
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"} and hf.get("use_sliding_window", False):
        _refuse(arch, "layer_types", sorted(layer_types))
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
    d_model, n_heads = _need(hf, "hidden_size", source), _need(hf, "num_attention_heads", source)
    return _build(
        source, vocab_size=_need(hf, "vocab_size", source), context_length=context, d_model=d_model,
        n_layers=_need(hf, "num_hidden_layers", source), n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or (d_model // n_heads if n_heads > 0 else None),
        d_ff=_need(hf, "intermediate_size", source),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", positions="rope",
        rope_theta=theta, rope_scaling=scaling, qk_norm=family == "qwen3", bias=bias, qkv_bias=qkv_bias,
        tie_embeddings=hf.get("tie_word_embeddings", False))


def config_to_hf(config: ModelConfig, dtype: str = "float32") -> dict:
    """A Hugging Face config.json dict for `config` (classic rope_theta / rope_scaling keys, which
    both old and new transformers read). The vocabulary is written unpadded (vocab_size rows)."""
    c = config
    arch = hf_architecture(c)
    if arch == "GPT2LMHeadModel":
        act = "gelu_new" if c.gelu_approximate == "tanh" else "gelu"
        return dict(architectures=[arch], model_type="gpt2", vocab_size=c.vocab_size,
                    n_positions=c.context_length, n_ctx=c.context_length, n_embd=c.d_model,
                    n_layer=c.n_layers, n_head=c.n_heads, n_inner=c.d_ff, activation_function=act,
                    layer_norm_epsilon=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=c.init_std,
                    torch_dtype=dtype)
    model_type = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2"}.get(arch, "llama")
    out = dict(architectures=[arch], model_type=model_type, vocab_size=c.vocab_size,
               max_position_embeddings=c.context_length, hidden_size=c.d_model,
               num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
               num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.d_ff,
               hidden_act="silu", rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
               rope_scaling=None, tie_word_embeddings=c.tie_embeddings, attention_dropout=0.0,
               initializer_range=c.init_std, torch_dtype=dtype)
    if c.rope_scaling is not None:
        r = c.rope_scaling
        out["rope_scaling"] = dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                                   high_freq_factor=r.high_freq_factor,
                                   original_max_position_embeddings=r.original_context_length)
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=c.bias, mlp_bias=c.bias)
    elif arch == "Qwen3ForCausalLM":
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out
