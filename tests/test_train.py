"""train.py: overfitting, exact resume (in process and after kill -9), NaN stop, signals, config errors."""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from logitlab.data import tokens as data
from logitlab.io.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.tokenizer.core import Tokenizer
from logitlab.train.loop import TrainConfig, TrainingDiverged, cross_entropy, cross_entropy_reference, train

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife.\n")


def byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])


def tiny_model(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=257, context_length=32, d_model=48, n_layers=2, n_heads=4, norm="rmsnorm",
               positions="rope", mlp="swiglu", d_ff=96, bias=False, dropout=0.1)
    cfg.update(kw)
    return Transformer(ModelConfig(**cfg))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("corpus")
    src = tmp / "docs"
    src.mkdir()
    for k in range(30):
        (src / f"{k:02d}.txt").write_text(f"{k}: {TEXT * (1 + k % 3)}")
    data.prepare_corpus([src], byte_tokenizer(), tmp / "prep", val_fraction=0.1, workers=1)
    return tmp / "prep"


def _cfg(corpus, out, **kw) -> TrainConfig:
    base = dict(data_dir=str(corpus), out_dir=str(out), steps=12, batch_size=4, seq_len=32, lr=3e-3,
                warmup_steps=2, eval_every=4, save_every=3, eval_tokens=256, device="cpu", precision="fp32",
                seed=5, keep_last=10)
    base.update(kw)
    return TrainConfig(**base)


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_cross_entropy_matches_reference():
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5))
    assert float(cross_entropy(logits, targets)) == pytest.approx(float(cross_entropy_reference(logits, targets)),
                                                                  rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cross_entropy_matches_f_cross_entropy(dtype):
    """The form a compiled graph runs (kernels.compiled.CrossEntropy), value and gradient, against F.cross_entropy
    on float32 logits; IGNORE_INDEX targets are left out of the mean, out-of-range ones fail."""
    from logitlab.train.loop import IGNORE_INDEX

    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).to(dtype)
    targets = torch.randint(0, 50, (3, 7))
    targets[0, :3] = IGNORE_INDEX
    compiled = torch.compile(cross_entropy, backend="aot_eager", fullgraph=True)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = compiled(a, targets)
    expected = F.cross_entropy(b.float().flatten(0, 1), targets.flatten())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    (got * 2.5).backward()
    (expected * 2.5).backward()
    assert a.grad.dtype == dtype
    assert torch.all(a.grad[0, :3] == 0)                        # ignored positions get no gradient
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(a.grad, b.grad, **tol)
    assert float(cross_entropy(logits, targets)) == pytest.approx(float(expected.detach()), rel=1e-6)  # eager agrees
    bad = targets.clone()
    bad[1, 2] = 50
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        compiled(logits, bad)


def test_tiny_model_overfits_short_text(tmp_path):
    src = tmp_path / "one.txt"
    src.write_text("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!\n")
    data.prepare_corpus([src], byte_tokenizer(), tmp_path / "prep", val_fraction=0.0, workers=1)
    model = tiny_model(dropout=0.0, context_length=64)
    cfg = _cfg(tmp_path / "prep", tmp_path / "run", steps=150, batch_size=8, seq_len=64, lr=1e-2,
               warmup_steps=10, eval_every=0, save_every=0, weight_decay=0.0, min_lr=1e-3)
    result = train(model, cfg)
    assert result.last_loss < 0.1, result.last_loss
    assert result.val_loss is None  # no validation documents
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["ckpt-000150"]


