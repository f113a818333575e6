"""Model families: named presets, Hugging Face config.json <-> ModelConfig, and state-dict key maps.

families.py is the only module that knows family names (GPT-2, Llama, Mistral, Qwen). Everything
else branches on the typed features of ModelConfig. It owns:

- PRESETS / get_preset(name): the published shapes of GPT-2, Llama 3 and Qwen3 checkpoints, plus
  small shapes meant for CPU training;
- config_from_hf(dict) / config_to_hf(ModelConfig): Hugging Face config.json <-> ModelConfig;
  the Hugging Face architecture is chosen from typed features (see `hf_architecture`);
- state_dict_from_hf / state_dict_to_hf: pure functions between Hugging Face tensor names and
  logitlab's (model.py documents ours); hf_tensors_to_logitlab converts one tensor at a time for
  streaming loaders. Two layouts exist: "gpt2" (Conv1D weights stored (in, out), q, k, v fused in
  one c_attn, as logitlab's qkv_proj) and "llama" (nn.Linear weights, shared by Llama, Mistral,
  Qwen2, Qwen3; separate q/k/v and gate/up, joined into logitlab's fused projections).

File reading/writing lives in hf.py; this module never touches the disk.
"""

from __future__ import annotations

import re

from logitlab.model import ModelConfig, RopeScaling, conform

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


def get_preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


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


def hf_architecture(config: ModelConfig) -> str:
    """The Hugging Face class that runs `config` exactly, chosen from typed features:
    learned positions + LayerNorm + GELU -> GPT2LMHeadModel; QK-norm -> Qwen3ForCausalLM; biases on
    q/k/v only -> Qwen2ForCausalLM; otherwise LlamaForCausalLM. A config no class can run exactly
    raises ValueError naming the field."""
    c = config

    def bad(field: str, value, arch: str) -> None:
        raise ValueError(f"{field}={value!r} cannot be expressed as a Hugging Face {arch} checkpoint")

    if c.norm_placement != "pre":
        bad("norm_placement", c.norm_placement, "model")
    if c.positions == "learned" and c.norm == "layernorm" and c.mlp == "gelu":
        arch = "GPT2LMHeadModel"
        if not (c.bias and c.qkv_bias):
            bad("bias", (c.bias, c.qkv_bias), arch)
        if c.qk_norm or c.n_kv_heads != c.n_heads or c.head_dim * c.n_heads != c.d_model:
            bad("qk_norm/n_kv_heads/head_dim", (c.qk_norm, c.n_kv_heads, c.head_dim), arch)
        return arch
    if c.positions != "rope" or c.norm != "rmsnorm" or c.mlp != "swiglu":
        bad("positions/norm/mlp", (c.positions, c.norm, c.mlp), "GPT-2 or Llama-style")
    if c.qk_norm:
        if c.bias or c.qkv_bias:
            bad("bias/qkv_bias", (c.bias, c.qkv_bias), "Qwen3ForCausalLM")
        return "Qwen3ForCausalLM"
    if c.qkv_bias and not c.bias:
        return "Qwen2ForCausalLM"
    if c.bias != c.qkv_bias:
        bad("bias/qkv_bias", (c.bias, c.qkv_bias), "LlamaForCausalLM")
    return "LlamaForCausalLM"


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


# --------------------------------------------------------------------------------------------
# State-dict key maps (pure functions over {name: tensor})
# --------------------------------------------------------------------------------------------

# Keys of buffers that old checkpoints carry and that hold no learned state.
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")

