"""The N-D layouts (tensor / pipeline parallel, ZeRO-1) run through the main training loop: the
same data order as one process (so the same losses, within 1e-5 in fp32), periodic validation,
run.json and metrics.jsonl, sharded checkpoints RUN/dcp-STEP kept like the gathered ones, and
`logitlab train --resume RUN` on the same or another mesh continuing with the same losses.

The default set runs one process (ZeRO-1 there is plain AdamW, with sharded checkpoints); the
torchrun launches with 2 CPU ranks (gloo) are marked slow.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import _dist
import _dist_nd as nd
import pytest

from logitlab.cli.main import main as cli_main

TOL = 1e-5
STEPS, SAVE = 6, 2
# the vocabulary is even and unpadded: tensor parallelism shards it over 2 ranks
MODEL = ["--seq-len", "16", "--context-length", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "4",
         "--n-kv-heads", "2", "--vocab-size", "264", "--vocab-pad-multiple", "8", "--dropout", "0"]
TRAIN = ["--steps", str(STEPS), "--batch-size", "4", "--grad-accum", "2", "--lr", "3e-3", "--warmup-steps", "2",
         "--eval-every", str(SAVE), "--eval-tokens", "256", "--keep-last", "3", "--device", "cpu",
         "--precision", "fp32", "--tensorboard", "false", "--progress", "false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    prep = tmp_path_factory.mktemp("corpus") / "prep"
    nd.prepare_corpus(prep)
    return prep


def _train_flags(prep: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data-dir", str(prep), *MODEL, *TRAIN, "--out-dir", str(out), *extra]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in _records(run) if key in r}


def _close(got: dict[int, float], want: dict[int, float], steps) -> None:
    steps = list(steps)
    assert steps and all(s in got and s in want for s in steps), (sorted(got), sorted(want), steps)
    diffs = {s: abs(got[s] - want[s]) for s in steps}
    assert max(diffs.values()) <= TOL, f"differences {diffs}: {got} vs {want}"


def _cut_after(run: Path, step: int, copy: Path) -> Path:
    """A copy of `run` as if its job had died after the checkpoint of `step`."""
    shutil.copytree(run, copy)
    for ckpt in copy.glob("dcp-*"):
        if int(ckpt.name.removeprefix("dcp-")) > step:
            shutil.rmtree(ckpt)
    return copy


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """The plain main loop in one process (gathered checkpoints)."""
    out = tmp_path_factory.mktemp("ref") / "one"
    assert cli_main(_train_flags(corpus, out)) == 0
    assert _losses(out).keys() == set(range(1, STEPS + 1)) and len(set(_losses(out).values())) == STEPS  # it trains
    return out


def test_one_process_sharded_run_is_the_main_loop_and_resumes(corpus, reference, tmp_path):
    run = tmp_path / "zero1"
    assert cli_main(_train_flags(corpus, run, "--parallel", "zero1")) == 0
    assert json.loads((run / "run.json").read_text())["train"]["parallel"] == "zero1"
    assert sorted(p.name for p in run.glob("dcp-*")) == ["dcp-000002", "dcp-000004", "dcp-000006"]
    assert not list(run.glob("ckpt-*"))
    _close(_losses(run), _losses(reference), range(1, STEPS + 1))
    _close(_losses(run, "val_loss"), _losses(reference, "val_loss"), range(0, STEPS + 1, SAVE))
    resumed = _cut_after(run, 2, tmp_path / "resumed")
    assert cli_main(["train", "--resume", str(resumed), "--progress", "false"]) == 0
    _close(_losses(resumed), _losses(reference), range(1, STEPS + 1))   # 1-2 kept from the checkpoint
    assert [r["step"] for r in _records(resumed)] == [r["step"] for r in _records(reference)]


def test_sharded_checkpoints_keep_the_newest_and_the_best(corpus, tmp_path):
    run = tmp_path / "keep"
    assert cli_main(_train_flags(corpus, run, "--parallel", "zero1", "--keep-last", "1", "--save-every", "1",
                                 "--steps", "3", "--warmup-steps", "1", "--eval-every", "1")) == 0
    vals = _losses(run, "val_loss")
    best = min((v, s) for s, v in vals.items() if s > 0)[1]
    assert sorted(p.name for p in run.glob("dcp-*")) == sorted({f"dcp-{best:06d}", "dcp-000003"})
    assert not [p for p in run.iterdir() if p.name.startswith(".")]      # no temporaries or half-deleted ones


def test_a_new_run_refuses_a_directory_with_sharded_checkpoints(corpus, tmp_path, capsys):
    run = tmp_path / "used"
    assert cli_main(_train_flags(corpus, run, "--parallel", "zero1", "--steps", "2", "--warmup-steps", "1")) == 0
    assert cli_main(_train_flags(corpus, run, "--parallel", "zero1", "--steps", "2", "--warmup-steps", "1")) == 2
    assert "already holds sharded checkpoints" in capsys.readouterr().err


def test_tensor_parallel_in_one_process_is_a_clear_error(corpus, tmp_path, capsys):
    assert cli_main(_train_flags(corpus, tmp_path / "tp1", "--tp", "2")) == 2
    assert "--tp 2" in capsys.readouterr().err and not (tmp_path / "tp1" / "run.json").exists()


def test_extending_the_context_of_a_sharded_run_is_a_clear_error(corpus, tmp_path, capsys):
    run = tmp_path / "ext"
    assert cli_main(_train_flags(corpus, run, "--parallel", "zero1", "--steps", "2", "--warmup-steps", "1")) == 0
    capsys.readouterr()
    assert cli_main(["train", "--resume", str(run), "--context-length", "32", "--seq-len", "32",
                     "--rope-scaling", "yarn:2", "--steps", "4", "--progress", "false"]) == 2
    assert "not yet for sharded dcp-STEP ones" in capsys.readouterr().err
    assert sorted(p.name for p in run.glob("dcp-*")) == ["dcp-000002"]        # nothing written


def test_compile_and_the_triton_kernel_are_refused_on_sharded_layouts(corpus, tmp_path, capsys):
    """Their steps run eager with SDPA: a flag that would be ignored is an error instead."""
    assert cli_main(_train_flags(corpus, tmp_path / "c", "--parallel", "zero1", "--compile", "true")) == 2
    assert "--compile: not available with sharded layouts" in capsys.readouterr().err
    assert not (tmp_path / "c" / "run.json").exists()


# -- two ranks -------------------------------------------------------------------------------

def _torchrun_train(*flags: str) -> None:
    _dist.torchrun(2, "-m", "logitlab", *flags)


@pytest.fixture(scope="module")
def tp_run(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp") / "tp"
    _torchrun_train(*_train_flags(corpus, out, "--tp", "2"))
    return out


@pytest.mark.slow
def test_tensor_parallel_run_writes_the_main_loops_files(tp_run):
    run = json.loads((tp_run / "run.json").read_text())
    assert run["train"]["tp"] == 2 and run["model"]["vocab_size"] == 264 and "data" in run
    assert (tp_run / "tokenizer.logitlab.json").is_file()
    assert sorted(p.name for p in tp_run.glob("dcp-*")) == ["dcp-000002", "dcp-000004", "dcp-000006"]
    meta = json.loads((tp_run / "dcp-000006" / "logitlab_dcp.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["state"]["sampler"]["index"] == STEPS * 2   # grad_accum 2
    vals = _losses(tp_run, "val_loss")
    assert sorted(vals) == [0, 2, 4, 6] and vals[6] < vals[0]


@pytest.mark.slow
def test_tensor_parallel_losses_equal_one_process(tp_run, reference):
    _close(_losses(tp_run), _losses(reference), range(1, STEPS + 1))
    _close(_losses(tp_run, "val_loss"), _losses(reference, "val_loss"), range(0, STEPS + 1, SAVE))


@pytest.mark.slow
def test_tensor_parallel_resume_continues_exactly(tp_run, reference, tmp_path):
    resumed = _cut_after(tp_run, 2, tmp_path / "tp")
    _torchrun_train("train", "--resume", str(resumed), "--progress", "false")
    _close(_losses(resumed), _losses(reference), range(1, STEPS + 1))
    assert (resumed / "dcp-000006").is_dir()


@pytest.mark.slow
def test_resume_across_meshes_tp2_to_one_process_and_back(tp_run, reference, tmp_path):
    one = _cut_after(tp_run, 2, tmp_path / "one")                       # TP 2 wrote dcp-000002
    assert cli_main(["train", "--resume", str(one), "--progress", "false"]) == 0
    _close(_losses(one), _losses(reference), range(1, STEPS + 1))
    assert json.loads((one / "dcp-000004" / "logitlab_dcp.json").read_text())["world_size"] == 1
    back = _cut_after(one, 4, tmp_path / "back")                        # one process wrote dcp-000004
    _torchrun_train("train", "--resume", str(back), "--progress", "false")
    _close(_losses(back), _losses(reference), range(1, STEPS + 1))
    assert json.loads((back / "dcp-000006" / "logitlab_dcp.json").read_text())["layout"]["tp"] == 2


@pytest.mark.slow
def test_sharded_checkpoint_exports_and_generates(tp_run, reference, tmp_path, capsys):
    from logitlab.io.checkpoint import load_for_inference
    from logitlab.io.hf import load_pretrained

    hf = tmp_path / "hf"
    assert cli_main(["export", str(tp_run / "dcp-000006"), "--out", str(hf)]) == 0
    exported = load_pretrained(hf).state_dict()
    one = load_for_inference(reference)[0].state_dict()
    assert exported.keys() == one.keys()
    worst = max(float((exported[k].float() - one[k].float()).abs().max()) for k in one)
    assert worst <= 1e-4, worst                                          # 6 AdamW steps of the same run
    capsys.readouterr()
    assert cli_main(["generate", str(hf), "the quick", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert capsys.readouterr().out.strip()


def test_shared_launcher_drops_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    env = _dist.env(EXTRA="1")
    assert "RANK" not in env and env["EXTRA"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(_dist.ROOT)
    assert _dist.torchrun_cmd(2, "-m", "logitlab")[-4:] == ["--nproc_per_node", "2", "-m", "logitlab"]
    assert _dist.run([sys.executable, "-c", "import os; print(os.environ.get('RANK'))"]).stdout.strip() == "None"


def test_a_stop_that_reached_another_rank_stops_this_one_after_the_same_step(corpus, tmp_path):
    """A signal or the time limit may reach the ranks at different steps: the loop stops when any
    rank's flag is set (ParallelHooks.agree), evaluates and saves there, on every rank alike."""
    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.train.config import TrainConfig
    from logitlab.train.layouts import sharded_hooks
    from logitlab.train.loop import train

    config = TrainConfig(data_dir=str(corpus), out_dir=str(tmp_path / "run"), steps=6, batch_size=4, seq_len=16,
                         lr=3e-3, warmup_steps=1, eval_every=0, eval_tokens=256, device="cpu", precision="fp32",
                         tensorboard=False, parallel="zero1")
    hooks = sharded_hooks(config)
    seen = []

    def agree(signalled: bool, orphaned: bool, out_of_time: bool) -> tuple[bool, bool, bool]:
        seen.append((signalled, orphaned, out_of_time))
        return signalled or len(seen) == 2, orphaned, out_of_time    # another rank was signalled during step 2

    hooks.agree = agree
    torch_model = Transformer(ModelConfig(vocab_size=264, context_length=16, d_model=32, n_layers=1, n_heads=4,
                                          n_kv_heads=2, dropout=0.0))
    result = train(torch_model, config, parallel=hooks)
    assert (result.stopped, result.step, seen) == ("signal", 2, [(False, False, False)] * 2)
    assert result.checkpoint.name == "dcp-000002" and result.val_loss is not None
    # the launcher seen dead by this rank after step 3: every rank is told (agree), stops there and saves
    hooks, seen = sharded_hooks(dataclasses.replace(config, out_dir=str(tmp_path / "orphan"))), []
    hooks.launcher_gone = lambda: len(seen) == 2
    hooks.agree = lambda *flags: seen.append(flags) or flags
    result = train(torch_model, dataclasses.replace(config, out_dir=str(tmp_path / "orphan")), parallel=hooks)
    assert (result.stopped, result.step, seen[-1]) == ("launcher", 3, (False, True, False))
    assert result.checkpoint.name == "dcp-000003" and result.val_loss is not None


