"""Presets, Hugging Face config.json <-> ModelConfig, and the state-dict key maps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitlab.model import families, keymap
from logitlab.model.config import ModelConfig, RopeScaling
from logitlab.model.families import PRESETS, config_from_hf, config_to_hf, get_preset, hf_architecture
from logitlab.model.transformer import Transformer

# config.json files as published on the Hugging Face hub (facts, abridged to the fields that matter)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
             "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
             "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64,
              "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
              "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
              "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                                      "low_freq_factor": 1.0,
                                                      "original_max_position_embeddings": 8192,
                                                      "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
             "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
             "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
             "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
             "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
        "vocab_size": 50257}


@pytest.mark.parametrize("hf, preset", [(LLAMA3_8B, "llama3-8b"), (LLAMA32_1B, "llama3.2-1b"),
                                        (QWEN3_06B, "qwen3-0.6b"), (GPT2, "gpt2")])
def test_published_configs_map_to_presets(hf, preset):
    assert config_from_hf(hf) == PRESETS[preset]


def test_preset_facts():
    q = PRESETS["qwen3-8b"]
    assert (q.head_dim, q.qk_norm, q.tie_embeddings, q.norm_eps, q.rope_theta) == \
        (128, True, False, 1e-6, 1e6)
    assert PRESETS["llama3.2-1b"].rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert PRESETS["llama3-70b"].n_kv_heads == 8 and PRESETS["llama3-70b"].d_ff == 28672
    xl = PRESETS["gpt2-xl"]
    assert (xl.d_model, xl.n_layers, xl.n_heads, xl.head_dim) == (1600, 48, 25, 64)
    small = get_preset("small")
    assert (small.d_model, small.n_layers, small.n_heads, small.n_kv_heads, small.d_ff, small.vocab_size) == \
        (384, 6, 6, 2, 1024, 8192)
    with pytest.raises(ValueError, match=r"unknown preset 'llama5'; did you mean llama3-8b\?"):
        get_preset("llama5")


def test_new_style_rope_parameters():
    hf = {**LLAMA32_1B, "rope_scaling": None, "rope_theta": None,
          "rope_parameters": {**LLAMA32_1B["rope_scaling"], "rope_theta": 500000.0}}
    assert config_from_hf(hf) == PRESETS["llama3.2-1b"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_config_round_trip(name):
    c = PRESETS[name]
    back = config_from_hf(config_to_hf(c))
    assert back == dataclasses.replace(c, vocab_pad_multiple=1)


@pytest.mark.parametrize("changes, arch", [
    (dict(), "GPT2LMHeadModel"),
    (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False), "LlamaForCausalLM"),
    (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=True), "LlamaForCausalLM"),
    (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True), "Qwen2ForCausalLM"),
    (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, qk_norm=True), "Qwen3ForCausalLM"),
])
def test_architecture_from_features(changes, arch):
    cfg = ModelConfig(vocab_size=100, context_length=32, d_model=64, n_layers=2, n_heads=4, **changes)
    assert hf_architecture(cfg) == arch
    assert config_to_hf(cfg)["architectures"] == [arch]


@pytest.mark.parametrize("changes, match", [
    (dict(norm_placement="post"), "norm_placement"),
    (dict(positions="rope"), "positions/norm/mlp"),
    (dict(n_kv_heads=2), "GPT2LMHeadModel"),
    (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=True, qkv_bias=False), "bias/qkv_bias"),
    (dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=True, qk_norm=True), "Qwen3ForCausalLM"),
])
def test_unexportable_configs_are_named(changes, match):
    cfg = ModelConfig(vocab_size=100, context_length=32, d_model=64, n_layers=2, n_heads=4, **changes)
    with pytest.raises(ValueError, match=match):
        config_to_hf(cfg)


@pytest.mark.parametrize("hf, match", [
    ({**GPT2, "architectures": ["FalconForCausalLM"]}, "unsupported architecture 'FalconForCausalLM'"),
    ({"model_type": "bert"}, "names no architecture"),
    ({**QWEN3_06B, "use_sliding_window": True, "sliding_window": 4096,
      "layer_types": ["chunked_attention"] * 28}, "layer_types=\\['chunked_attention'\\]"),
    ({"architectures": ["Qwen3_5ForCausalLM"], "attn_output_gate": False}, "attn_output_gate=False"),
    ({"architectures": ["Qwen3_5ForConditionalGeneration"]}, "lacks required field 'text_config'"),
    ({**LLAMA3_8B, "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "rope_type='proportional'"),
    ({**LLAMA3_8B, "hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({**LLAMA3_8B, "attention_bias": True}, "attention_bias/mlp_bias"),
    ({**GPT2, "activation_function": "relu"}, "activation_function='relu'"),
    ({**GPT2, "n_embd": None}, "'n_embd'"),
])
def test_unsupported_hf_configs_are_refused(hf, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)


def test_mistral_without_window_and_qwen2_biases():
    mistral = config_from_hf({**LLAMA3_8B, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert mistral == PRESETS["llama3-8b"]
    qwen2 = config_from_hf({**QWEN3_06B, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.bias and not qwen2.qk_norm


def _random_model(cfg):
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def test_gpt2_key_map_fuses_and_transposes():
    cfg = dataclasses.replace(PRESETS["gpt2-tiny"], n_layers=2)
    model = _random_model(cfg)
    state = model.state_dict()
    out = keymap.state_dict_to_hf(state, cfg)
    D, V = cfg.d_model, cfg.vocab_size
    c_attn = out["transformer.h.1.attn.c_attn.weight"]
    assert c_attn.shape == (D, 3 * D)
    torch.testing.assert_close(c_attn[:, D:2 * D], state["blocks.1.attn.qkv_proj.weight"][D:2 * D].t())
    torch.testing.assert_close(out["transformer.h.0.attn.c_attn.bias"][2 * D:],
                               state["blocks.0.attn.qkv_proj.bias"][2 * D:])
    torch.testing.assert_close(out["transformer.h.0.mlp.c_fc.weight"],
                               state["blocks.0.mlp.up_proj.weight"].t())
    assert out["transformer.wte.weight"].shape == (V, D)   # padding rows cut off (cfg pads to 64)
    assert "lm_head.weight" not in out                    # tied: stored once
    back = keymap.state_dict_from_hf(out, cfg)
    expected = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert set(back) == set(expected)
    for k, v in back.items():
        want = expected[k][:V] if k == "tok_emb.weight" else expected[k]
        torch.testing.assert_close(v, want, msg=k)


def test_llama_key_map_round_trip_and_names():
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=2, qk_norm=True, tie_embeddings=False)
    state = _random_model(cfg).state_dict()
    out = keymap.state_dict_to_hf(state, cfg)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.1.self_attn.k_norm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight"} <= set(out)
    torch.testing.assert_close(out["model.layers.1.self_attn.o_proj.weight"],
                               state["blocks.1.attn.o_proj.weight"])
    H, Hkv, Dh, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    qkv, gate_up = state["blocks.1.attn.qkv_proj.weight"], state["blocks.0.mlp.gate_up_proj.weight"]
    assert qkv.shape == ((H + 2 * Hkv) * Dh, cfg.d_model)
    assert torch.equal(out["model.layers.1.self_attn.q_proj.weight"], qkv[:H * Dh])
    assert torch.equal(out["model.layers.1.self_attn.k_proj.weight"], qkv[H * Dh:(H + Hkv) * Dh])
    assert torch.equal(out["model.layers.1.self_attn.v_proj.weight"], qkv[(H + Hkv) * Dh:])
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], gate_up[:F])
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], gate_up[F:])
    back = keymap.state_dict_from_hf(out, cfg)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert keymap.hf_key_to_logitlab("model.layers.0.self_attn.k_proj.weight", "llama") is None
    del out["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 'model.layers.1.self_attn.v_proj.weight', needed with the "
                                         r"rest of 'blocks.1.attn.qkv_proj.weight'"):
        keymap.state_dict_from_hf(out, cfg)
    assert keymap.hf_key_to_logitlab("model.layers.3.input_layernorm.weight", "llama") == \
        "blocks.3.attn_norm.weight"
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.rotary.weight'"):
        keymap.hf_key_to_logitlab("model.layers.0.self_attn.rotary.weight", "llama")


def test_key_maps_and_config_names_stay_importable_from_their_old_homes():
    from logitlab.model import config, transformer
    for name in ("key_layout", "hf_key_to_logitlab", "clean_hf_state", "hf_tensors_to_logitlab",
                 "state_dict_from_hf", "state_dict_to_hf", "hf_architecture"):
        assert getattr(families, name) is getattr(keymap, name)
    for name in ("ModelConfig", "RopeScaling", "config_from_dict", "check_field_types", "conform", "describe_type"):
        assert getattr(transformer, name) is getattr(config, name)


def test_get_preset_takes_overrides_and_derives_again():
    from logitlab.model import get_preset

    base = get_preset("tiny")
    cfg = get_preset("tiny", vocab_size=10_000, d_model=2 * base.d_model)
    assert cfg.vocab_size == 10_000 and cfg.d_model == 2 * base.d_model
    assert cfg.head_dim == cfg.d_model // cfg.n_heads          # derived from the new width
    assert get_preset("tiny") == base                            # the preset itself is untouched
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['nope'\]"):
        get_preset("tiny", nope=1)
