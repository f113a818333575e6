"""Total against active parameters: the MoE presets' published figures, the exact count against the
formula, FLOPs per token from the weights a forward pass really multiplies, memory from the total,
the published config.json files mapping to the presets, and `logitlab params`."""

from __future__ import annotations

import json

import pytest
import torch

from logitlab.model import ModelConfig, Transformer, accounting_moe
from logitlab.model import accounting as acc
from logitlab.model.families import PRESETS, config_from_hf

# (preset, published total, published active, which active count the publisher states, tolerance)
# "all": every parameter a token uses (Mistral's and Qwen's figures); "matmul": the weights a token
# multiplies, embedding lookup excluded (OpenAI's gpt-oss model card). Qwen3.5's totals include
# the vision tower and the multi-token-prediction layer, which logitlab does not load.
PUBLISHED = [
    ("mixtral-8x7b", 46.7e9, 12.9e9, "all", 0.01),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, "all", 0.02),
    ("gpt-oss-20b", 20.91e9, 3.61e9, "matmul", 0.01),
    ("gpt-oss-120b", 116.83e9, 5.13e9, "matmul", 0.01),
    ("qwen3.5-35b-a3b", 35e9, 3e9, "matmul", 0.02),
    ("qwen3.5-397b-a17b", 397e9, 17e9, "matmul", 0.04),
]


@pytest.mark.parametrize("name, total, active, kind, tol", PUBLISHED)
def test_presets_hold_the_published_total_and_active_counts(name, total, active, kind, tol):
    c = PRESETS[name]
    exact = acc.count_parameters(c)
    assert exact.total == pytest.approx(total, rel=tol)
    got = exact.active if kind == "all" else acc.matmul_params(c)
    assert got == pytest.approx(active, rel=max(tol, 0.05 if name.startswith("qwen3.5") else tol))
    assert acc.weight_bytes(exact.total)["bf16"] == 2 * exact.total          # memory: every expert resident


def test_active_count_by_hand_and_the_formula():
    c = ModelConfig(vocab_size=100, context_length=32, d_model=16, n_layers=3, n_heads=2, norm="rmsnorm", mlp="swiglu",
                    positions="rope", bias=False, tie_embeddings=False, n_experts=6, n_experts_per_token=2,
                    d_ff=40, moe_d_ff=8, mlp_types=("dense", "moe", "moe"), shared_expert_d_ff=4,
                    shared_expert_gate=True)
    exact, formula = acc.count_parameters(c), acc.formula_count(c)
    D = 16
    moe_layer = 6 * 3 * D * 8 + 6 * D + 3 * D * 4 + D                      # experts, router, shared, gate
    assert formula.moe_per_layer == moe_layer == accounting_moe.moe_layer_formula(c)
    assert formula.layers == 3 * 4 * D * D + 3 * D * 40 + 2 * moe_layer
    assert exact.total - formula.total == sum(acc.explain_difference(c, exact).values())
    assert exact.inactive == 2 * (6 - 2) * 3 * D * 8                         # 4 idle experts in 2 layers
    assert exact.active == exact.total - exact.inactive
    dense = ModelConfig(vocab_size=100, context_length=32, d_model=16, n_layers=3, n_heads=2)
    assert acc.count_parameters(dense).active == acc.count_parameters(dense).total


@pytest.mark.parametrize("changes", [dict(), dict(expert_bias=True, router_bias=True, mlp_types=("moe", "dense"))])
def test_flops_count_the_products_a_forward_pass_runs(changes, monkeypatch):
    """2 x (active matrix weights) FLOPs per token: the matrix products torch runs, counted (one
    product per expert group: torch's FLOP counter has no formula for its grouped product)."""
    from torch.utils.flop_counter import FlopCounterMode

    import logitlab.model.moe_forms as moe_forms

    monkeypatch.setattr(moe_forms, "_grouped_mm_fits", lambda rows: False)

    c = ModelConfig(vocab_size=64, context_length=32, d_model=16, n_layers=2, n_heads=2, norm="rmsnorm", mlp="swiglu",
                    positions="rope", bias=False, n_experts=8, n_experts_per_token=2, d_ff=24, moe_d_ff=12,
                    tie_embeddings=False, **changes)
    model = Transformer(c).eval()
    model.attn_impl = "eager"
    T = 12
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 64, (1, T)))
    counts = counter.get_flop_counts()["Global"]
    products = sum(n for op, n in counts.items() if "mm" in str(op))         # mm, addmm, bmm (linear, einsum)
    attention = 2 * 2 * c.n_layers * T * T * c.n_heads * c.head_dim            # eager QK^T and PV, all T x T
    assert products - attention == 2 * T * acc.matmul_params(c)
    assert acc.flops_per_token(c, T)["dense"] == 2 * acc.matmul_params(c)


def test_training_plan_keeps_every_expert_and_its_optimizer_state():
    c = PRESETS["moe-tiny"]
    plan = acc.plan_training(c, batch_size=2, context=64, dtype="fp32")
    total = acc.count_parameters(c).total
    assert plan.n_params == total and plan.optimizer == 8 * total
    assert acc.activation_elements_per_token(c) > acc.activation_elements_per_token(PRESETS["tiny"])


# config.json of the published checkpoints (facts, abridged to the fields that matter)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
                 "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "mlp_only_layers": [], "model_type": "qwen3_moe",
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
                 "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                 "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                 "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
                 "vocab_size": 151936}
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64, "hidden_act": "silu",
               "hidden_size": 2880, "intermediate_size": 2880,
               "layer_types": ["sliding_attention", "full_attention"] * 12,
               "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
               "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
               "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                       "original_max_position_embeddings": 4096,
                                                       "rope_type": "yarn", "truncate": False},
               "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
               "tie_word_embeddings": False, "vocab_size": 201088}


@pytest.mark.parametrize("hf, preset", [(QWEN3_30B_A3B, "qwen3-30b-a3b"), (GPT_OSS_20B, "gpt-oss-20b")])
def test_published_moe_configs_map_to_presets(hf, preset):
    assert config_from_hf(hf) == PRESETS[preset]


def test_published_gpt_oss_checkpoint_is_refused_as_quantized():
    with pytest.raises(ValueError, match="quantized .*'mxfp4'"):
        config_from_hf({**GPT_OSS_20B, "quantization_config": {"quant_method": "mxfp4"}})


def test_params_command_shows_total_and_active(capsys):
    from logitlab.cli.main import main

    assert main(["params", "gpt-oss-20b", "--json", "--tflops", "100"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["moe"]["n_experts"] == 32 and r["moe"]["active"] < r["moe"]["total"] == r["exact"]["total"]
    assert r["flops_per_token"]["dense"] == 2 * r["moe"]["active_matmul"]
    assert main(["params", "mixtral-8x7b", "--tflops", "100"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "a token uses 2 of the 8 experts in each of 32 MoE layers" in text
    assert "total 46,702,792,704 (46.7B), active per token 12,879,925,248 (12.9B, 27.6%)" in text
