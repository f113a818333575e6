"""Model families: named presets and Hugging Face config.json <-> ModelConfig.

families.py is the only module that knows family names (GPT-2, Llama, Mistral, Qwen, Mixtral,
gpt-oss, DeepSeek) besides hf_config*.py and keymap*.py. Everything
else branches on the typed features of ModelConfig. It owns:

- PRESETS / get_preset(name): the published shapes of GPT-2, Llama 3, Qwen3 and Qwen3.5 checkpoints
  and of the mixtures of experts Mixtral, Qwen3-MoE, Qwen3.5-MoE, gpt-oss and DeepSeek-V3 (with
  multi-head latent attention), plus small shapes
  meant for CPU training (moe-tiny: a mixture of experts);
- config_from_hf(dict) / config_to_hf(ModelConfig): Hugging Face config.json <-> ModelConfig,
  in hf_config.py (dense families) and hf_config_moe.py (the MoE families, and the entry points
  for all), importable from here; the Hugging Face architecture is chosen from typed
  features (see `hf_architecture`);
- the state-dict key maps (key_layout, hf_key_to_logitlab, clean_hf_state, hf_tensors_to_logitlab,
  state_dict_from_hf / state_dict_to_hf) live in keymap.py and are importable from here too.

File reading/writing lives in logitlab.io.hf; this module never touches the disk.
"""

from __future__ import annotations