def _single_process_hooks():
    """Every ParallelHooks entry filled in as a one-process stand-in, so the hook paths run."""
    import contextlib

    from logitlab.train.loop import ParallelHooks
    from logitlab.train.optim import clip_grad_norm

    def load_state(wrapped, model_state, optimizer, optimizer_state):
        missing, unexpected = wrapped.load_state_dict(model_state, strict=False)
        assert missing == ["lm_head.weight"] or not missing and not unexpected
        optimizer.load_state_dict(optimizer_state)

    return ParallelHooks(wrap=lambda m: m, all_reduce=lambda v: v,
                         clip=lambda w, max_norm: clip_grad_norm(w.parameters(), max_norm),
                         model_state=lambda w: w.state_dict(), optimizer_state=lambda w, o: o.state_dict(),
                         load_state=load_state, barrier=lambda: None,
                         sync=lambda w, sync: contextlib.nullcontext())


@pytest.mark.parametrize("hooks", [None, "single-process hooks"])
def test_resume_equals_uninterrupted_bit_for_bit(corpus, tmp_path, hooks):
    par = _single_process_hooks() if hooks else None
    full = train(tiny_model(), _cfg(corpus, tmp_path / "full"), parallel=par)
    assert full.step == 12

    class Crash(Exception):
        pass

    def crash_after_6(event, record):
        if event == "checkpoint" and record["step"] == 6:
            raise Crash

    with pytest.raises(Crash):
        train(tiny_model(), _cfg(corpus, tmp_path / "part"), callback=crash_after_6, parallel=par)
    assert latest_checkpoint(tmp_path / "part").name == "ckpt-000006"
    resumed = train(tiny_model(seed=99), _cfg(corpus, tmp_path / "part"), resume=True, parallel=par)
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "part")
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert [a[s] for s in range(1, 13)] == [b[s] for s in range(1, 13)]  # exact float equality
    assert resumed.val_loss == full.val_loss
    first = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and abs(first["val_loss"] - math.log(257)) < 0.5  # untrained: about ln V
    ws_full = load_checkpoint(latest_checkpoint(tmp_path / "full"))
    assert ws_full["state"]["step"] == 12 and ws_full["state"]["sampler"]["index"] == 12


@pytest.mark.slow
def test_resume_after_kill_9_matches(corpus, tmp_path):
    run = tmp_path / "killed"
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        torch.set_num_threads({torch.get_num_threads()})
        from test_train import tiny_model, _cfg
        from logitlab.train.loop import train
        from pathlib import Path
        slow = lambda event, record: time.sleep(0.1) if event == "step" else None
        train(tiny_model(), _cfg(Path({str(corpus)!r}), Path({str(run)!r}), save_every=1, steps=20), callback=slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (run / "ckpt-000005").is_dir():
            assert proc.poll() is None, "training subprocess ended early"
            time.sleep(0.05)
        time.sleep(0.17)  # land somewhere inside a later step or save
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    ckpts = list_checkpoints(run)
    assert ckpts and ckpts[-1].name >= "ckpt-000005"
    for c in ckpts:  # every complete checkpoint loads
        load_checkpoint(c, tiny_model(), None)
    killed_at = load_checkpoint(ckpts[-1])["state"]["step"]
    assert killed_at < 20
    cfg_full = _cfg(corpus, tmp_path / "full", save_every=1, steps=20)
    train(tiny_model(), cfg_full)
    train(tiny_model(seed=3), _cfg(corpus, run, save_every=1, steps=20), resume=True)
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # half-written saves cleaned up
    a, b = _losses(tmp_path / "full"), _losses(run)
    assert [a[s] for s in range(1, 21)] == [b[s] for s in range(1, 21)]


def test_nan_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(corpus, tmp_path):
    model = tiny_model()

    def poison(event, record):
        if event == "step" and record["step"] == 3:
            with torch.no_grad():
                model.blocks[0].attn.qkv_proj.weight.fill_(float("nan"))

    with pytest.raises(TrainingDiverged, match="at step 4") as info:
        train(model, _cfg(corpus, tmp_path / "run", save_every=2), callback=poison)
    assert "ckpt-000002" in str(info.value)
    good = latest_checkpoint(tmp_path / "run")
    assert good.name == "ckpt-000002"
    fresh = tiny_model()
    load_checkpoint(good, fresh)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_sigterm_saves_a_checkpoint_and_returns(corpus, tmp_path):
    def term(event, record):
        if event == "step" and record["step"] == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    result = train(tiny_model(), _cfg(corpus, tmp_path / "run", save_every=0), callback=term)
    assert result.stopped == "signal" and result.step == 5
    assert latest_checkpoint(tmp_path / "run").name == "ckpt-000005"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_grad_accumulation_matches_one_big_batch(corpus, tmp_path):
    """batch 4 x accum 2 draws batches 0 and 1 of 4 rows; the same rows as one batch of 8 give
    the same mean gradient (up to float rounding)."""
    m1, m2 = tiny_model(dropout=0.0), tiny_model(dropout=0.0)
    s = data.RandomWindows(data.load_tokens(corpus, "train"), 32, 4, seed=1)
    (x1, y1), (x2, y2) = s.next(), s.next()
    for x, y in ((x1, y1), (x2, y2)):
        (cross_entropy(m1(x), y) / 2).backward()
    cross_entropy(m2(torch.cat([x1, x2])), torch.cat([y1, y2])).backward()
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-4, atol=1e-6)


