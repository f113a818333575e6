"""Parallel runs that must not hang: shapes that do not divide the ranks, and a dead launcher.

FSDP, ZeRO-1/2, DDP and HSDP train a model whose vocabulary (263 ids, unpadded) and layer count
(3) divide neither 2 nor 4 ranks, through the main loop with the hooks `logitlab train` gets,
and evaluate a validation set of 33 windows, which the ranks hold unevenly (an FSDP rank
that evaluated one batch fewer used to leave the others waiting in the weights' all-gather
until the timeout): every loss and validation loss equals one process's. A collective timeout
of 120 s (LOGITLAB_TEST_TIMEOUT_S) makes a hang fail the test rather than wait out the
launcher's limit. When torchrun's launcher is killed with SIGKILL, its ranks stop at the next
step boundary with a checkpoint. Every torchrun launch is slow (10-60 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import _dist
import _dist_nd as nd
import _dist_shapes as shapes
import pytest

from logitlab.io import checkpoint as ckpt_io
from logitlab.io.files import RunLock

TOL = 1e-5
TWO = ("ddp", "fsdp", "zero1", "zero2", "dp_shard_2")
FOUR = ("fsdp_4", "hsdp", "zero2_4", "runner_hsdp")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """The corpus and the one-process reference run (OUT/run_one)."""
    out = tmp_path_factory.mktemp("shapes")
    nd.prepare_corpus(out / "prep")
    shapes.run("one", out)
    return out


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _series(run: Path, key: str) -> list[float]:
    return [r[key] for r in _records(run) if key in r]


def _matches_one_process(out: Path, name: str) -> None:
    for key in ("loss", "val_loss"):
        got, want = _series(out / f"run_{name}", key), _series(out / "run_one", key)
        assert len(got) == len(want) > 1, (name, key, got, want)
        assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, (name, key, got, want)


def _launch(out: Path, nproc: int, scenarios) -> None:
    proc = _dist.run(_dist.torchrun_cmd(nproc, str(Path(shapes.__file__)), str(out), *scenarios),
                     LOGITLAB_TEST_TIMEOUT_S="120")
    assert proc.returncode == 0, proc.stderr[-6000:]


def test_the_validation_set_is_uneven_over_the_ranks():
    assert shapes.WINDOWS % 2 and shapes.WINDOWS % 4 != 2   # 17 + 16 windows; 9 + 8 + 8 + 8 (HSDP's shard pairs differ)


@pytest.mark.slow
def test_two_ranks_train_awkward_shapes_like_one_process(out):
    _launch(out, 2, TWO)
    for name in TWO:
        _matches_one_process(out, name)
    assert sorted(p.name for p in (out / "run_zero1").glob("dcp-*")) == ["dcp-000002", "dcp-000004"]


@pytest.mark.slow
def test_four_ranks_fsdp_zero2_and_hsdp_train_awkward_shapes_like_one_process(out):
    """HSDP (2 replicas of 2 shards) trains several steps, from the loop's hooks and from
    train_parallel, as plain FSDP over 4 ranks and ZeRO-2 do: the losses of one process."""
    _launch(out, 4, FOUR)
    for name in FOUR:
        _matches_one_process(out, name)


# -- a launcher killed with SIGKILL ---------------------------------------------------------------

def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit status goes to whichever process adopted it)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the ranks through Linux's /proc")
def test_ranks_stop_with_a_checkpoint_when_their_launcher_is_killed(out, tmp_path):
    run, steps = tmp_path / "run", 100_000   # hours of steps: a rank that goes on never ends in time
    flags = ["train", "--data-dir", str(out / "prep"), "--vocab-size", "263", "--vocab-pad-multiple", "1",
             "--context-length", "16", "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--steps", str(steps),
             "--batch-size", "4", "--seq-len", "16", "--eval-every", "0", "--eval-tokens", "64", "--save-every", "3",
             "--device", "cpu", "--tensorboard", "false", "--progress", "false", "--parallel", "fsdp",
             "--out-dir", str(run)]
    with open(tmp_path / "log", "w") as log:
        launcher = subprocess.Popen(_dist.torchrun_cmd(2, "-m", "logitlab", *flags), env=_dist.env(), stdout=log,
                                    stderr=subprocess.STDOUT, cwd=_dist.ROOT, start_new_session=True)
    ranks: list[int] = []
    try:
        _wait_for(lambda: ckpt_io.latest_checkpoint(run) is not None, _dist.LAUNCH_TIMEOUT_S, "a first checkpoint")
        ranks = _children(launcher.pid)
        assert len(ranks) == 2, ranks
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _wait_for(lambda: not any(_running(pid) for pid in ranks), 120, "the ranks stopping")
    finally:
        for pid in [launcher.pid, *ranks]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    text = (tmp_path / "log").read_text()
    newest = ckpt_io.latest_checkpoint(run)
    stopped = int(newest.name.removeprefix(ckpt_io.CKPT_PREFIX))
    assert "the launcher (torchrun) died: stopped at step" in text, text[-3000:]
    assert stopped < steps and _series(run, "loss") and _records(run)[-1]["step"] == stopped   # a checkpoint there
    assert ckpt_io.load_checkpoint(newest)["state"]["step"] == stopped                        # whole, loadable
    assert not list(run.glob(".*tmp*"))
    with RunLock(run):   # no rank holds the run any more: a resume may start
        pass
