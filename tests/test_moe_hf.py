"""Mixture-of-experts families against transformers: Mixtral, Qwen3-MoE, Qwen3.5-MoE and gpt-oss
load with exact logits (fp32, random tiny configs) from per-expert and fused checkpoints, generate
the same greedy tokens, export to a directory transformers reads back, and map their config.json
both ways; unsupported features are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from logitlab.generate import SampleConfig, generate
from logitlab.io.hf import load_pretrained, save_pretrained
from logitlab.model import families

V = 97


def _perturb(model):
    """Norms, biases, sinks and routers away from their init, so a mapping error shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "gate.weight" in name or "router" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def _mixtral(window=None, tied=False):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return _perturb(MixtralForCausalLM(MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=window, tie_word_embeddings=tied)))


def _qwen3_moe(norm=False, mlp_only=(), step=1, tied=False):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return _perturb(Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=norm, mlp_only_layers=list(mlp_only), decoder_sparse_step=step,
        tie_word_embeddings=tied)))


def _qwen3_5_moe(types=("linear_attention", "full_attention"), tied=False):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    return _perturb(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=len(types), num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
        num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=tied, layer_types=list(types))))


def _gpt_oss(types=("sliding_attention", "full_attention"), rope=None):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    rope = rope or {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                    "original_max_position_embeddings": 16, "rope_theta": 150000.0}
    return _perturb(GptOssForCausalLM(GptOssConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=len(types), num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=list(types), swiglu_limit=0.9, rope_parameters=rope)))


def _fused_copy(theirs, directory):
    """The transformers model's own (fused, since 5.0) parameters as a checkpoint."""
    directory.mkdir()
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()
             if not (k == "lm_head.weight" and theirs.config.tie_word_embeddings)}
    save_file(state, directory / "model.safetensors")
    (directory / "config.json").write_text(theirs.config.to_json_string())


def _check(theirs, tmp_path, layout="per_expert", T=20):
    from transformers import AutoModelForCausalLM

    if layout == "per_expert":
        theirs.save_pretrained(tmp_path / "hf")
    else:
        _fused_copy(theirs, tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", verify=True).eval()
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)
        prompt = ids[:1, :7]
        want = theirs.generate(prompt, max_new_tokens=10, do_sample=False)[0, 7:].tolist()
    assert generate(ours, prompt[0].tolist(), SampleConfig(max_new_tokens=10, temperature=0)).tokens[0] == want
    save_pretrained(ours, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(theirs)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)
    return ours


@pytest.mark.parametrize("layout, window, tied", [
    ("per_expert", None, False),
    pytest.param("fused", None, True, marks=pytest.mark.slow),
    pytest.param("per_expert", 6, False, marks=pytest.mark.slow),
])
def test_mixtral(tmp_path, layout, window, tied):
    ours = _check(_mixtral(window, tied), tmp_path, layout)
    c = ours.config
    assert (c.n_experts, c.n_experts_per_token, c.moe_d_ff, c.router, c.norm_topk_prob) == \
        (4, 2, 24, "softmax_topk", True)
    assert c.sliding_window == window and c.tie_embeddings == tied


@pytest.mark.parametrize("layout, norm, mlp_only, step", [
    ("fused", True, (1,), 1),
    pytest.param("per_expert", False, (), 1, marks=pytest.mark.slow),
    pytest.param("per_expert", True, (), 2, marks=pytest.mark.slow),
])
def test_qwen3_moe(tmp_path, layout, norm, mlp_only, step):
    ours = _check(_qwen3_moe(norm, mlp_only, step), tmp_path, layout)
    want = tuple("dense" if i in mlp_only or (i + 1) % step else "moe" for i in range(3))
    assert ours.config.mlp_kinds == want and ours.config.norm_topk_prob == norm and ours.config.d_ff == 40


@pytest.mark.parametrize("layout, types, tied", [
    ("per_expert", ("linear_attention", "full_attention"), False),
    pytest.param("fused", ("linear_attention", "linear_attention", "full_attention"), True, marks=pytest.mark.slow),
])
def test_qwen3_5_moe(tmp_path, layout, types, tied):
    ours = _check(_qwen3_5_moe(types, tied), tmp_path, layout, T=70)          # two chunks of the delta rule
    c = ours.config
    assert c.layer_kinds == types and (c.shared_expert_d_ff, c.shared_expert_gate) == (24, True)