def test_data_parallel_coordinates_follow_the_mesh_order():
    """Which rows a rank reads is decided before the mesh exists: its (dp_replicate, dp_shard)
    coordinates in init_device_mesh's row-major grid (pp, dp_replicate, dp_shard, tp)."""
    import torch

    from logitlab.parallel.mesh import ParallelPlan
    from logitlab.train.sharded_run import dp_coordinates

    plan = ParallelPlan(pp=2, dp_replicate=2, dp_shard=3, tp=2, parallel="fsdp").resolve(24)
    grid = torch.arange(24).reshape(plan.shape)
    for rank in range(24):
        _, r, s, _ = (int(i) for i in (grid == rank).nonzero()[0])
        assert dp_coordinates(plan, rank) == (r * 3 + s, 6)


def test_pruning_keeps_the_newest_and_the_best_by_validation_loss(tmp_path):
    from logitlab.parallel.sharded import FORMAT, META_FILE
    from logitlab.train.sharded_run import list_sharded, prune_sharded

    for step, val in ((1, 3.0), (2, 1.0), (3, 2.0), (4, None), (5, 2.5)):
        ckpt = tmp_path / f"dcp-{step:06d}"
        ckpt.mkdir()
        (ckpt / META_FILE).write_text(json.dumps({"format": FORMAT, "step": step, "state": {"val_loss": val}}))
    (tmp_path / "dcp-000009").mkdir()                                   # no metadata: not ours, left alone
    removed = prune_sharded(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["dcp-000001", "dcp-000003"]
    assert [p.name for p in list_sharded(tmp_path)] == ["dcp-000002", "dcp-000004", "dcp-000005"]
    assert (tmp_path / "dcp-000009").is_dir() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_gathered_checkpoint_resumes_on_the_n_d_hooks(corpus, reference, tmp_path):
    """A run saved by the plain loop (RUN/ckpt-STEP, fused projections) continues through the N-D
    hooks with the same losses, then writes sharded checkpoints."""
    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.train.config import TrainConfig
    from logitlab.train.layouts import sharded_hooks
    from logitlab.train.loop import train

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for ckpt in ("ckpt-000004", "ckpt-000006"):
        shutil.rmtree(run / ckpt)
    saved = json.loads((run / "run.json").read_text())
    config = TrainConfig.from_dict({**saved["train"], "out_dir": str(run)})
    result = train(Transformer(ModelConfig.from_dict(saved["model"])), config, resume=True,
                   parallel=sharded_hooks(config, None, resume=True))
    assert result.step == STEPS and result.checkpoint.name == "dcp-000006"
    _close(_losses(run), _losses(reference), range(1, STEPS + 1))
    _close(_losses(run, "val_loss"), _losses(reference, "val_loss"), range(0, STEPS + 1, SAVE))


@pytest.mark.slow
def test_a_gathered_checkpoint_resumes_on_tensor_parallel_ranks(reference, tmp_path):
    """The plain loop's checkpoint continued by `--resume RUN --tp 2`: a layout flag may change at
    a resume."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for ckpt in ("ckpt-000004", "ckpt-000006"):
        shutil.rmtree(run / ckpt)
    _torchrun_train("train", "--resume", str(run), "--tp", "2", "--progress", "false")
    _close(_losses(run), _losses(reference), range(1, STEPS + 1))
    assert json.loads((run / "dcp-000006" / "logitlab_dcp.json").read_text())["layout"]["tp"] == 2
