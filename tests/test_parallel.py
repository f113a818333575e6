"""Distributed training on CPU with gloo: 2 processes must train exactly like 1.

One torchrun launch (2 ranks) runs every two-process scenario of tests/_dist_worker.py; the
single-process reference runs in this process with the same code. Scenarios:
ddp / fsdp: 2 ranks x 4 rows vs 1 process x 8 rows, same loss sequence (fp32, 1e-5);
*_accum: 2 micro-steps per step with the gradient sync skipped on the first;
ckpt_*: saved by 2 ranks after 3 steps, resumed here in 1 process; *_resume: the reverse.
Every rank of that launch also checks, after parallel.destroy(), that only its main thread is
left (see _dist_worker.main), so a teardown that leaves gloo's threads running fails here.

Nothing here assumes a fast machine: torchrun --standalone picks its own free port, the
directly launched pairs retry on a port taken in the meantime, and the time limits only bound
a hang (a timed-out launch is killed with every process it started).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import _dist
import _dist_worker as worker
import pytest
import torch

from logitlab import parallel

WORKER = Path(worker.__file__)
TWO_RANK_SCENARIOS = ("ddp", "ddp_accum", "fsdp", "fsdp_accum", "ddp_resume", "fsdp_resume", "train_ddp")
if worker.train_has_parallel_field():
    TWO_RANK_SCENARIOS += ("train_fsdp",)
NO_FSDP_IN_TRAIN = ("logitlab.train has no TrainConfig.parallel field: its rank/wrap/all_reduce hooks carry "
                    "DDP only (FSDP2 needs the optimizer built after wrapping and every rank in the "
                    "checkpoint gather)")
TOL = 1e-5


def _run(cmd: list[str]):
    return _dist.run(cmd)


def _torchrun(out: Path, scenarios) -> None:
    _dist.torchrun(2, str(WORKER), str(out), *scenarios)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Results of the single-process reference (key "none") and of every 2-rank scenario."""
    out = tmp_path_factory.mktemp("dist")
    info = parallel.init_distributed()
    assert info.world_size == 1
    results = {"none": worker.run("none", out, info), "out": out}  # also writes ckpt_none
    _prepare_corpus(out / "prep")
    worker.run_train_loop(out, "none", info)  # writes OUT/run_none
    _torchrun(out, TWO_RANK_SCENARIOS)
    for name in TWO_RANK_SCENARIOS:
        if name.startswith("train_"):
            continue
        results[name] = json.loads((out / f"{name}.json").read_text())
        assert results[name]["world_size"] == 2
    return results


def _prepare_corpus(directory: Path) -> None:
    from logitlab.data import tokens as data
    from logitlab.tokenizer.core import Tokenizer

    docs = directory.parent / "docs"
    docs.mkdir()
    for k in range(24):
        text = "the quick brown fox jumps over the lazy dog. " * (2 + k % 3)
        (docs / f"{k:02d}.txt").write_text(f"{k}: {text}")
    byte_tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])
    data.prepare_corpus([docs], byte_tokenizer, directory, val_fraction=0.2, workers=1)