@pytest.mark.parametrize("types, rope", [
    (("sliding_attention", "full_attention"), None),
    pytest.param(("full_attention", "sliding_attention", "sliding_attention"),
                 {"rope_type": "default", "rope_theta": 500.0}, marks=pytest.mark.slow),
])
def test_gpt_oss(tmp_path, types, rope):
    ours = _check(_gpt_oss(types, rope), tmp_path, T=24)                     # past the window and the YaRN length
    c = ours.config
    assert c.attn_sinks and c.router == "topk_softmax" and c.expert_act == "clamped_swiglu" and c.swiglu_limit == 0.9
    assert c.layer_kinds == types and c.sliding_window == 4 and c.qkv_bias and c.bias


def test_text_part_of_a_qwen3_5_moe_image_text_checkpoint_loads(tmp_path):
    theirs = _qwen3_5_moe()
    text = json.loads(theirs.config.to_json_string())
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
             for k, v in theirs.state_dict().items()}
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": text}))
    save_file(state, tmp_path / "model.safetensors")
    ours = load_pretrained(tmp_path)
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Keys and configs
# --------------------------------------------------------------------------------------------

def test_keys_map_both_ways_in_both_layouts():
    theirs = _mixtral()
    c = families.config_from_hf(json.loads(theirs.config.to_json_string()))
    state = {k: v for k, v in theirs.state_dict().items()}
    ours = families.state_dict_from_hf(state, c)                           # fused, in memory
    per_expert = families.state_dict_to_hf(ours, c)
    fused = families.state_dict_to_hf(ours, c, expert_layout="fused")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in per_expert
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 48, 32)
    for hf_state in (per_expert, fused):
        load_state = families.state_dict_from_hf(hf_state, c)
        assert set(load_state) == set(ours)
        for k in ours:
            assert torch.equal(load_state[k], ours[k]), k
    del per_expert["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(ValueError, match="lacks expert tensors needed for 'blocks.0.mlp.experts.gate_up_proj'"):
        families.state_dict_from_hf(per_expert, c)


def test_published_mixtral_and_qwen3_moe_configs_map_and_round_trip():
    mixtral = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
               "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
               "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
               "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
               "tie_word_embeddings": False, "vocab_size": 32000}
    c = families.config_from_hf(mixtral)
    assert (c.n_experts, c.n_experts_per_token, c.moe_d_ff, c.router_aux_loss_coef) == (8, 2, 14336, 0.02)
    assert families.config_from_hf(families.config_to_hf(c)) == c


@pytest.mark.parametrize("changes, match", [
    (dict(capacity_factor=1.25), "capacity_factor=1.25"),
    (dict(router="sigmoid_topk"), "router='sigmoid_topk'"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(expert_bias=True), "expert_bias=True"),
    (dict(mlp_types=("dense", "moe"), d_ff=48), "mlp_types"),
])
def test_unexportable_moe_configs_are_named(changes, match):
    from logitlab.model import ModelConfig

    c = ModelConfig(vocab_size=V, context_length=32, d_model=32, n_layers=2, n_heads=4, norm="rmsnorm", mlp="swiglu",
                    positions="rope", bias=False, n_experts=4, n_experts_per_token=2, **changes)
    with pytest.raises(ValueError, match=match):
        families.config_to_hf(c)


@pytest.mark.parametrize("extra, match", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantized .*'mxfp4'.*dequantize"),
    ({"num_experts_per_tok": "2"}, "'num_experts_per_tok'"),
])
def test_unsupported_moe_hf_configs_are_refused(extra, match):
    hf = {**json.loads(_mixtral().config.to_json_string()), **extra}
    with pytest.raises(ValueError, match=match):
        families.config_from_hf(hf)


def test_training_loss_with_the_pooled_balance_loss_is_transformers(tmp_path):
    """transformers' MixtralForCausalLM loss with labels and router logits: cross-entropy + coef *
    load_balancing_loss_func, from our model's logits and recorded routing."""
    from logitlab.train.loss import cross_entropy
    from logitlab.train.moe import load_balancing_loss

    theirs = _mixtral()
    theirs.config.router_aux_loss_coef = theirs.router_aux_loss_coef = 0.3
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.router_aux_loss_coef == 0.3
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = theirs(ids, labels=ids, output_router_logits=True)
        records = []
        logits = ours(ids, records=records)
        aux = load_balancing_loss(records, 4, pooled=True)
        got = cross_entropy(logits[:, :-1], ids[:, 1:]) + 0.3 * aux
    torch.testing.assert_close(aux, want.aux_loss)
    torch.testing.assert_close(got, want.loss)