def test_config_errors_come_first(corpus, tmp_path):
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(steps=5, warmup_steps=10)
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="context_length"):
        train(tiny_model(), _cfg(corpus, tmp_path / "r", seq_len=64))
    with pytest.raises(ValueError, match="attention='causal'.*mlm_loss"):    # an encoder would copy the target
        train(tiny_model(attention="bidirectional"), _cfg(corpus, tmp_path / "r"))
    assert not (tmp_path / "r").exists()
    with pytest.raises(FileNotFoundError, match="manifest"):
        train(tiny_model(), _cfg(tmp_path / "nowhere", tmp_path / "r"))
    train(tiny_model(), _cfg(corpus, tmp_path / "r2", steps=2, warmup_steps=1))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(tiny_model(), _cfg(corpus, tmp_path / "r2", steps=2, warmup_steps=1))


@pytest.mark.slow
def test_bf16_autocast_runs_and_validation_is_a_fixed_pass(corpus, tmp_path):
    from logitlab.train.loop import evaluate

    result = train(tiny_model(), _cfg(corpus, tmp_path / "bf16", steps=2, warmup_steps=1, precision="bf16"))
    assert result.last_loss is not None and result.last_loss == result.last_loss  # finite, not NaN
    model = tiny_model()
    val = data.load_tokens(corpus, "val")
    a = evaluate(model, val, 32, 4, 256, torch.device("cpu"))
    b = evaluate(model, val, 32, 4, 256, torch.device("cpu"))
    assert a == b and model.training  # same tokens, same number; training mode restored


