"""Parameter, FLOP and memory accounting: the worked numbers, exact vs formula, and `logitlab params`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from logitlab.cli.main import main
from logitlab.model import accounting as acc
from logitlab.model.families import PRESETS
from logitlab.model.transformer import Transformer

# Exact counts of the published checkpoints (norm weights included), facts about those models.
EXACT = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
         "gpt2-xl": 1_557_611_200, "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
         "llama3.2-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360}


def test_llama3_8b_worked_numbers():
    f = acc.formula_count(PRESETS["llama3-8b"])
    assert f.attention_per_layer == 41_943_040
    assert f.mlp_per_layer == 176_160_768
    assert f.layers == 6_979_321_856
    assert f.embeddings == 1_050_673_152
    assert f.total == 8_029_995_008


def test_llama3_70b_and_gpt2_formula():
    assert acc.formula_count(PRESETS["llama3-70b"]).total == 70_552_387_584
    assert acc.formula_count(PRESETS["gpt2"]).total == 123_532_032
    assert acc.formula_count(PRESETS["gpt2"]).classic == 12 * 768**2 * 12


def test_gpt2_exact_count_and_difference_explained():
    exact = acc.count_parameters(PRESETS["gpt2"])
    assert exact.total == 124_439_808
    assert exact.lm_head == 0 and exact.tied
    diff = acc.explain_difference(PRESETS["gpt2"], exact)
    # 1024 learned positions x 768; 12 x (2 LayerNorms x 2 x 768) + final LayerNorm; 12 x 6912 biases
    assert diff == {"learned positions": 786_432, "norms": 12 * 3072 + 1536, "biases": 12 * 6912}
    assert 123_532_032 + sum(diff.values()) == 124_439_808


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta_and_adds_up(name):
    cfg = PRESETS[name]
    exact = acc.count_parameters(cfg)
    if name in EXACT:
        assert exact.total == EXACT[name]
    assert exact.total == acc.formula_count(cfg).total + sum(acc.explain_difference(cfg, exact).values())
    assert exact.attention_per_layer * exact.n_attention_layers == exact.attention
    assert exact.linear_attention_per_layer * exact.n_linear_layers == exact.linear_attention


def _random_config(rng) -> "acc.ModelConfig":
    """A small config drawing every switch that changes the parameter count."""
    n_layers = rng.randint(1, 5)
    hybrid = rng.random() < 0.3
    kinds = tuple(rng.choice(["full_attention", "linear_attention"]) for _ in range(n_layers)) if hybrid else None
    mlp = rng.choice(["gelu", "swiglu", "relu2"])
    positions = rng.choice(["learned", "sinusoidal", "rope", "alibi", "none"])
    return acc.ModelConfig(
        vocab_size=rng.randint(5, 300), context_length=rng.randint(4, 64), d_model=8 * rng.randint(1, 6),
        n_layers=n_layers, n_heads=4, n_kv_heads=rng.choice([1, 2, 4]), head_dim=rng.choice([None, 4, 6]),
        d_ff=rng.choice([None, 24]), mlp=mlp,
        positions="rope" if hybrid else positions, bias=rng.random() < 0.5,
        qkv_bias=rng.choice([None, True, False]), qk_norm=rng.random() < 0.5,
        tie_embeddings=rng.random() < 0.5, vocab_pad_multiple=rng.choice([1, 8, 64]), layer_types=kinds,
        attn_gate=rng.choice(["none", "headwise", "elementwise"]), attn_sinks=rng.random() < 0.3,
        linear_conv_kernel=rng.randint(2, 5),
        value_embeddings=rng.choice(["none", "alternate", "all"]), **_random_norms(rng, hybrid),
        **(_random_moe(rng, n_layers) if mlp == "swiglu" and rng.random() < 0.5 else {}))


def _random_norms(rng, hybrid: bool) -> dict:
    """The norm switches: LayerNorm or RMSNorm, zero-centred, or parameter-free (norm_affine=False)."""
    if hybrid:
        return dict(norm="rmsnorm", norm_zero_centered=rng.random() < 0.5)
    norm = rng.choice(["layernorm", "rmsnorm", "rmsnorm-free"])
    return dict(norm="rmsnorm", norm_affine=False) if norm == "rmsnorm-free" else dict(norm=norm)


def _random_moe(rng, n_layers: int) -> dict:
    """The mixture-of-experts fields that change the count: experts and their width, MoE or dense
    layers, router and expert biases, a shared expert and its gate."""
    E, shared = rng.randint(2, 6), rng.choice([0, 16])
    return dict(n_experts=E, n_experts_per_token=rng.randint(1, E), moe_d_ff=rng.choice([None, 12]),
                mlp_types=tuple(rng.choice(["moe", "dense"]) for _ in range(n_layers)),
                router_bias=rng.random() < 0.5, expert_bias=rng.random() < 0.5, shared_expert_d_ff=shared,
                shared_expert_gate=bool(shared) and rng.random() < 0.5)


def test_arithmetic_count_equals_the_meta_build():
    """memory.parameter_count, from the config's numbers alone (what a loader checks before it
    builds anything), equals the exact count of the model built on the meta device, on every
    preset and on random configs drawing every switch that changes a shape (experts included)."""
    import random

    from logitlab.model import memory

    rng = random.Random(0)
    configs = list(PRESETS.values()) + [_random_config(rng) for _ in range(60)]
    for cfg in configs:
        terms = memory.parameter_terms(cfg)
        exact = acc.count_parameters(cfg)
        assert sum(terms.values()) == exact.total, cfg
        assert terms["context_length"] == exact.positions and terms["final_norm"] == exact.final_norm
        assert terms["vocab_size"] == exact.embeddings + exact.lm_head


def test_exact_count_matches_a_real_model_by_storage():
    """The slow, obvious path: a real CPU model, unique storages summed."""
    untied = dataclasses.replace(PRESETS["tiny"], tie_embeddings=False)
    for cfg in (PRESETS["tiny"], PRESETS["gpt2-tiny"], untied):
        model = Transformer(cfg)
        unique = {p.data_ptr(): p.numel() for p in model.parameters()}
        assert acc.count_parameters(model).total == sum(unique.values())
        assert acc.count_parameters(cfg).total == sum(unique.values())


def test_tying_counts_the_shared_table_once():
    tied, untied = PRESETS["llama3.2-1b"], dataclasses.replace(PRESETS["llama3.2-1b"], tie_embeddings=False)
    a, b = acc.count_parameters(tied), acc.count_parameters(untied)
    assert b.total - a.total == 128256 * 2048 == b.lm_head and a.lm_head == 0
    assert acc.formula_count(untied).embeddings == 2 * acc.formula_count(tied).embeddings


def test_head_dim_generalisation():
    # Qwen3-0.6B: H·Dh = 2048 != D = 1024, so q and o are D x H·Dh, not D x D
    f = acc.formula_count(PRESETS["qwen3-0.6b"])
    assert f.attention_per_layer == 2 * 1024 * 16 * 128 + 2 * 1024 * 8 * 128
    assert "H·Dh = 2048 differs from D = 1024" in acc.explain_classic(PRESETS["qwen3-0.6b"])


def test_flops_per_token():
    cfg = PRESETS["gpt2"]
    fl = acc.flops_per_token(cfg, context=1024)
    n_matmul = 12 * 7_077_888 + 50257 * 768   # blocks + LM head
    assert fl["dense"] == 2 * n_matmul
    assert fl["attention"] == 2 * 12 * 1024 * 768
    assert fl["training"] == 3 * fl["forward"] == 3 * (fl["dense"] + fl["attention"])
    # ~2N per token: within 10% of 2 x the exact count at this context
    assert abs(fl["forward"] / (2 * 124_439_808) - 1) < 0.1


def test_memory_and_kv_cache():
    cfg = PRESETS["llama3-8b"]
    kv = acc.kv_cache_bytes(cfg, "bf16")
    assert kv["per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072      # 128 KiB per token
    assert kv["total"] == 131_072 * 8192
    w = acc.weight_bytes(8_030_261_248)
    assert (w["fp32"], w["bf16"], w["int8"]) == (4 * 8_030_261_248, 2 * 8_030_261_248, 8_030_261_248)
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        acc.kv_cache_bytes(cfg, "fp7")


def test_planner_fits_and_time():
    cfg = PRESETS["gpt2"]
    plan = acc.plan_training(cfg, batch_size=4, context=256, dtype="bf16", memory_gb=8,
                             matmul_flops_per_s=1e12)
    n = 124_439_808
    assert (plan.weights, plan.gradients, plan.optimizer) == (4 * n, 4 * n, 8 * n)
    assert plan.fits
    assert plan.seconds_per_step == pytest.approx(acc.flops_per_token(cfg, 256)["training"] * 1024 / 1e12)
    assert not acc.plan_training(cfg, 4, 256, "bf16", memory_gb=1).fits
    big = acc.plan_training(cfg, 64, 1024, "fp32")
    assert big.activations == 64 * 1024 * acc.activation_elements_per_token(cfg) * 4
    with pytest.raises(ValueError, match="context \\(2048\\) exceeds"):
        acc.plan_training(cfg, 1, 2048)


@pytest.mark.parametrize("name", ["small", "gpt2-tiny"])
def test_activation_estimate_against_saved_tensors(name):
    """The estimate against what autograd really keeps for backward (fp32, unique storages)."""
    cfg = PRESETS[name]
    model = Transformer(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.is_floating_point() and ptr not in params:
            saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    B, T = 2, 64
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, cfg.vocab_size, (B, T)))
    measured = sum(saved.values()) / (B * T * 4)
    assert 0.7 < acc.activation_elements_per_token(cfg) / measured < 1.3


def test_matmul_rate_is_measured():
    assert acc.measure_matmul_flops("fp32", n=128, seconds=0.05) > 1e6


def test_cli_params_json_and_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")   # one line per message
    assert main(["params", "llama3-8b", "--json", "--tflops", "100", "--memory-gb", "80"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["formula"]["total"] == 8_029_995_008 and r["exact"]["total"] == 8_030_261_248
    assert r["difference"] == {"norms": 266_240}
    assert r["kv_cache"]["per_token"] == 131_072 and r["plan"]["fits"] is False
    assert main(["params", "gpt2", "--tflops", "1", "--batch", "4", "--context", "256",
                 "--memory-gb", "16"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "123,532,032" in out and "fits" in out
    assert "learned positions 786,432" in out
    # a Hugging Face config.json and a model directory work too
    from logitlab.model.families import config_to_hf

    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(PRESETS["qwen3-0.6b"])))
    assert main(["params", str(tmp_path), "--json", "--tflops", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["exact"]["total"] == 596_049_920
    from logitlab.io import checkpoint

    checkpoint.save_checkpoint(tmp_path / "run", 5, Transformer(PRESETS["tiny"]))   # a training run dir
    assert main(["params", str(tmp_path / "run"), "--json", "--tflops", "1"]) == 0
    tiny_total = acc.count_parameters(PRESETS["tiny"]).total
    assert json.loads(capsys.readouterr().out)["exact"]["total"] == tiny_total
    assert main(["params", "nonesuch"]) == 2
    assert "neither a preset" in capsys.readouterr().err