_LLAMA_BLOCK = {  # Hugging Face suffix under model.layers.{i}. -> logitlab suffix under blocks.{i}.
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
    **{f"self_attn.{p}": f"attn.{p}" for p in ("o_proj", "q_norm", "k_norm")},
    "mlp.down_proj": "mlp.down_proj",
}
# logitlab's fused projections and the Hugging Face (llama-layout) tensors they hold, in row order.
_LLAMA_FUSED = {"attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_LLAMA_PART = {part: (fused, j, len(parts)) for fused, parts in _LLAMA_FUSED.items() for j, part in enumerate(parts)}
_LLAMA_TOP = {"model.embed_tokens": "tok_emb", "model.norm": "final_norm", "lm_head": "lm_head"}
_GPT2_TOP = {"transformer.wte": "tok_emb", "transformer.wpe": "pos_emb", "transformer.ln_f": "final_norm",
             "lm_head": "lm_head"}
_GPT2_BLOCK = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_attn": "attn.qkv_proj",
               "attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_GPT2_CONV1D = ("c_attn", "c_proj", "c_fc")  # Conv1D weights are stored (in, out): transposed here


def key_layout(config: ModelConfig) -> str:
    """"gpt2" or "llama": which Hugging Face naming scheme `config` uses."""
    return "gpt2" if hf_architecture(config) == "GPT2LMHeadModel" else "llama"


def _split_key(key: str) -> tuple[str, str]:
    module, _, leaf = key.rpartition(".")
    return module, leaf


def hf_key_to_logitlab(key: str, layout: str) -> str | None:
    """Name of one Hugging Face tensor in logitlab; None for a llama-layout q/k/v or gate/up
    tensor, which is one block of rows of a fused logitlab projection (see hf_tensors_to_logitlab).
    Unknown names raise ValueError naming the key."""
    module, leaf = _split_key(key)
    top, block_prefix, block = ((_GPT2_TOP, "transformer.h.", _GPT2_BLOCK) if layout == "gpt2"
                                else (_LLAMA_TOP, "model.layers.", _LLAMA_BLOCK))
    if module in top:
        return f"{top[module]}.{leaf}"
    m = re.fullmatch(re.escape(block_prefix) + r"(\d+)\.(.+)", module)
    if m and m.group(2) in block:
        return f"blocks.{m.group(1)}.{block[m.group(2)]}.{leaf}"
    if m and layout == "llama" and m.group(2) in _LLAMA_PART:
        return None
    raise ValueError(f"unexpected tensor {key!r} in a {layout}-layout checkpoint")


def _normalise_prefix(state: dict, layout: str) -> dict:
    """Base-model checkpoints (GPT2Model, LlamaModel) omit the "transformer." / "model." prefix."""
    prefix = "transformer." if layout == "gpt2" else "model."
    if any(k.startswith(prefix) for k in state):
        return state
    return {(k if k.startswith("lm_head.") else prefix + k): v for k, v in state.items()}


def clean_hf_state(hf_state: dict, config: ModelConfig) -> dict:
    """The learned tensors of a Hugging Face checkpoint under their full names: buffers with no
    learned state dropped, a missing "transformer." / "model." prefix restored, and a tied
    lm_head (which some checkpoints store as a copy of the embedding) dropped."""
    layout = key_layout(config)
    state = _normalise_prefix({k: v for k, v in hf_state.items() if not _IGNORED.search(k)}, layout)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def hf_tensors_to_logitlab(items, config: ModelConfig):
    """(Hugging Face name, tensor) pairs, already cleaned (clean_hf_state), -> (logitlab name,
    tensor) pairs, one at a time, so a loader can read, convert and drop each tensor in turn.

    GPT-2 Conv1D weights are transposed (c_attn is qkv_proj's rows as they stand); llama-layout
    q/k/v and gate/up are held until their last part arrives and then joined into the fused
    projection (row order q, k, v and gate, up). A fused projection with a part missing at the
    end raises ValueError naming it."""
    import torch

    layout = key_layout(config)
    pending: dict[str, dict[int, object]] = {}  # fused logitlab name -> {part index: tensor}
    for key, tensor in items:
        module, leaf = _split_key(key)
        name = hf_key_to_logitlab(key, layout)
        if name is None:  # llama layout: one part of qkv_proj or gate_up_proj
            i, sub = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module).groups()
            fused, j, n = _LLAMA_PART[sub]
            name = f"blocks.{i}.{fused}.{leaf}"
            parts = pending.setdefault(name, {})
            parts[j] = tensor
            if len(parts) == n:
                del pending[name]
                yield name, torch.cat([parts.pop(k) for k in range(n)], dim=0)
            continue
        conv1d = layout == "gpt2" and leaf == "weight" and module.rsplit(".", 1)[-1] in _GPT2_CONV1D
        yield name, (tensor.t().contiguous() if conv1d else tensor)
    if pending:
        name = sorted(pending)[0]                       # blocks.{i}.{fused}.{leaf}
        _, i, rest = name.split(".", 2)
        fused, leaf = rest.rsplit(".", 1)
        lacking = [f"model.layers.{i}.{part}.{leaf}" for j, part in enumerate(_LLAMA_FUSED[fused])
                   if j not in pending[name]]
        raise ValueError(f"checkpoint lacks {', '.join(map(repr, lacking))}, needed with the rest of "
                         f"{name!r}")


def state_dict_from_hf(hf_state: dict, config: ModelConfig) -> dict:
    """Hugging Face tensors -> logitlab state dict (GPT-2 Conv1D weights transposed, q/k/v and
    gate/up joined into the fused projections); see clean_hf_state for what is dropped."""
    return dict(hf_tensors_to_logitlab(clean_hf_state(hf_state, config).items(), config))


def state_dict_to_hf(state: dict, config: ModelConfig) -> dict:
    """logitlab state dict -> Hugging Face tensors; inverse of state_dict_from_hf. The vocabulary
    padding rows are cut off; a tied head is written once, as the embedding (lm_head omitted);
    the fused projections are split into llama-layout q/k/v and gate/up."""
    layout = key_layout(config)
    V, Dh = config.vocab_size, config.head_dim
    fused_rows = {"attn.qkv_proj": (config.n_heads * Dh, config.n_kv_heads * Dh, config.n_kv_heads * Dh),
                  "mlp.gate_up_proj": (config.d_ff, config.d_ff)}
    inverse_top = {v: k for k, v in (_GPT2_TOP if layout == "gpt2" else _LLAMA_TOP).items()}
    inverse_block = {v: k for k, v in (_GPT2_BLOCK if layout == "gpt2" else _LLAMA_BLOCK).items()}
    block_prefix = "transformer.h." if layout == "gpt2" else "model.layers."
    out = {}
    for key, tensor in state.items():
        if key == "lm_head.weight" and config.tie_embeddings:
            continue
        module, leaf = _split_key(key)
        if module in ("tok_emb", "lm_head"):
            tensor = tensor[:V]
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
        if m is None:
            out[f"{inverse_top[module]}.{leaf}"] = tensor.contiguous()
            continue
        i, sub = m.groups()
        if layout == "llama" and sub in _LLAMA_FUSED:
            for part, rows in zip(_LLAMA_FUSED[sub], tensor.split(fused_rows[sub], dim=0), strict=True):
                out[f"{block_prefix}{i}.{part}.{leaf}"] = rows.contiguous()
            continue
        if sub not in inverse_block:
            raise ValueError(f"logitlab tensor {key!r} has no Hugging Face {layout}-layout name")
        hf_module = inverse_block[sub]
        if layout == "gpt2" and leaf == "weight" and hf_module.rsplit(".", 1)[-1] in _GPT2_CONV1D:
            tensor = tensor.t()
        out[f"{block_prefix}{i}.{hf_module}.{leaf}"] = tensor.contiguous()
    return out
