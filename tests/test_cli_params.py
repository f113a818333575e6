"""`logitlab params` as a planner: what fits when a plan does not, the weights under bf16
compute, the note on a CPU-measured rate, MFU explained once, FLOPs in engineering units and the
classic 12·D²·L as a table (logitlab/model/planner.py does the arithmetic, cli/model.py renders)."""

from __future__ import annotations

import json

import pytest

from logitlab.cli.main import main
from logitlab.cli.model import duration, si
from logitlab.model import accounting as acc
from logitlab.model import planner
from logitlab.model.families import get_preset


def _params(capsys, *argv) -> str:
    assert main(["params", *argv]) == 0
    return capsys.readouterr().out


def test_engineering_units_and_durations():
    assert si(1.72e10, "FLOP") == "17.2 GFLOP"
    assert si(1.5e10, "FLOP") == "15.0 GFLOP"
    assert si(5.234e13, "FLOP") == "52.3 TFLOP"
    assert si(1.58e15, "FLOP") == "1.58 PFLOP"
    assert si(512, "B") == "512 B" and si(0, "FLOP") == "0 FLOP"
    assert duration(0.42) == "0.42 s" and duration(600) == "10 min" and duration(7200) == "2 h"
    assert duration(3 * 86400) == "3 days"


def test_fit_advice_is_the_largest_batch_and_context_that_fit():
    cfg = get_preset("gpt2")
    plan = acc.plan_training(cfg, 64, 1024, "bf16", 24.0)
    assert not plan.fits
    advice = planner.fit_advice(cfg, plan)
    limit = advice.memory_limit
    b, t = advice.largest_batch, advice.largest_context
    assert 1 <= b < 64 and 1 <= t < 1024
    assert acc.plan_training(cfg, b, 1024, "bf16").total <= limit < acc.plan_training(cfg, b + 1, 1024, "bf16").total
    assert acc.plan_training(cfg, 64, t, "bf16").total <= limit < acc.plan_training(cfg, 64, t + 1, "bf16").total
    # fully sharded: the smallest power of two whose per-rank share fits
    w, micro = advice.sharded_world_size, advice.sharded_micro_batch
    assert w >= 2 and micro == -(-64 // w)
    assert planner.sharded_plan(cfg, 64, 1024, "bf16", plan.n_params, limit) == (w, micro)
    assert planner.fit_advice(cfg, acc.plan_training(cfg, 1, 128, "bf16", 24.0)) is None  # it fits: no advice
    assert planner.fit_advice(cfg, acc.plan_training(cfg, 1, 128, "bf16")) is None        # no limit: no advice


def test_when_even_the_state_does_not_fit_only_sharding_is_offered():
    cfg = get_preset("llama3-8b")
    advice = planner.fit_advice(cfg, acc.plan_training(cfg, 8, 4096, "bf16", 80.0))
    assert advice.largest_batch is None and advice.largest_context is None
    assert advice.state_bytes == 16 * acc.count_parameters(cfg).total
    assert advice.sharded_world_size == 4 and advice.sharded_micro_batch == 2


def test_weights_note_and_rate_note():
    assert planner.weights_note("fp32", 10) is None
    assert planner.weights_note("bf16", 10) == dict(dtype="bf16", master_bytes=40, compute_bytes=20)
    big = acc.plan_training(get_preset("gpt2"), 8, 1024, "bf16", None, 1e11)
    small = acc.plan_training(get_preset("tiny"), 1, 64, "bf16", None, 1e11)
    assert planner.rate_note(big, measured_on_cpu=True) and not planner.rate_note(big, measured_on_cpu=False)
    assert not planner.rate_note(small, measured_on_cpu=True)


def test_classic_table_rows_name_why_they_differ():
    rows = {r["part"]: r for r in planner.classic_table(get_preset("llama3-8b"))}
    D = 4096
    assert rows["attention / layer"]["classic"] == 4 * D * D and "GQA" in rows["attention / layer"]["why"]
    assert rows["MLP / layer"]["formula"] == 3 * D * 14336 and "swiglu" in rows["MLP / layer"]["why"]
    assert rows["all 32 layers"]["classic"] == 12 * D * D * 32
    gpt2 = planner.classic_table(get_preset("gpt2"))
    assert all(r["why"] == "same shape" for r in gpt2) and gpt2[2]["classic"] == gpt2[2]["formula"]


def test_params_output_for_a_plan_that_does_not_fit(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    out = _params(capsys, "gpt2", "--batch", "64", "--context", "1024", "--memory-gb", "24", "--tflops", "100")
    assert "does not fit in 24.0 GiB" in out
    assert "fits in 24.0 GiB: batch 33 at context 1024" in out and "--grad-accum 2" in out
    assert "fits in 24.0 GiB: context" in out and "fully sharded (--parallel fsdp, ZeRO-3): 2 ranks" in out
    assert "weights (fp32 master copy)" in out and "fp32 master weights" in out and "autocast casts" in out
    assert "FLOPs per token at context 1,024: forward 266 MFLOP" in out and "e+" not in out
    assert out.count("MFU, model FLOPs utilisation") == 1 and "about" in out
    assert "the classic estimate 12·D²·L" in out and "4·D² (MHA, H·Dh = D)" in out
    assert "note: this step is timed" not in out   # a given rate gets no note about this CPU's


def test_params_notes_a_cpu_rate_and_fp32_has_no_master_copy_line(capsys, monkeypatch):
    import logitlab.model.accounting as accounting

    monkeypatch.setattr(accounting, "measure_matmul_flops", lambda *a, **k: 1e11)  # "measured" here
    out = _params(capsys, "gpt2", "--batch", "8", "--context", "1024", "--dtype", "fp32")
    assert "note: this step is timed at this CPU's measured matmul rate" in out and "--tflops 989" in out
    assert "master" not in out and "weights (fp32)" in out


@pytest.mark.parametrize("memory", ["24", None])
def test_params_json_carries_the_planner(capsys, memory):
    argv = ["gpt2", "--batch", "64", "--context", "1024", "--tflops", "100", "--json"]
    r = json.loads(_params(capsys, *(argv + (["--memory-gb", memory] if memory else []))))
    assert r["weights_in_training"]["master_bytes"] == 4 * r["exact"]["total"]
    assert [row["part"] for row in r["classic_table"]] == ["attention / layer", "MLP / layer", "all 12 layers"]
    assert r["rate_note"] is False and r["typical_mfu"] == planner.TYPICAL_MFU
    if memory:
        assert r["fits_instead"]["largest_batch"] == 33
    else:
        assert r["fits_instead"] is None


def test_a_hybrid_is_counted_by_layer_kind(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")        # the row labels whole (at 80 columns they wrap)
    out = _params(capsys, "qwen3.5-9b", "--tflops", "989")
    assert "attention (8 layers)" in out and "Gated DeltaNet (24 layers)" in out
    assert "in_proj_qkv" in out and "A_log" in out and "1,017,118,720" in out   # the untied head
    assert "fixed whatever the length" in out and "Gated DeltaNet state" in out
    report = json.loads(_params(capsys, "qwen3.5-9b", "--json", "--tflops", "989"))
    assert report["exact"]["n_linear_layers"] == 24 and report["kv_cache"]["fixed"] > 0


def test_params_prints_each_zero_stage_per_rank(capsys):
    from logitlab.parallel.planner import plan_all_stages

    out = _params(capsys, "llama3-8b", "--world-size", "8", "--context", "4096", "--tflops", "989")
    assert "per rank on 8 ranks" in out and all(f"│ {s}" in out for s in ("ddp", "zero1", "zero2", "fsdp"))
    stages = {r.parallel: r for r in plan_all_stages(get_preset("llama3-8b"), 8, context=4096)}
    assert stages["fsdp"].weights * 8 == pytest.approx(stages["ddp"].weights, rel=1e-6)  # ZeRO-3 shards weights
    assert stages["zero1"].optimizer * 8 == pytest.approx(stages["ddp"].optimizer, rel=1e-6)


def test_params_shows_the_quantized_sizes(capsys):
    from logitlab.quant.apply import weight_bytes
    from logitlab.quant.linear import QuantConfig

    out = _params(capsys, "llama3.2-1b", "--json", "--tflops", "1")
    sizes = json.loads(out)["quantized_weight_bytes"]
    cfg = get_preset("llama3.2-1b")
    assert sizes["int8"] == weight_bytes(cfg, QuantConfig("int8"))
    assert sizes["int4 g32"] == weight_bytes(cfg, QuantConfig("int4", 32)) > sizes["int4 g128"]
    text = " ".join(_params(capsys, "llama3.2-1b", "--tflops", "1").split())
    assert "quantized (--quantize:" in text and "int4 g64" in text