def _metrics(run_dir: Path) -> list[dict]:
    """The training-step records of RUN/metrics.jsonl (those with a loss)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _val_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r]


def _close(a: list[float], b: list[float], tol: float = TOL) -> None:
    assert len(a) == len(b), (a, b)
    diffs = [abs(x - y) for x, y in zip(a, b)]
    assert max(diffs) <= tol, f"max difference {max(diffs):.3g} > {tol}: {a} vs {b}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process_with_twice_the_batch(runs, mode):
    ref = runs["none"]
    _close(runs[mode]["losses"], ref["losses"])
    _close(runs[mode]["norms"], ref["norms"])  # clipping sees the global gradient norm
    assert ref["losses"][-1] < ref["losses"][0] and len(set(ref["losses"])) == worker.STEPS


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_grad_accumulation_with_skipped_sync_matches(runs, mode):
    result = runs[f"{mode}_accum"]
    _close(result["losses"], runs["none"]["losses"])
    _close(result["norms"], runs["none"]["norms"])
    # gradients crossed ranks on every final micro-step and on no other
    assert (result["early_syncs"], result["final_syncs"]) == (0, worker.STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_checkpoint_saved_by_two_ranks_resumes_in_one(runs, mode):
    ckpt = runs["out"] / f"ckpt_{mode}"
    # dot files are the writer's own bookkeeping (what it wrote), not checkpoint contents
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
           ["model.safetensors", "optimizer.pt"]
    assert not [p for p in ckpt.parent.iterdir() if ".tmp-" in p.name]  # atomic: nothing left over
    model = worker.tiny_model()
    optimizer = worker.make_optimizer(model)
    worker.load(model, optimizer, ckpt)
    resumed = worker.train(model, optimizer, parallel.DistInfo(), range(worker.RESUME_AT, worker.STEPS))
    _close(resumed["losses"], runs["none"]["losses"][worker.RESUME_AT:])


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_checkpoint_saved_by_one_process_resumes_in_two_ranks(runs, mode):
    _close(runs[f"{mode}_resume"]["losses"], runs["none"]["losses"][worker.RESUME_AT:])


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_gathered_optimizer_state_has_the_single_process_layout(runs, mode):
    single = torch.load(runs["out"] / "ckpt_none" / "optimizer.pt", weights_only=True)
    gathered = torch.load(runs["out"] / f"ckpt_{mode}" / "optimizer.pt", weights_only=True)
    assert [g["params"] for g in gathered["param_groups"]] == [g["params"] for g in single["param_groups"]]
    assert sorted(gathered["state"]) == sorted(single["state"])
    for i, state in single["state"].items():
        assert {k: tuple(v.shape) for k, v in gathered["state"][i].items()} == \
               {k: tuple(v.shape) for k, v in state.items()}, f"parameter {i}"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_train_loop_on_two_ranks_matches_one_process(runs, mode):
    """logitlab.train.train distributed by parallel.py: the same losses, grad norms and
    validation losses on 2 ranks (global batch 8 = 4 rows x 2 ranks, 2 micro-steps) as in 1."""
    if mode == "fsdp" and not worker.train_has_parallel_field():
        pytest.skip(NO_FSDP_IN_TRAIN)
    one, two = _metrics(runs["out"] / "run_none"), _metrics(runs["out"] / f"run_{mode}")
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, worker.STEPS + 1))
    for key in ("loss", "grad_norm"):
        _close([r[key] for r in two], [r[key] for r in one])
    one_val, two_val = _val_losses(runs["out"] / "run_none"), _val_losses(runs["out"] / f"run_{mode}")
    assert len(one_val) >= 2
    _close(two_val, one_val)
    assert not (runs["out"] / f"run_{mode}" / "tensorboard").exists()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_train_loop_checkpoint_from_two_ranks_resumes_in_one(runs, tmp_path, mode):
    """A run saved by 2 ranks through train.py continues in 1 process with the same losses."""
    import shutil

    from logitlab.train.loop import train

    if mode == "fsdp" and not worker.train_has_parallel_field():
        pytest.skip(NO_FSDP_IN_TRAIN)
    run = tmp_path / f"run_{mode}"
    shutil.copytree(runs["out"] / f"run_{mode}", run)
    shutil.rmtree(run / f"ckpt-{worker.STEPS:06d}")  # as if the job died after step RESUME_AT
    shutil.copytree(runs["out"] / "prep", tmp_path / "prep")
    config = worker.train_config(tmp_path, mode)
    if worker.train_has_parallel_field():
        config = dataclasses.replace(config, parallel="none")
    train(worker.tiny_model(vocab_size=257), config, resume=True)
    _close([r["loss"] for r in _metrics(run)], [r["loss"] for r in _metrics(runs["out"] / "run_none")])


@pytest.mark.slow
def test_torchrun_cli_with_fsdp_matches_one_process(tmp_path):
    """`torchrun --nproc_per_node 2 -m logitlab train --parallel fsdp` against `logitlab train`."""
    if not worker.train_has_parallel_field():
        pytest.skip(NO_FSDP_IN_TRAIN)
    _prepare_corpus(tmp_path / "prep")
    flags = ["train", "--data-dir", str(tmp_path / "prep"), "--steps", "6", "--batch-size", "8",
             "--grad-accum", "2", "--seq-len", "32", "--context-length", "32", "--d-model", "32",
             "--n-layers", "2", "--n-heads", "4", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "3",
             "--eval-tokens", "512", "--device", "cpu", "--precision", "fp32", "--tensorboard", "false",
             "--progress", "false"]
    one = _run([sys.executable, "-m", "logitlab", *flags, "--out-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "logitlab", *flags, "--out-dir", str(tmp_path / "two"), "--parallel", "fsdp"])
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("done: 6 steps") == 1  # only rank 0 prints
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    _close([r["loss"] for r in b], [r["loss"] for r in a])
    _close(_val_losses(tmp_path / "two"), _val_losses(tmp_path / "one"))


def _run_pair(tmp_path: Path, scenario: str, timeout_s: float, deadline_s: float):
    return _dist.run_pair(WORKER, [str(tmp_path), scenario], timeout_s, deadline_s)


@pytest.mark.slow
def test_killed_rank_stops_the_survivor_with_a_clear_error(tmp_path):
    # a collective timeout far beyond the deadline: the survivor must notice the dead peer
    # itself (a closed connection), not by waiting out the timeout
    procs, code, err = _run_pair(tmp_path, "die", timeout_s=3600, deadline_s=_dist.LAUNCH_TIMEOUT_S)
    assert procs[1].returncode == -9
    assert code != 0
    assert "RankFailureError: rank 0 of 2" in err and "another rank crashed, was killed" in err, err[-2000:]
    assert "Timed out" not in err and "finished without noticing" not in err


@pytest.mark.slow
def test_silent_rank_makes_the_survivor_give_up_after_the_timeout(tmp_path):
    procs, code, err = _run_pair(tmp_path, "hang", timeout_s=10, deadline_s=_dist.LAUNCH_TIMEOUT_S)
    assert code != 0 and "RankFailureError: rank 0 of 2" in err and "10 s timeout" in err, err[-2000:]
    assert "Timed out" in err
    assert "a collective operation failed (all_reduce, called from _dist_worker.py:" in err, err[-2000:]
    assert " in hang)" in err or " in hang, called from" in err   # the collective and the line that entered it


def test_teardown_check_sees_threads_left_running():
    """The workers' own check (run after parallel.destroy() on every rank) names a thread
    that is still alive, by its Python name and, on Linux, among the native threads."""
    def native(names: list[str]) -> int:
        return sum(name.startswith("native:") for name in names)

    before = worker.leftover_threads()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running")
    thread.start()
    try:
        during = worker.leftover_threads()
    finally:
        stop.set()
        thread.join()
    assert "python:left-running" in during and "python:left-running" not in worker.leftover_threads()
    if Path("/proc/self/task").is_dir():
        assert native(during) == native(before) + 1, (before, during)
        deadline = time.monotonic() + 30  # a joined thread leaves /proc a moment later
        while native(worker.leftover_threads()) > native(before) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert native(worker.leftover_threads()) == native(before), (before, worker.leftover_threads())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL + bf16 FSDP2 needs 2 CUDA devices; "
                    "CPU/gloo runs FSDP2 in fp32 only (bf16 mixed precision is used on CUDA only)")
def test_fsdp_bf16_on_two_gpus(tmp_path):  # pragma: no cover - no GPU on the CPU test machines
    ref = worker.run("none", tmp_path, parallel.DistInfo())
    _torchrun(tmp_path, ["fsdp_bf16"])
    got = json.loads((tmp_path / "fsdp_bf16.json").read_text())
    _close(got["losses"], ref["losses"], tol=3e-2)


# --------------------------------------------------------------------------------------------
# Single-process behaviour: no launcher, no process group
# --------------------------------------------------------------------------------------------

def test_rank_slices_cover_the_global_batch_once_for_any_world_size():
    rows = torch.arange(24)
    for world in (1, 2, 3, 4):
        for accum in (1, 2):
            if 24 % (world * accum):
                continue
            parts = [parallel.shard_for_rank(rows, parallel.DistInfo(rank=r, world_size=world), k, accum)
                     for k in range(accum) for r in range(world)]
            assert torch.equal(torch.cat(parts), rows), (world, accum)
    # W = 2: rank r takes rows r*b:(r+1)*b of the 2b-row global batch
    assert parallel.shard_for_rank(list(range(8)), parallel.DistInfo(rank=1, world_size=2)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"grad_accum \(1\) x world_size \(3\)"):
        parallel.rank_slice(8, parallel.DistInfo(rank=0, world_size=3))
    with pytest.raises(ValueError, match="micro_step"):
        parallel.rank_slice(8, parallel.DistInfo(), micro_step=2, grad_accum=2)


def test_plan_grad_accum_keeps_the_global_batch():
    assert [parallel.plan_grad_accum(64, 8, w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match=r"global_batch \(64\) must be divisible by micro_batch \(8\) "
                                         r"x world_size \(3\)"):
        parallel.plan_grad_accum(64, 8, 3)
    with pytest.raises(ValueError, match="micro_batch"):
        parallel.plan_grad_accum(64, 0, 1)


def test_plain_process_is_rank_zero_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = parallel.init_distributed()
    assert (info.rank, info.world_size, info.is_main, info.backend) == (0, 1, True, None)
    assert not torch.distributed.is_initialized()
    x = torch.tensor([1.0, 3.0])
    assert torch.equal(parallel.all_reduce_mean(x), x)
    assert parallel.all_reduce_mean(2.5) == 2.5 and isinstance(parallel.all_reduce_mean(1), float)
    with pytest.raises(ValueError, match="timeout_s"):
        parallel.init_distributed(timeout_s=0)


def test_incomplete_launcher_environment_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=r"\['MASTER_ADDR', 'MASTER_PORT'\] not set"):
        parallel.init_distributed()


def test_is_main_process_reads_the_launchers_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert not parallel.is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert parallel.is_main_process()


def test_wrap_model_rejects_bad_modes():
    model = torch.nn.Linear(2, 2)
    assert parallel.wrap_model(model, "none") is model
    with pytest.raises(ValueError, match="must be one of"):
        parallel.wrap_model(model, "zero3")
    with pytest.raises(ValueError, match="needs a process group"):
        parallel.wrap_model(model, "ddp")
    with pytest.raises(ValueError, match="2 unrelated copies"):
        parallel.wrap_model(model, "none", info=parallel.DistInfo(rank=0, world_size=2))
    assert not parallel.fsdp_bf16_supported(torch.device("cpu"))


def test_single_process_state_dicts_and_tied_weights_round_trip():
    model = worker.tiny_model()
    state = parallel.full_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    stored = {k: v.clone() for k, v in state.items() if k != "lm_head.weight"}  # tied: stored once
    other = worker.tiny_model()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    parallel.load_full_state_dict(other, stored)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    assert other.lm_head.weight is other.tok_emb.weight
    assert parallel.unwrap(model) is model


def test_clip_grad_norm_returns_the_norm_before_clipping():
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model(torch.ones(1, 4)).sum().backward()  # grad = ones(1, 4): norm 2
    assert parallel.clip_grad_norm(model, 0.0) == pytest.approx(2.0)  # measure only
    assert torch.equal(model.weight.grad, torch.ones(1, 4))
    assert parallel.clip_grad_norm(model, 1.0) == pytest.approx(2.0)
    assert float(model.weight.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    assert parallel.clip_grad_norm(torch.nn.Linear(2, 2), 1.0) == 0.0  # no gradients yet


def test_sync_gradients_is_a_no_op_for_a_plain_model():
    model = torch.nn.Linear(3, 1)
    with parallel.sync_gradients(model, sync=False):
        model(torch.ones(2, 3)).sum().backward()
    assert model.weight.grad is not None


def test_rank_failure_guard_converts_backend_errors_only():
    with pytest.raises(parallel.RankFailureError, match="rank 0 of 1: a collective operation failed"):
        with parallel.rank_failure_guard(parallel.DistInfo()):
            raise torch.distributed.DistBackendError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        with parallel.rank_failure_guard(parallel.DistInfo()):
            raise RuntimeError("shape mismatch")


def test_rank_failure_names_the_collective_and_the_line_that_called_it():
    """A timed-out collective names itself and the caller's line, from the traceback: the
    innermost torch.distributed function and the innermost frame outside torch before it."""
    import os

    fake_c10d = os.path.join(os.sep, "site-packages", "torch", "distributed", "distributed_c10d.py")
    namespace = {"DistBackendError": torch.distributed.DistBackendError}
    exec(compile("def all_reduce(tensor):\n    raise DistBackendError('Timed out waiting 10000ms for recv')\n",
                 fake_c10d, "exec"), namespace)

    def evaluate():
        namespace["all_reduce"](torch.ones(()))

    with pytest.raises(parallel.RankFailureError, match=r"rank 0 of 1: a collective operation failed \(all_reduce, "
                       r"called from test_parallel\.py:\d+ in evaluate, called from test_parallel\.py:\d+ in "
                       r"test_rank_failure_names_the_collective_and_the_line_that_called_it\), so another rank .* "
                       r"Timed out waiting"):
        with parallel.rank_failure_guard(parallel.DistInfo()):
            evaluate()
    try:
        raise torch.distributed.DistBackendError("Connection closed by peer")
    except torch.distributed.DistBackendError as exc:
        assert parallel.setup.failed_collective(exc) is None      # raised outside torch.distributed: no name


def test_a_rank_sees_its_launcher_die_by_its_parent_process_id(monkeypatch):
    """An orphan is adopted (its parent id changes); only ranks that torchrun started watch for it,
    so a plain process whose shell exits (nohup) goes on."""
    from logitlab.parallel import setup
    from logitlab.train.hooks import ParallelHooks
    from logitlab.train.layouts import _watching

    monkeypatch.setitem(setup._STATE, "parent", 4242)
    monkeypatch.setattr(setup.os, "getppid", lambda: 4242)
    assert not setup.launcher_gone()
    monkeypatch.setattr(setup.os, "getppid", lambda: 1)          # adopted by init: the launcher is gone
    assert setup.launcher_gone()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not setup.launched_by_torchrun() and _watching(ParallelHooks()).launcher_gone is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert _watching(ParallelHooks()).launcher_gone is setup.launcher_gone
