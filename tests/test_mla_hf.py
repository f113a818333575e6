"""DeepSeek-V3 against transformers: DeepseekV3ForCausalLM loads with exact fp32 logits on random
tiny configs (with and without the query rank, dense layers then MoE with shared experts, grouped
sigmoid routing with its correction bias, YaRN with mscale, interleaved or half-split RoPE), both
forms of latent attention give transformers' logits, greedy generate gives its tokens, the export
is a directory transformers reads back, the multi-token-prediction layer is left out, config.json
maps both ways, the published config is the deepseek-v3 preset (671B total, 37B active), and what
the class cannot run is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from logitlab.generate import SampleConfig, generate
from logitlab.io.hf import load_pretrained, save_pretrained
from logitlab.model import accounting as acc
from logitlab.model.families import PRESETS, config_from_hf, config_to_hf
from logitlab.model.mla import set_mla_form

V = 97
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def _deepseek(**kw):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=64,
                routed_scaling_factor=2.5)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**base, **kw})).eval()
    torch.manual_seed(1)
    with torch.no_grad():                 # norms, routers and the correction bias away from their init
        for name, p in model.named_parameters():
            if p.dim() == 1 or "gate.weight" in name:
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.3)
    return model


LAYOUTS = {
    "dense, no query rank": dict(q_lora_rank=None, first_k_dense_replace=3, num_hidden_layers=2),
    "moe, yarn": dict(rope_parameters=YARN),
    "moe from layer 0, two shared, half-split rope, tied": dict(
        first_k_dense_replace=0, n_shared_experts=2, rope_interleave=False, norm_topk_prob=False,
        routed_scaling_factor=1.5, tie_word_embeddings=True, n_group=2, topk_group=1, num_hidden_layers=2),
}


@pytest.mark.parametrize("name", [
    "moe, yarn", pytest.param("dense, no query rank", marks=pytest.mark.slow),
    pytest.param("moe from layer 0, two shared, half-split rope, tied", marks=pytest.mark.slow)])
def test_deepseek_v3_logits_generate_and_export(tmp_path, name):
    from transformers import AutoModelForCausalLM

    theirs = _deepseek(**LAYOUTS[name])
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", verify=True).eval()
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs(ids).logits
        for form in ("expanded", "absorbed"):
            set_mla_form(ours, form)
            torch.testing.assert_close(ours(ids), want, atol=1e-5, rtol=1e-5)
        set_mla_form(ours, "auto")
        prompt = ids[:1, :7]
        tokens = theirs.generate(prompt, max_new_tokens=10, do_sample=False)[0, 7:].tolist()
    assert generate(ours, prompt[0].tolist(), SampleConfig(max_new_tokens=10, temperature=0)).tokens[0] == tokens
    save_pretrained(ours, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(theirs)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, atol=1e-5, rtol=1e-5)
    names = [set(load_file(tmp_path / d / "model.safetensors")) for d in ("out", "hf")]
    assert names[0] == names[1]                                        # per-expert names, as transformers writes


def test_config_fields_and_keys_of_the_moe_layout(tmp_path):
    theirs = _deepseek(rope_parameters=YARN)
    theirs.save_pretrained(tmp_path / "hf")
    c = load_pretrained(tmp_path / "hf").config
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.head_dim) == \
        (16, 24, 8, 12, 10, 20)
    assert c.mlp_kinds == ("dense", "moe", "moe") and c.router == "sigmoid_topk" and c.rope_interleaved
    assert (c.n_experts, c.n_expert_groups, c.topk_groups, c.routed_scaling_factor, c.shared_expert_d_ff) == \
        (8, 4, 2, 2.5, 16)
    assert (c.rope_scaling.mscale, c.rope_scaling.mscale_all_dim) == (0.707, 1.0)
    hf = config_to_hf(c)
    assert config_from_hf(hf) == c
    assert (hf["first_k_dense_replace"], hf["n_shared_experts"], hf["architectures"]) == \
        (1, 1, ["DeepseekV3ForCausalLM"])


def test_the_multi_token_prediction_layer_is_left_out(tmp_path):
    theirs = _deepseek(num_hidden_layers=2)
    theirs.save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    mtp = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in state.items() if ".layers.1." in k}
    mtp["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)       # DeepSeek's MTP module
    save_file({**state, **mtp}, tmp_path / "hf" / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    ours = load_pretrained(tmp_path / "hf", verify=True).eval()
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)


# deepseek-ai/DeepSeek-V3 config.json (facts, abridged to the fields that matter; its fp8
# quantization_config is below)
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "first_k_dense_replace": 3,
               "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
               "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
               "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
               "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
               "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
               "topk_method": "noaux_tc", "tie_word_embeddings": False, "v_head_dim": 128, "vocab_size": 129280}


def test_published_config_is_the_preset_with_671b_total_and_37b_active():
    c = PRESETS["deepseek-v3"]
    assert config_from_hf(DEEPSEEK_V3) == c
    exact = acc.count_parameters(c)
    assert exact.total == pytest.approx(671e9, rel=0.005) and exact.active == pytest.approx(37e9, rel=0.02)
    assert acc.matmul_params(c) == pytest.approx(36.6e9, rel=0.002)     # the weights' documentation: 36.6B
    kv = acc.kv_cache_bytes(c, "bf16", 1)
    assert kv["per_token"] == 61 * (512 + 64) * 2                        # 576 values per token and layer
    with pytest.raises(ValueError, match="quantized .*'fp8'"):
        config_from_hf({**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}})


@pytest.mark.parametrize("extra, match", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 16}, "num_key_value_heads"),
    ({"kv_lora_rank": "512"}, "kv_lora_rank"),
])
def test_unsupported_deepseek_configs_are_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**DEEPSEEK_V3, **extra})


@pytest.mark.parametrize("changes, match", [
    (dict(mlp_types=("moe", "dense")), "mlp_types"),
    (dict(router="softmax_topk"), "router"),
    (dict(shared_expert_d_ff=12), "shared_expert_d_ff"),
])
def test_unexportable_mla_configs_are_named(changes, match):
    import dataclasses

    base = dataclasses.replace(PRESETS["deepseek-v3"], n_layers=2, mlp_types=("dense", "moe"))
    with pytest.raises(ValueError, match=match):
        config_to_hf(dataclasses.replace(base, **changes))


@pytest.mark.slow                                  # params builds the 671B model on the meta device 6 times
def test_params_command_shows_the_kv_cache_against_mha_and_gqa(capsys):
    from logitlab.cli.main import main

    assert main(["params", "deepseek-v3", "--json", "--tflops", "100"]) == 0
    r = json.loads(capsys.readouterr().out)
    mla = r["kv_cache_mla"]
    assert mla["mla_values_per_layer"] == 576 and mla["mha_values_per_layer"] == 128 * (192 + 128)
    assert r["kv_cache"]["per_token"] == mla["mla_per_token"] and r["exact"]["active"] < 38e9
    assert main(["params", "deepseek-v3", "--tflops", "100"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "latent attention keeps 576 values per token and layer" in text
    assert "MHA (128 key/value heads) 4.8 MiB per token (71.1x), GQA (16 key/value heads) 610.0 KiB (8.9x)" in text