@pytest.mark.slow
def test_bf16_matmul_mode_is_the_runs_and_is_restored(corpus, tmp_path):
    """TrainConfig.bf16_matmul holds during the run (installed into the model's layers) and the
    model's plain layers are back afterwards, also when the run fails; nothing process-wide."""
    from logitlab.kernels import cpu_bf16
    from logitlab.model.attention import Attention

    seen = []
    model = tiny_model()
    cfg = _cfg(corpus, tmp_path / "mm", steps=2, warmup_steps=0, precision="bf16", bf16_matmul="fp32")
    kinds = lambda: {type(m) for m in model.modules() if isinstance(m, (torch.nn.Linear, Attention))}  # noqa: E731
    routed = {cpu_bf16.Bf16ViaFp32Linear, cpu_bf16.Bf16ViaFp32Attention}
    train(model, cfg, callback=lambda event, record: seen.append((event, kinds(), record.get("bf16_route"))))
    assert seen[0] == ("start", routed, "fp32")
    assert {frozenset(k) for event, k, _ in seen if event != "end"} == {frozenset(routed)}
    assert kinds() == {torch.nn.Linear, Attention}
    # the routes are on the run's first step record in metrics.jsonl (fp32 asked for: nothing measured)
    records = [json.loads(line) for line in (tmp_path / "mm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps[0]["step"] == 1 and steps[0]["bf16_route"] == steps[0]["bf16_attention_route"] == "fp32"
    assert steps[0]["bf16_route_timings_s"] is None and all("bf16_route" not in r for r in steps[1:])

    def fail(event, record):
        if event == "step":
            raise RuntimeError("stop here")
    model = tiny_model()
    with pytest.raises(RuntimeError, match="stop here"):
        train(model, _cfg(corpus, tmp_path / "mm2", steps=1, warmup_steps=0, precision="bf16", bf16_matmul="fp32"),
              callback=fail)
    assert kinds() == {torch.nn.Linear, Attention}
    with pytest.raises(ValueError, match="bf16_matmul must be one of .*'bf16'"):
        TrainConfig(bf16_matmul="bf16")


def test_every_config_field_has_help():
    import dataclasses

    missing = [f.name for f in dataclasses.fields(TrainConfig) if not f.metadata.get("help")]
    assert not missing
    assert TrainConfig(steps=30).warmup_steps == 3 and TrainConfig(steps=5000).warmup_steps == 100


def test_time_limit_stops_after_the_step_that_passes_it(corpus, tmp_path):
    result = train(tiny_model(), _cfg(corpus, tmp_path / "t", steps=12, time_limit_s=1e-9, save_every=0))
    assert result.stopped == "time" and result.step == 1
    assert result.val_loss is not None and latest_checkpoint(tmp_path / "t").name == "ckpt-000001"


def test_runtime_choices_and_rng_round_trip():
    import random

    import numpy as np

    from logitlab.model import accounting
    from logitlab.train import runtime

    assert runtime.pick_device("cpu").type == "cpu"
    assert runtime.autocast_dtype(torch.device("cpu"), "auto") is None
    assert runtime.autocast_dtype(torch.device("cpu"), "bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        runtime.autocast_dtype(torch.device("cpu"), "fp8")
    runtime.seed_everything(4)
    state = runtime.capture_rng_state()
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    runtime.seed_everything(5)
    runtime.restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    peak = accounting.matmul_peak_flops(torch.device("cpu"), size=128)
    assert peak > 1e6


_FAULTS_SCRIPT = """
import resource, sys, torch
from logitlab.kernels import allocator
applied = allocator.keep_freed_memory() if sys.argv[1] == "keep" else None
for _ in range(10):                     # like training steps: the same large tensors, freed and made again
    torch.ones(16 << 20)                # 64 MiB, every page written
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(16 << 20)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_keep_freed_memory_stops_the_page_faults_of_reallocation(monkeypatch):
    """Without it, glibc maps a 64 MiB block afresh at each allocation and unmaps it when freed,
    so every page faults again (16 thousand per allocation); with it, after the first few
    allocations (see keep_freed_memory), freed blocks are reused. Each case runs in a process of
    its own, since the setting cannot be undone."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)

    def faults(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
        return out[0], int(out[1])

    applied, kept = faults("keep")
    assert applied == "True" and kept < 1000, kept
    assert faults("default")[1] > 5 * 8000        # 5 x 64 MiB in 4 KiB pages is 82 thousand


def test_keep_freed_memory_leaves_the_users_own_malloc_settings(monkeypatch):
    from logitlab.kernels import allocator

    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.setenv(name, "65536")
        assert allocator.keep_freed_memory() is False
        monkeypatch.delenv(name)


def test_fault_watch_keeps_freed_memory_where_page_faults_cost(monkeypatch):
    from logitlab.kernels import allocator

    def watch(system_per_step, threshold=0.05):
        clock = {"user": 0.0, "system": 0.0}

        def times():   # each read is one more step's CPU time: 1 s user + system_per_step
            clock["user"] += 1.0
            clock["system"] += system_per_step
            return clock["user"], clock["system"]
        monkeypatch.setattr(allocator.FaultWatch, "_times", staticmethod(times))
        applied = []
        w = allocator.FaultWatch(skip=1, measure=2, threshold=threshold, apply=lambda: applied.append(1) or True)
        return w, applied

    w, applied = watch(0.25)                      # 1 s user + 0.25 s system per read: share 0.2
    assert [w.after_step() for _ in range(2)] == [None, None] and applied == []
    assert w.after_step() == {"keep_freed_memory": True, "system_time_share": 0.2} and applied == [1]
    assert w.after_step() is None and applied == [1]          # decided once
    w, applied = watch(0.01)                      # share ~0.01: below the threshold, nothing applied
    decisions = [w.after_step() for _ in range(3)]
    assert decisions[-1] == {"keep_freed_memory": False, "system_time_share": 0.0099} and applied == []
    with pytest.raises(ValueError, match="measure=0"):
        allocator.FaultWatch(measure=0)


@pytest.mark.slow
def test_train_keeps_freed_memory_when_measured_or_told_to(corpus, tmp_path, monkeypatch):
    import logitlab.kernels.allocator as allocator_mod

    calls = []
    monkeypatch.setattr(allocator_mod, "keep_freed_memory", lambda: calls.append(1) or True)
    share = {"system": 0.5}   # system seconds per user second the watched steps report

    def times():
        times.user = getattr(times, "user", 0.0) + 1.0
        return times.user, times.user * share["system"]
    monkeypatch.setattr(allocator_mod.FaultWatch, "_times", staticmethod(times))
    for k, (keep, compiled, precision, system, expected) in enumerate(
            [("auto", False, "fp32", 0.5, 0), ("auto", True, "fp32", 0.5, 1), ("auto", True, "fp32", 0.0, 0),
             ("auto", True, "bf16", 0.5, 0), ("on", False, "fp32", 0.0, 1), ("on", True, "bf16", 0.0, 1),
             ("off", True, "fp32", 0.5, 0)]):
        calls.clear()
        share["system"] = system
        run_dir = tmp_path / f"k{k}"
        train(tiny_model(), _cfg(corpus, run_dir, steps=3, warmup_steps=0, eval_every=0, log_every=100,
                                 keep_freed_memory=keep, compile=compiled, precision=precision))
        assert len(calls) == expected, (keep, compiled, precision, system)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        measured = [r for r in records if "keep_freed_memory" in r]
        if keep == "auto" and compiled and precision == "fp32":   # the decision is in the metrics, at step 3
            assert [(r["step"], r["keep_freed_memory"]) for r in measured] == [(3, bool(expected))]
        else:
            assert measured == []
    with pytest.raises(ValueError, match="keep_freed_memory must be 'auto', 'on' or 'off', got True"):
        TrainConfig(keep_freed_memory=True)


def test_tensorboard_writer_gets_the_scalars(corpus, tmp_path, monkeypatch):
    import logitlab.train.loop as train_mod

    written = []

    class FakeWriter:
        def add_scalar(self, key, value, step):
            written.append((key, step))

        def close(self):
            written.append(("closed", -1))

    monkeypatch.setattr(train_mod, "_tensorboard_writer", lambda run_dir: FakeWriter())
    train(tiny_model(), _cfg(corpus, tmp_path / "tb", steps=4, warmup_steps=1))
    assert ("loss", 1) in written and ("val_loss", 4) in written and ("mfu", 4) in written
    assert written[-1] == ("closed", -1)


@pytest.mark.slow
def test_torch_compile_matches_eager(corpus, tmp_path):
    eager = train(tiny_model(dropout=0.0), _cfg(corpus, tmp_path / "e", steps=3, warmup_steps=1))
    compiled = train(tiny_model(dropout=0.0), _cfg(corpus, tmp_path / "c", steps=3, warmup_steps=1, compile=True))
    assert compiled.last_loss == pytest.approx(eager.last_loss, rel=1e-4)


def test_fastest_thread_count_keeps_the_faster_setting():
    from logitlab.train import runtime

    before = torch.get_num_threads()
    calls = []

    def step():
        calls.append(torch.get_num_threads())
        time.sleep(0.002 if torch.get_num_threads() == 1 else 0.02)

    try:
        threads, seconds = runtime.fastest_thread_count(step, candidates=(2, 1), repeats=2)
        assert threads == 1 and torch.get_num_threads() == 1 and 0.002 <= seconds < 0.02
        assert calls == [2, 2, 2, 1, 1, 1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("fullgraph", [True, False])
def test_loss_fn_compiled_equals_eager_in_loss_and_gradients(fullgraph):
    """train.loss_fn traces the model and the loss as one graph (aot_eager here: the same graph
    without inductor); loss and every gradient equal the eager loss_fn's."""
    from logitlab.train.loop import loss_fn

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    model = Transformer(cfg)
    ids, targets = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))
    eager = loss_fn(model)(ids, targets)
    assert torch.equal(eager, cross_entropy(model(ids), targets))
    eager.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = loss_fn(model, "aot_eager", fullgraph=fullgraph)(ids, targets)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    compiled.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


def _gradients(model, ids, targets, compile_fn=None) -> dict:
    model.zero_grad(set_to_none=True)
    loss = (compile_fn or (lambda f: f))(lambda i, t: cross_entropy(model(i), t))(ids, targets)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embedding_pass_sums_the_lookup_rows_into_the_heads_gradient(tied):
    """kernels.graph_passes.TiedEmbeddingGrad on the backward graph inductor would get (its
    decompositions, run here without inductor): the tied table's gradient sum is rewritten once
    (nothing in an untied model), and every gradient equals eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from logitlab.kernels.graph_passes import TiedEmbeddingGrad

    torch.manual_seed(0)
    model = tiny_model(dropout=0.0, tie_embeddings=tied)
    ids = torch.randint(0, 257, (2, 12))
    ids[0, :4] = ids[1, 5]                                      # one row looked up five times
    targets = torch.randint(0, 257, (2, 12))
    passes = []

    def backward(gm, _):
        passes.append(TiedEmbeddingGrad())
        passes[-1](gm.graph)
        gm.graph.lint()
        gm.recompile()
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward,
                           decompositions=select_decomp_table())
    got = _gradients(model, ids, targets, lambda f: torch.compile(f, backend=backend, fullgraph=True))
    assert [p.rewritten for p in passes] == [1 if tied else 0]
    want = _gradients(model, ids, targets)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
def test_loss_fn_with_inductor_sums_a_tied_tables_gradient_in_place(monkeypatch):
    """train.loss_fn(model, True): inductor with graph_passes.training_options (the tied-embedding pass, which
    rewrites the backward graph); the gradients equal eager's, the tied table's too."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()     # the loss function's code compiled by earlier tests counts against the recompile limit

    from logitlab.kernels import graph_passes
    from logitlab.train import loss as loss_module

    handed, build = [], graph_passes.training_options

    def options():
        handed.append(build())
        return handed[-1]

    monkeypatch.setattr(graph_passes, "training_options", options)
    torch.manual_seed(0)
    model = tiny_model(dropout=0.0, tie_embeddings=True)
    ids, targets = torch.randint(0, 257, (2, 12)), torch.randint(0, 257, (2, 12))
    want = _gradients(model, ids, targets)
    model.zero_grad(set_to_none=True)
    with inductor_config.patch(fx_graph_cache=False):   # compiled here, not served from a cache
        loss_module.loss_fn(model, True)(ids, targets).backward()
    assert handed[0]["post_grad_custom_pre_pass"].rewritten == 1   # its last call: the backward graph
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


# -------------------- the default learning rate and the time budget

def test_default_lr_follows_the_models_size():
    from logitlab.model.families import get_preset
    from logitlab.train.config import LARGE_MODEL_LR, SMALL_MODEL_LR, default_lr

    assert TrainConfig().lr is None
    assert TrainConfig().for_model(tiny_model()).lr == SMALL_MODEL_LR == 3e-3
    for name in ("tiny", "gpt2-tiny", "small"):
        with torch.device("meta"):
            assert TrainConfig().for_model(Transformer(get_preset(name))).lr == 3e-3, name
    with torch.device("meta"):
        assert TrainConfig().for_model(Transformer(get_preset("gpt2"))).lr == LARGE_MODEL_LR == 3e-4
    assert TrainConfig(lr=1e-3).for_model(tiny_model()).lr == 1e-3       # a given rate is kept
    assert default_lr(49_999_999) == 3e-3 and default_lr(50_000_000) == 3e-4
    with pytest.raises(ValueError, match="for_model"):
        TrainConfig().schedule()
    with pytest.raises(ValueError, match="min_lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)


def test_train_resolves_and_records_the_default_lr(corpus, tmp_path):
    result = train(tiny_model(), _cfg(corpus, tmp_path / "r", lr=None, steps=2, warmup_steps=1))
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["train"]["lr"] == 3e-3 and result.step == 2
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert max(m["lr"] for m in metrics if "lr" in m) == pytest.approx(3e-3)


def test_fit_steps_to_budget_fits_steps_and_evaluations():
    from logitlab.train.budget import PLANNED_SHARE, fit_steps_to_budget

    fit = fit_steps_to_budget(100.0, 0.1)                                # no evaluation cost
    assert fit.steps == int(PLANNED_SHARE * 100 / 0.1) and fit.eval_every == -(-fit.steps // 10)
    fit = fit_steps_to_budget(100.0, 0.1, 1.0)                           # 10 evaluations + the final one
    assert fit.steps == int((90 - 11) / 0.1) and fit.planned_s <= 90 + 1e-9
    short = fit_steps_to_budget(60.0, 2.0, 1.0)                          # few steps: still at most 10 evaluations
    assert short.steps // short.eval_every <= 10 and short.planned_s <= 54 + 1e-9
    fit = fit_steps_to_budget(100.0, 0.1, 1.0, eval_every=50)
    assert fit.eval_every == 50 and fit.planned_s <= 90 + 1e-9
    assert fit.steps == int((90 - 1) / (0.1 + 1 / 50))                  # each step carries 1/50 of an evaluation
    assert fit_steps_to_budget(100.0, 0.1, eval_every=0).steps == 900
    assert fit_steps_to_budget(100.0, 0.1, max_steps=40).steps == 40
    assert fit_steps_to_budget(1.0, 10.0, min_steps=5).steps == 5       # a budget too short: the minimum
    for bad in (dict(budget_s=0, step_s=1), dict(budget_s=1, step_s=-1), dict(budget_s=1, step_s=1, eval_s=-1)):
        with pytest.raises(ValueError):
            fit_steps_to_budget(**bad)


def test_time_training_step_leaves_the_model_as_it_was():
    from logitlab.train.budget import time_training_step

    model = tiny_model().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    threads, seconds = time_training_step(model, 2, 16, repeats=1)
    assert threads == torch.get_num_threads() and seconds > 0
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_muon_seconds_time_the_updates_of_the_hidden_matrices_only(monkeypatch):
    from logitlab.train import budget, muon

    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    real = muon.muon_update
    monkeypatch.setattr(muon, "muon_update", lambda grad, buf, **kw: seen.append((tuple(grad.shape), kw["blocks"]))
                        or real(grad, buf, **kw))
    assert budget.muon_seconds(model, ns_steps=2, repeats=1) > 0
    matrices = {n: tuple(p.shape) for n, p in model.named_parameters()
                if p.ndim == 2 and not n.startswith(("tok_emb", "lm_head"))}
    assert sorted(s for s, _ in seen) == sorted(matrices.values())          # no embedding, no vector
    qkv = [b for s, b in seen if b is not None and len(b) == 3]
    assert len(qkv) == model.config.n_layers                                # q | k | v apart, as the optimizer does
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
