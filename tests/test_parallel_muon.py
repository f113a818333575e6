"""Muon (MuonAdamW) with warmup-stable-decay on 2 CPU ranks (gloo) trains exactly like 1 process:
DDP (every rank holds the averaged gradient and computes the same update), FSDP2 (each rank holds
rows of every matrix; the update gathers the whole momentum, orthogonalises it on every rank and
keeps its own rows) and ZeRO-2 (the fused projections split into separate matrices, which Muon
orthogonalises apart as it does the fused ones' row blocks). A checkpoint written by 2 FSDP ranks
(the optimizer state gathered) resumes in one process with the same losses.

These launches take minutes on 2 busy cores: marked slow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _dist
import _dist_muon as muon_worker
import _dist_worker as worker
import pytest
from test_parallel import _prepare_corpus

from logitlab import parallel

pytestmark = pytest.mark.slow
LAYOUTS = ("ddp", "fsdp", "zero2")
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist_muon")
    _prepare_corpus(out / "prep")
    info = parallel.init_distributed()
    assert info.world_size == 1
    muon_worker.run(out, "none")                                  # the reference, in this process
    _dist.torchrun(2, str(Path(muon_worker.__file__)), str(out), *LAYOUTS)
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and a, (a, b)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= TOL, f"max difference {worst:.3g}: {a} vs {b}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_on_two_ranks_matches_one_process(runs, layout):
    one, two = _records(runs / "run_muon_none"), _records(runs / f"run_muon_{layout}")
    for key in ("loss", "grad_norm", "val_loss"):
        a, b = [r[key] for r in one if key in r], [r[key] for r in two if key in r]
        _close(b, a)
    losses = [r["loss"] for r in one if "loss" in r]
    assert len(losses) == worker.STEPS and losses[-1] < losses[0]


def test_muon_checkpoint_from_two_fsdp_ranks_resumes_in_one(runs, tmp_path):
    run = tmp_path / "run_muon_fsdp"
    shutil.copytree(runs / "run_muon_fsdp", run)
    shutil.rmtree(run / f"ckpt-{worker.STEPS:06d}")               # as if the job died after step RESUME_AT
    shutil.copytree(runs / "prep", tmp_path / "prep")
    from logitlab.train.loop import train

    config = muon_worker.config(tmp_path, "fsdp")
    import dataclasses

    train(worker.tiny_model(vocab_size=257), dataclasses.replace(config, parallel="none"), resume=True)
    one = [r["loss"] for r in _records(runs / "run_muon_none") if "loss" in r]
    _close([r["loss"] for r in _records(run) if "loss" in r], one)
