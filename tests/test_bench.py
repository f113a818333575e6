"""The benchmark harness at tiny sizes: roofline measurements, model speed and memory, the scaling run and its
writers, the dispatcher."""

from __future__ import annotations

import platform
import statistics
import time

import pytest
import torch

from bench import __main__ as dispatcher
from bench import model as model_bench
from bench import roofline, scaling
from bench.common import ROOT, command_line, cpu_flags
from logitlab.model.transformer import ModelConfig, Transformer

MICRO = ModelConfig(vocab_size=256, context_length=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                    d_ff=64, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_matmul_rates_and_peak_are_positive():
    shapes = [(16, 32, 64), (32, 32, 32)]
    rates = roofline.matmul_rates("fp32", shapes, repeats=2)
    assert len(rates) == 2 and all(r > 0 for r in rates)
    assert roofline.matmul_peak("bf16", shapes, repeats=1) > 0


def test_matmul_rates_reject_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        roofline.matmul_rates("fp13", [(4, 4, 4)])
    with pytest.raises(ValueError, match="shape"):
        roofline.matmul_rates("fp32", [(0, 4, 4)])


def test_bandwidths_positive_and_read_is_the_larger_read():
    bw = roofline.bandwidths(mib=4, repeats=1)
    assert all(bw[k] > 0 for k in ("copy", "sum", "matvec", "read"))
    assert bw["read"] == max(bw["sum"], bw["matvec"])
    assert roofline.memory_bandwidth(mib=4, repeats=1) > 0
    with pytest.raises(ValueError, match="mib"):
        roofline.bandwidths(mib=0)


def test_roofline_run_and_render(monkeypatch):
    monkeypatch.setattr(roofline, "SHAPES", {"micro": [(8, 16, 16), (8, 16, 32)]})
    result = roofline.run(quick=True, repeats=1, threads=[1])
    assert torch.get_num_threads() == 1
    assert {r["dtype"] for r in result["matmul"]} == {"fp32", "bf16"} and len(result["matmul"]) == 4
    text = roofline.render(result)
    assert "| micro | 8 x 16 x 32 |" in text and "read bandwidth" in text
    assert result["machine"]["numpy"] and isinstance(cpu_flags(), list)


@pytest.mark.slow  # about 2 minutes on 2 cores: four sides, compiled and eager, in child processes
def test_model_bench_four_sides_and_memory_at_a_tiny_shape():
    """Eager, compiled (aot_eager traces what inductor would compile), transformers and
    transformers compiled, forward and training step in fp32 and bf16, then the peak-memory child
    processes; the section renders."""
    result = model_bench.run(quick=True, repeats=1, models=["micro"], points={"micro": (MICRO, 2, 16)},
                             threads=1, backend="aot_eager")   # quick: B and T halved, memory in fp32 only
    rows = result["rows"]
    assert [(r["mode"], r["dtype"]) for r in rows] == [("forward", "fp32"), ("train", "fp32"),
                                                       ("forward", "bf16"), ("train", "bf16")]
    for r in rows:
        assert all(r[f"{side}_tok_s"] > 0 and r[f"{side}_mfu"] > 0 for side in model_bench.SIDES)
        assert r["ours_ratio"]["min"] <= r["ours_ratio"]["median"] <= r["ours_ratio"]["max"]
        assert r["compiled_ratio"]["median"] > 0 and "compile_s" in r and "peer_compile_s" in r
        c = r["compiled_vs_peer_compiled"]
        assert c["median"] == pytest.approx(statistics.median(
            p / o for o, p in zip(r["times"]["compiled"], r["times"]["peer-compiled"])))
    assert [m["dtype"] for m in result["memory"]] == ["fp32"] and result["clock"] == "cpu"
    for m in result["memory"]:
        for side in ("ours", "compiled", "peer"):
            assert m[side]["step_mib"] >= 0 and m[side]["first_mib"] >= m[side]["between_mib"] - 1
    for r in rows:
        assert r["floor_s"] > 0 and r["ceiling"] == pytest.approx(min(r["times"]["peer"]) / r["floor_s"])
        assert ("floor_native_s" in r) == (r["dtype"] == "bf16")
    text = model_bench.render(result)
    assert "| micro | train | bf16 | 1 x 8 |" in text and "compiled vs transformers compiled" in text
    assert "| micro | fp32 | 1 x 8 |" in text and "logitlab compiled MiB" in text
    assert "ceiling (transformers step / floor)" in text and "Kernel floor:" in text
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    peers = {"peer": False, "peer-compiled": False}
    assert result["keep_freed_memory"] == {"fp32": {"ours": False, "compiled": glibc, **peers},
                                           "bf16": {"ours": False, "compiled": False, **peers}}
    flat = " ".join(text.split())
    assert ("logitlab eager, logitlab compiled in bf16, transformers and transformers compiled with glibc's "
            "defaults" in flat) == glibc


def test_model_bench_allocator_setting_is_the_trainers(monkeypatch):
    calls = []
    monkeypatch.setattr(model_bench.runtime, "keep_freed_memory", lambda: calls.append(1) or True)
    assert not model_bench.set_allocator("ours", {}) and model_bench.set_allocator("compiled", {"dtype": "fp32"})
    assert not model_bench.set_allocator("compiled", {"dtype": "bf16"})          # as the trainer's "auto"
    assert not model_bench.set_allocator("peer", {"peer_keep_freed_memory": False}) and calls == [1]
    assert model_bench.set_allocator("peer", {"peer_keep_freed_memory": True}) and calls == [1, 1]
    both = {"ours": False, "compiled": True, "peer": True}
    text = model_bench._allocator_text({"keep_freed_memory": {"fp32": both, "bf16": both}})
    flat = " ".join(text.split())
    assert "logitlab compiled and transformers ran with" in flat and "logitlab eager with glibc's" in flat
    assert "--peer-keep-freed-memory" not in text
    text = model_bench._allocator_text({"keep_freed_memory": {"fp32": {"ours": False, "compiled": True},
                                                              "bf16": {"ours": False, "compiled": False}}})
    flat = " ".join(text.split())
    assert "logitlab compiled in fp32 ran with" in flat
    assert "logitlab eager and logitlab compiled in bf16 with glibc's" in flat
    assert model_bench._allocator_text({"keep_freed_memory": {"fp32": {"ours": False}}}) == ""


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_model_bench_kernel_floor_is_positive_and_leaves_the_model_as_it_was(mode):
    """fp32, and bf16 autocast on the routes "auto" measures, on float32 kernels and on the bf16
    kernels: positive times; the model keeps its plain classes and no gradient. 4 x 32 = 128 rows:
    enough for cpu_bf16's float32-GEMM route in bf16."""
    from logitlab.model.attention import Attention

    model = Transformer(MICRO)
    classes = [type(m) for m in model.modules()]
    for autocast, bf16_matmul in ((False, "auto"), (True, "auto"), (True, "fp32"), (True, "native")):
        # wall time: a micro model's step can take less than the user-time clock's tick (0.0)
        assert model_bench.kernel_floor_s(model, 4, 32, mode, autocast, repeats=1,
                                          bf16_matmul=bf16_matmul, timer=time.perf_counter) > 0
    with pytest.raises(ValueError, match="mode"):
        model_bench.kernel_floor_s(model, 2, 8, "backward", False)
    assert [type(m) for m in model.modules()] == classes and Attention in classes
    assert all(p.grad is None for p in model.parameters())   # autograd.grad: nothing accumulated


def test_model_bench_installs_the_trainers_bf16_routes_for_bf16_steps_only():
    """logitlab's bf16 sides run on the routes the trainer would install ("auto" at the step's T),
    each step's replacing the last; an fp32 step runs the plain model."""
    from logitlab.kernels import cpu_bf16

    model = Transformer(MICRO)
    ids = torch.randint(0, MICRO.vocab_size, (2, 16))
    model_bench.train_step("ours", model, ids, True)
    assert len(model_bench.INSTALLED) == 1 and model_bench.INSTALLED[0].attention_shape[2] == 16
    assert model_bench._current_bf16_route(model).count("/") == 1
    model_bench.forward_step("ours", model, ids, True)
    assert len(model_bench.INSTALLED) == 1
    model_bench.train_step("ours", model, ids, False)
    assert model_bench.INSTALLED == [] and model_bench._current_bf16_route(model) == "-"
    assert not any(isinstance(m, (cpu_bf16.Bf16ViaFp32Linear, cpu_bf16.Bf16ViaFp32Attention)) for m in model.modules())


@pytest.mark.slow
def test_model_bench_training_steps_do_the_same_work(monkeypatch, tmp_path):
    """From the same weights, two training steps of each side (compiled: train.loss_fn through
    aot_eager) leave the same decayed matrix: same loss, gradients, clipping and AdamW update."""
    import copy

    import transformers

    from logitlab.io import hf

    monkeypatch.setattr(model_bench, "LR", 1e-3)
    ids = torch.randint(0, MICRO.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ours = Transformer(MICRO)
    before = ours.blocks[1].mlp.down_proj.weight.detach().clone()
    hf.save_pretrained(ours, tmp_path)
    sides = {"ours": ours, "compiled": copy.deepcopy(ours)}
    for peer in model_bench.PEERS:
        sides[peer] = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    for side, m in sides.items():
        step = model_bench.train_step(side, m, ids, False, backend="aot_eager")
        step()
        step()
    after = [m.blocks[1].mlp.down_proj.weight for m in (ours, sides["compiled"])]
    after += [sides[peer].model.layers[1].mlp.down_proj.weight for peer in model_bench.PEERS]
    # AdamW moves each weight by about lr per step, so a tenth of it tells a different update apart
    assert (after[0] - before).abs().mean() > 1e-3
    for w in after[1:]:
        torch.testing.assert_close(w, after[0], atol=1e-4, rtol=0)

def test_decode_bytes_counts_weights_once_and_the_cache():
    model = Transformer(MICRO)
    c = MICRO
    weights = sum(p.numel() for p in model.parameters()) * 4          # tied: the table is the LM head
    kv_per_pos = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    assert scaling.decode_bytes_per_token(model, 0) == weights
    assert scaling.decode_bytes_per_token(model, 10) == weights + 10 * kv_per_pos


def test_scaling_tiny_run_writes_table_and_png(tmp_path):
    s = scaling.Settings(tokens=32, repeats=1, new_tokens=4, point_cap_s=30, budget_s=60)
    result = scaling.run({"micro": MICRO}, (16, 32), s, peak_gflops=10.0, bandwidth_gbs=5.0)
    done = [p for p in result["points"] if "tok_s" in p]
    assert {(p["mode"], p["T"]) for p in done} == {(m, T) for m in scaling.MODES for T in (16, 32)}
    assert all(p["tok_s"] > 0 and p["fraction"] > 0 for p in done)
    png = scaling.plot(result, tmp_path / "scaling.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = scaling.render(result)
    assert "| model | params | mode | T=16 | T=32 |" in text
    assert sum(line.startswith("| micro |") for line in text.splitlines()) == 3


def test_scaling_skips_points_over_the_cap():
    s = scaling.Settings(tokens=32, repeats=1, new_tokens=4, point_cap_s=0.0, budget_s=60)
    result = scaling.run({"micro": MICRO}, (16,), s, peak_gflops=10.0, bandwidth_gbs=5.0)
    assert all("skipped" in p and "cap" in p["skipped"] for p in result["points"])
    assert "skipped (est." in scaling.render(result)


def test_dispatcher_goes_on_after_a_failure(monkeypatch, capsys):
    ran = []

    def fake(name, flags):
        ran.append((name, tuple(flags)))
        return 3 if name == "model" else 0

    monkeypatch.setattr(dispatcher, "run_part", fake)
    assert dispatcher.main(["tokenizer", "model", "roofline", "--quick"]) == 1
    assert ran == [("tokenizer", ("--quick",)), ("model", ("--quick",)), ("roofline", ("--quick",))]
    assert "failed: model" in capsys.readouterr().out
    assert dispatcher.main(["nope"]) == 2


def test_dispatcher_all_lists_every_part(monkeypatch):
    ran = []
    monkeypatch.setattr(dispatcher, "run_part", lambda name, flags: ran.append(name) or 0)
    assert dispatcher.main(["all"]) == 0
    assert ran == list(dispatcher.NAMES)
    assert dispatcher.accepts("scaling", "--quick") and not dispatcher.accepts("roofline", "--nonsense")


def test_generate_memory_table_has_the_compiled_side_where_measured():
    from bench import generate as generate_bench

    info = dict(nproc=2, cpu="cpu", torch="t", torch_threads=1, transformers="x", commit="c")
    row = dict(shape="tiny", dtype="fp32", batch=8, ours_mib=100.0, compiled_mib=300.0, peer_mib=200.0,
               ours_gen_mib=10.0, compiled_gen_mib=40.0, peer_gen_mib=20.0)
    old = dict(shape="tiny", dtype="bf16", batch=8, ours_mib=50.0, peer_mib=200.0,
               ours_gen_mib=5.0, peer_gen_mib=20.0)          # a run without the compiled side
    text = generate_bench.render(dict(machine=info, command="cmd", repeats=1, new_tokens=4,
                                      bandwidth_gbs=10.0, results=[], memory=[row, old]))
    assert "| tiny | fp32 | 8 | 10 | 40 | 20 | 0.50 / 2.00 | 100 | 300 | 200 | 0.50 / 1.50 |" in text
    assert "| tiny | bf16 | 8 | 5 | - | 20 | 0.25 / - | 50 | - | 200 | 0.25 / - |" in text


def test_generate_bench_runs_both_of_our_sides():
    """bench.generate's runners call logitlab's generate as the library exposes it (eager and
    through the compiled decode step), so an API change breaks this test, not the benchmark."""
    from bench import generate as generate_bench
    from logitlab.generate import generate

    cfg = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=1, n_heads=2, norm="rmsnorm",
                      mlp="swiglu", positions="rope", bias=False)
    ours = Transformer(cfg).eval()
    prompts = torch.randint(0, 64, (2, 4))
    sides = generate_bench.runners(ours, None, prompts)
    result = sides["ours"](3)()
    assert [len(t) for t in result.tokens] == [3, 3]
    assert result.tokens == generate(ours, prompts.tolist(), generate_bench.SampleConfig(temperature=0,
                                                                                          max_new_tokens=3)).tokens
    assert callable(sides["compiled"](3))   # built with the compiled step (compiles on first call)


def test_command_line_shows_paths_outside_the_repository_by_their_last_part(monkeypatch):
    """A results file records the command as typed, except where a machine keeps its peers'
    clones: that says nothing to a reader, and the repository's paths stay as they are."""
    monkeypatch.setattr("sys.argv", ["/x/bench/nanogpt.py", "--nanogpt", "/home/me/src/nanoGPT", "--out",
                                     str(ROOT / "bench" / "results"), "--section", "On another machine"])
    assert command_line() == (f"python3 -m bench.nanogpt --nanogpt .../nanoGPT --out {ROOT / 'bench' / 'results'}"
                              " --section 'On another machine'")         # quoted as a shell needs it