from logitlab.model.config import ModelConfig, RopeScaling
from logitlab.model.hf_config_moe import (  # noqa: F401  (importable from here as before; every family)
    SUPPORTED_ARCHITECTURES,
    config_from_hf,
    config_to_hf,
)
from logitlab.model.keymap import (  # noqa: F401  (the key maps, importable from here as before)
    clean_hf_state,
    expert_layout_of,
    features_without_hf_class,
    hf_architecture,
    hf_key_to_logitlab,
    hf_tensors_to_logitlab,
    key_layout,
    listed,
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


def _qwen3_5(n_layers: int, **kw) -> ModelConfig:
    base = dict(vocab_size=248320, context_length=262144, head_dim=256, norm_eps=1e-6, rope_theta=1e7,
                partial_rotary_factor=0.25, qk_norm=True, norm_zero_centered=True, attn_gate="elementwise",
                layer_types=("linear_attention",) * 3 + ("full_attention",), linear_n_k_heads=16,
                linear_k_head_dim=128, linear_v_head_dim=128, linear_conv_kernel=4)
    base["layer_types"] = base["layer_types"] * (n_layers // 4)
    return _llama(**{**base, "n_layers": n_layers, **kw})


def _gpt_oss(n_layers: int, n_experts: int) -> ModelConfig:
    """gpt-oss: sinks, biased attention, sliding (128) and full layers alternating, YaRN to 128K;
    a biased router, top-4 then softmax; biased experts with the clamped SwiGLU."""
    return _llama(vocab_size=201088, context_length=131072, d_model=2880, n_layers=n_layers, n_heads=64,
                  n_kv_heads=8, head_dim=64, d_ff=2880, norm_eps=1e-5, rope_theta=150000.0,
                  rope_scaling=RopeScaling(rope_type="yarn", factor=32.0, original_context_length=4096,
                                           beta_fast=32.0, beta_slow=1.0, truncate=False),
                  layer_types=("sliding_attention", "full_attention") * (n_layers // 2), sliding_window=128,
                  attn_sinks=True, bias=True, qkv_bias=True, n_experts=n_experts, n_experts_per_token=4,
                  router="topk_softmax", router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                  router_aux_loss_coef=0.9)


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
    # Qwen3.5 dense text models (config.json text_config of Qwen/Qwen3.5-{0.8B,2B,4B,9B,27B}):
    # three Gated DeltaNet layers then one gated full-attention layer, repeated; head_dim 256 with
    # RoPE on its first quarter; zero-centred RMSNorm; the three smallest tie their head.
    "qwen3.5-0.8b": _qwen3_5(d_model=1024, d_ff=3584, n_layers=24, n_heads=8, n_kv_heads=2,
                             linear_n_v_heads=16, tie_embeddings=True),
    "qwen3.5-2b": _qwen3_5(d_model=2048, d_ff=6144, n_layers=24, n_heads=8, n_kv_heads=2,
                           linear_n_v_heads=16, tie_embeddings=True),
    "qwen3.5-4b": _qwen3_5(d_model=2560, d_ff=9216, n_layers=32, n_heads=16, n_kv_heads=4,
                           linear_n_v_heads=32, tie_embeddings=True),
    "qwen3.5-9b": _qwen3_5(d_model=4096, d_ff=12288, n_layers=32, n_heads=16, n_kv_heads=4,
                           linear_n_v_heads=32, tie_embeddings=False),
    "qwen3.5-27b": _qwen3_5(d_model=5120, d_ff=17408, n_layers=64, n_heads=24, n_kv_heads=4,
                            linear_n_v_heads=48, tie_embeddings=False),
    # --- mixtures of experts (the config.json of each checkpoint) ---
    # Mixtral-8x7B-v0.1: 8 experts of Mistral 7B's MLP, 2 per token
    "mixtral-8x7b": _llama(vocab_size=32000, context_length=32768, d_model=4096, n_layers=32, n_heads=32,
                           n_kv_heads=8, d_ff=14336, norm_eps=1e-5, rope_theta=1e6, n_experts=8,
                           n_experts_per_token=2, router_aux_loss_coef=0.02),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token, renormalised (norm_topk_prob)
    "qwen3-30b-a3b": _llama(**_QWEN3, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, d_ff=6144,
                            moe_d_ff=768, n_experts=128, n_experts_per_token=8, router_aux_loss_coef=0.001),
    # openai/gpt-oss-20b and gpt-oss-120b (24 layers of 32 experts; 36 of 128)
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    # Qwen3.5 MoE text models (text_config of Qwen/Qwen3.5-35B-A3B and -397B-A17B): every layer an
    # MoE of experts as wide as its gated shared expert. The 397B's Gated DeltaNet heads (16 QK, 64 V)
    # are not in our source; they are the counts that give its published 397B total and 17B active.
    "qwen3.5-35b-a3b": _qwen3_5(d_model=2048, d_ff=512, n_layers=40, n_heads=16, n_kv_heads=2, linear_n_v_heads=32,
                                tie_embeddings=False, n_experts=256, n_experts_per_token=8, shared_expert_d_ff=512,
                                shared_expert_gate=True, router_aux_loss_coef=0.001),
    "qwen3.5-397b-a17b": _qwen3_5(d_model=4096, d_ff=1024, n_layers=60, n_heads=32, n_kv_heads=2,
                                  linear_n_v_heads=64, tie_embeddings=False, n_experts=512, n_experts_per_token=10,
                                  shared_expert_d_ff=1024, shared_expert_gate=True, router_aux_loss_coef=0.001),
    # deepseek-ai/DeepSeek-V3 (config.json): multi-head latent attention (a latent of 512 and one
    # RoPE key of 64 cached per token and layer), 3 dense layers then 58 of 256 routed experts (8 per
    # token from 4 of 8 groups, sigmoid scores) and 1 shared expert; YaRN from 4K to 160K. Its
    # multi-token-prediction layer (model.layers.61) is not part of the causal LM.
    "deepseek-v3": _llama(vocab_size=129280, context_length=163840, d_model=7168, n_layers=61, n_heads=128,
                          d_ff=18432, norm_eps=1e-6, rope_theta=10000.0, rope_interleaved=True,
                          rope_scaling=RopeScaling(rope_type="yarn", factor=40.0, original_context_length=4096,
                                                   beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                          kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                          v_head_dim=128, mlp_types=("dense",) * 3 + ("moe",) * 58, moe_d_ff=2048, n_experts=256,
                          n_experts_per_token=8, router="sigmoid_topk", n_expert_groups=8, topk_groups=4,
                          routed_scaling_factor=2.5, shared_expert_d_ff=2048),
    # Small shapes for CPU training (vocabulary padded to 64 for speed)
    "gpt2-tiny": _gpt2(128, 4, 4, context_length=256, vocab_pad_multiple=64),
    "tiny": _llama(vocab_size=8192, context_length=256, d_model=128, n_layers=4, n_heads=4,
                   n_kv_heads=2, d_ff=384, tie_embeddings=True, vocab_pad_multiple=64),
    "qwen3.5-tiny": _qwen3_5(vocab_size=8192, context_length=256, d_model=128, n_layers=4, n_heads=4,
                             n_kv_heads=2, head_dim=32, d_ff=384, rope_theta=10000.0, linear_n_k_heads=2,
                             linear_n_v_heads=4, linear_k_head_dim=32, linear_v_head_dim=32,
                             tie_embeddings=True, vocab_pad_multiple=64),
    # tiny's shape with its MLP split into 8 experts of half its width, 2 per token: the active
    # parameters of tiny (plus a router), four times its MLP parameters in all
    "moe-tiny": _llama(vocab_size=8192, context_length=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       d_ff=192, n_experts=8, n_experts_per_token=2, router_aux_loss_coef=0.01,
                       tie_embeddings=True, vocab_pad_multiple=64),
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
        raise ValueError(unknown_preset(name)) from None
    if not overrides:
        return config
    fields = underived_fields(config)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown} for get_preset({name!r})")
    return ModelConfig(**{**fields, **overrides})


def unknown_preset(name: str) -> str:
    """The message for a preset name that is not one: the closest names when there are some
    ("did you mean llama3-8b?"), else the whole list."""
    import difflib

    close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.6)
    if close:
        also = f" (also close: {', '.join(close[1:])})" if close[1:] else ""
        return f"unknown preset {name!r}; did you mean {close[0]}?{also}"
    return f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}"


def underived_fields(config: ModelConfig) -> dict:
    """config as a dict with the fields ModelConfig derived (head_dim = D / H, ...) set back to
    None, so that new values of d_model or n_heads derive them again."""
    d = config.to_dict()
    for name in ("n_kv_heads", "head_dim", "d_ff", "qkv_bias", "linear_n_k_heads",
                 "linear_n_v_heads", "linear_k_head_dim", "linear_v_head_dim", "moe_d_ff"):
        if getattr(ModelConfig(**{**d, name: None}), name) == d[name]:
            d[name] = None
    return d
