"""Faults a careless or hostile user causes: writing over directories we did not write, NaN
updates, kills while saving and pruning, two writers, a full disk, corrupted and truncated files,
signals, and settings that conflict or are not finite. Nothing may be lost, and every error is
one line naming the file, field or value."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from logitlab.cli.main import main
from logitlab.data import tokens as data
from logitlab.io import checkpoint as ck
from logitlab.io import files, hf
from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.tokenizer.core import Tokenizer
from logitlab.train.loop import TrainConfig, TrainingDiverged, train

ROOT = Path(__file__).resolve().parents[1]
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune.\n"
# the tiny model of the CLI reproductions
T = ["--preset", "tiny", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
     "--d-ff", "64", "--context-length", "32", "--batch-size", "4", "--progress", "false", "--device", "cpu",
     "--eval-tokens", "256", "--tensorboard", "false"]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=257, context_length=32, d_model=32, n_layers=1, n_heads=2,
                                   norm="rmsnorm", positions="rope", mlp="swiglu", d_ff=64, bias=False))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("corpus")
    (tmp / "docs").mkdir()
    for k in range(30):
        (tmp / "docs" / f"{k:02d}.txt").write_text(f"{k}: {TEXT * (1 + k % 3)}")
    data.prepare_corpus([tmp / "docs"], byte_tokenizer(), tmp / "prep", val_fraction=0.1, workers=1)
    return tmp / "prep"


def _cfg(corpus, out, **kw) -> TrainConfig:
    base = dict(data_dir=str(corpus), out_dir=str(out), steps=4, batch_size=4, seq_len=32, lr=3e-3,
                warmup_steps=1, eval_every=2, save_every=2, eval_tokens=256, device="cpu", precision="fp32",
                seed=5, keep_last=2, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory) -> Path:
    """A finished run with a tokenizer: two checkpoints and its metrics."""
    out = tmp_path_factory.mktemp("run") / "sig"
    train(tiny_model(), _cfg(corpus, out), tokenizer=byte_tokenizer())
    return out


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` and its bytes (hidden ones included)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def cli_error(capsys, argv) -> str:
    """Run the CLI, expect exit code 2 and one error line; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------------------------
# Nothing we did not write is deleted or overwritten
# --------------------------------------------------------------------------------------------

def test_export_into_the_run_itself_is_refused_and_nothing_is_lost(run, tmp_path, capsys):
    copy = tmp_path / "ex"
    shutil.copytree(run, copy)
    before = snapshot(copy)
    err = cli_error(capsys, ["export", str(copy), "--out", str(copy)])
    assert str(copy) in err
    assert snapshot(copy) == before


def test_export_refuses_a_directory_of_someone_elses_and_a_file(run, tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    err = cli_error(capsys, ["export", str(run), "--out", str(theirs)])
    assert "notes.txt" in err and "not written by logitlab" in err
    assert os.listdir(theirs) == ["notes.txt"]
    tok = tmp_path / "tok.json"
    tok.write_text("{}")
    err = cli_error(capsys, ["export", str(run), "--out", str(tok)])
    assert "not a directory" in err and tok.read_text() == "{}"


def test_export_inside_the_run_works_and_containing_the_source_is_refused(run, tmp_path, capsys):
    copy = tmp_path / "parent" / "demo"
    shutil.copytree(run, copy)
    assert main(["export", str(copy), "--out", str(copy / "hf")]) == 0
    assert (copy / "hf" / "model.safetensors").is_file() and ck.latest_checkpoint(copy) is not None
    err = cli_error(capsys, ["export", str(copy), "--out", str(copy.parent)])
    assert "contains" in err


def test_overwrite_replaces_only_our_files(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 0
    (out / "README.md").write_text("my notes")
    (out / "extra").mkdir()
    (out / "extra" / "eval.json").write_text("[1]")
    err = cli_error(capsys, ["export", str(run), "--out", str(out)])
    assert "--overwrite" in err
    old_weights = (out / "model.safetensors").stat().st_ino
    assert main(["export", str(run), "--out", str(out), "--which", "best", "--overwrite"]) == 0
    assert (out / "README.md").read_text() == "my notes" and (out / "extra" / "eval.json").read_text() == "[1]"
    assert (out / "model.safetensors").stat().st_ino != old_weights      # replaced, not appended to
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_convert_and_save_pretrained_never_delete_unrelated_files(run, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "data.csv").write_text("a,b\n")
    err = cli_error(capsys, ["convert", str(run), "--out", str(target)])
    assert "data.csv" in err
    model, tok = ck.load_for_inference(run)
    with pytest.raises(ValueError, match="not written by logitlab"):
        hf.save_pretrained(model, target, tok)
    with pytest.raises(ValueError, match="not written by logitlab"):
        hf.save_pretrained(model, target)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(model, hf_dir, tok)
    err = cli_error(capsys, ["convert", str(hf_dir), "--out", str(target)])
    assert "data.csv" in err
    err = cli_error(capsys, ["convert", str(hf_dir), "--out", str(hf_dir)])
    assert "is the source" in err
    assert os.listdir(target) == ["data.csv"] and (target / "data.csv").read_text() == "a,b\n"
    # our own logitlab directory is replaced with --overwrite only
    native = tmp_path / "native"
    assert main(["convert", str(hf_dir), "--out", str(native)]) == 0
    cli_error(capsys, ["convert", str(hf_dir), "--out", str(native)])
    assert main(["convert", str(hf_dir), "--out", str(native), "--overwrite"]) == 0


def test_prepare_refuses_a_file_and_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(TEXT * 20)
    tok = tmp_path / "tok.json"
    byte_tokenizer().save(tok)
    out_file = tmp_path / "out.bin"
    out_file.write_bytes(b"x")
    err = cli_error(capsys, ["prepare", "--data", str(tmp_path / "docs"), "--tokenizer", str(tok),
                             "--out", str(out_file)])
    assert "not a directory" in err and out_file.read_bytes() == b"x"
    foreign = tmp_path / "nanogpt"
    foreign.mkdir()
    (foreign / "train.bin").write_bytes(b"\0" * 8)
    (foreign / "prepare.py").write_text("print()")
    err = cli_error(capsys, ["prepare", "--data", str(tmp_path / "docs"), "--tokenizer", str(tok),
                             "--out", str(foreign)])
    assert "prepare.py" in err and (foreign / "train.bin").read_bytes() == b"\0" * 8
    ours = tmp_path / "prep"
    for _ in range(2):  # our own token directory is prepared again in place
        assert main(["prepare", "--data", str(tmp_path / "docs"), "--tokenizer", str(tok), "--out", str(ours)]) == 0


def test_a_read_only_output_is_one_clear_line(run, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _mount_tmpfs(ro, "64k", read_only=True):
        pytest.skip("mounting a read-only tmpfs is not permitted here")
    try:
        err = cli_error(capsys, ["export", str(run), "--out", str(ro / "hf")])
        assert str(ro) in err and "Traceback" not in err
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_a_new_run_never_overwrites_a_foreign_run_json(corpus, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "run.json").write_text('{"my": "settings"}')
    with pytest.raises(ValueError, match="not a logitlab run"):
        train(tiny_model(), _cfg(corpus, out))
    assert (out / "run.json").read_text() == '{"my": "settings"}'


def test_the_demo_removes_only_its_own_outputs(tmp_path):
    from logitlab.cli.demo import _clear_demo_run

    out = tmp_path / "demo"
    (out / "ckpt-000001").mkdir(parents=True)
    (out / "ckpt-000001" / "state.json").write_text("{}")
    (out / "demo.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text("{}")
    (out / "notes.txt").write_text("keep")
    _clear_demo_run(out)
    assert sorted(os.listdir(out)) == ["hf", "notes.txt"]
    with pytest.raises(ValueError, match="not a demo run"):
        _clear_demo_run(out)


# --------------------------------------------------------------------------------------------
# Non-finite values stop the run before the update, and are never saved
# --------------------------------------------------------------------------------------------

def _all_finite(directory: Path) -> bool:
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(str(directory / "model.safetensors")).values())


def test_a_nan_gradient_norm_stops_before_the_update(corpus, tmp_path):
    model = tiny_model()
    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged, match=r"(gradient norm|loss) is (nan|inf)") as info:
        train(model, _cfg(corpus, out, steps=60, lr=1e6, save_every=1, eval_every=0, keep_last=100))
    ckpts = ck.list_checkpoints(out)
    assert all(_all_finite(c) for c in ckpts)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())  # the bad update was not applied
    if ckpts:
        assert str(ckpts[-1]) in str(info.value)


def test_the_gradient_check_catches_a_finite_loss_with_a_nan_gradient(corpus, tmp_path, monkeypatch):
    """A loss that is finite while its gradient is NaN (as --lr 1e6 gives at step 2)."""
    import logitlab.train.loop as train_mod

    real = train_mod.clip_grad_norm
    calls = {"n": 0}

    def poisoned(params, max_norm):
        params = list(params)
        calls["n"] += 1
        if calls["n"] == 2:
            params[0].grad.fill_(float("nan"))
        return real(params, max_norm)

    monkeypatch.setattr(train_mod, "clip_grad_norm", poisoned)
    model = tiny_model()
    out = tmp_path / "gradnan"
    with pytest.raises(TrainingDiverged, match="gradient norm is nan at step 2") as info:
        train(model, _cfg(corpus, out, steps=6, save_every=1, eval_every=0))
    assert "ckpt-000001" in str(info.value)
    assert [c.name for c in ck.list_checkpoints(out)] == ["ckpt-000001"]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_checkpoint_never_holds_non_finite_weights(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.tok_emb.weight[3, 1] = float("inf")
    with pytest.raises(ck.NonFiniteError, match="tok_emb.weight"):
        ck.save_checkpoint(tmp_path, 1, model)
    assert not ck.list_checkpoints(tmp_path) and not list(tmp_path.iterdir())


def test_non_finite_optimizer_settings_are_refused_before_anything_is_written(tmp_path, capsys):
    for field, value in (("lr", math.inf), ("weight_decay", math.nan), ("eps", math.nan), ("grad_clip", math.inf),
                         ("beta1", math.nan), ("min_lr", math.nan), ("time_limit_s", math.nan)):
        with pytest.raises(ValueError, match=field):
            TrainConfig(**{field: value})
    for flags in (["--lr", "inf"], ["--weight-decay", "nan"], ["--seed", "-1"]):
        out = tmp_path / "never"
        err = cli_error(capsys, ["train", *T, "--out-dir", str(out), "--steps", "2", *flags])
        assert flags[0].lstrip("-").replace("-", "_") in err
        assert not out.exists()


# --------------------------------------------------------------------------------------------
# Kills while saving and pruning; two writers
# --------------------------------------------------------------------------------------------

_TRAINER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_faults import tiny_model, _cfg
    from logitlab.train.loop import train
    train(tiny_model(), _cfg({corpus!r}, {out!r}, steps=100000, save_every=1, eval_every=0, keep_last=1),
          resume={resume})
""")


def _start_trainer(corpus, out: Path, resume: bool = False) -> subprocess.Popen:
    code = _TRAINER.format(tests=str(ROOT / "tests"), corpus=str(corpus), out=str(out), resume=resume)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout  # generous: the machine may be loaded
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"trainer ended early: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the trainer")
        time.sleep(0.02)


def test_a_second_writer_is_refused_and_a_killed_writers_lock_is_taken_over(corpus, tmp_path):
    out = tmp_path / "run"
    proc = _start_trainer(corpus, out)
    try:
        _wait_for(lambda: len(ck.list_checkpoints(out)) >= 1, proc)
        with pytest.raises(files.LockedError, match=rf"in use by .*pid {proc.pid}"):
            train(tiny_model(), _cfg(corpus, out, steps=200), resume=True)
        with pytest.raises(files.LockedError):
            train(tiny_model(), _cfg(corpus, out, steps=200))
    finally:
        proc.kill()
        proc.wait()
    assert (out / files.LOCK_FILE).exists()  # left by the killed process: stale, taken over
    result = train(tiny_model(), _cfg(corpus, out, steps=ck.read_state(ck.latest_checkpoint(out))["step"] + 1),
                   resume=True)
    assert result.stopped == "done" and not (out / files.LOCK_FILE).exists()


@pytest.mark.slow
def test_kill_9_during_saves_and_pruning_leaves_only_complete_checkpoints(corpus, tmp_path):
    out = tmp_path / "run"
    seen_deleting = False
    for k in range(6):  # kill at varied instants; keep_last=1 prunes after every save
        before = _newest_step(out)
        proc = _start_trainer(corpus, out, resume=k > 0)
        try:
            _wait_for(lambda: _newest_step(out) > before, proc)  # this process saved at least once
            time.sleep(0.03 * k)  # then land somewhere inside a later save or prune
        finally:
            proc.kill()
            proc.wait()
        seen_deleting |= any(".del-" in p.name for p in out.iterdir())
        latest = ck.latest_checkpoint(out)
        assert latest is not None
        ck.load_checkpoint(latest, tiny_model(), None)  # complete and loadable
    train(tiny_model(), _cfg(corpus, out, steps=ck.read_state(ck.latest_checkpoint(out))["step"] + 1), resume=True)
    leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers


def _newest_step(out: Path) -> int:
    ckpts = ck.list_checkpoints(out)
    return int(ckpts[-1].name[len(ck.CKPT_PREFIX):]) if ckpts else -1


def test_an_interrupted_deletion_is_never_loaded_and_is_cleaned_at_the_next_start(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_model(), _cfg(corpus, out, steps=4, save_every=1, keep_last=10))
    ckpts = ck.list_checkpoints(out)
    # as a kill leaves them: one renamed for deletion and half removed, one without state.json
    doomed = out / f".{ckpts[0].name}.del-123-456"
    os.replace(ckpts[0], doomed)
    (doomed / "model.safetensors").unlink()
    (ckpts[-1] / "state.json").unlink()
    assert ck.list_checkpoints(out) == ckpts[1:-1]
    with pytest.warns(UserWarning, match=f"skipped incomplete checkpoint.*{ckpts[-1].name}"):
        assert ck.latest_checkpoint(out) == ckpts[-2]
    result = train(tiny_model(), _cfg(corpus, out, steps=5, save_every=1, keep_last=10), resume=True)
    assert result.step == 5
    assert not doomed.exists() and not [p for p in out.iterdir() if p.name.startswith(".")]


def test_delete_checkpoint_renames_before_removing(tmp_path, monkeypatch):
    (tmp_path / "ckpt-000001").mkdir()
    (tmp_path / "ckpt-000001" / "state.json").write_text("{}")
    seen = []
    monkeypatch.setattr(ck.shutil, "rmtree", lambda p, **kw: seen.append(Path(p).name))
    ck.delete_checkpoint(tmp_path / "ckpt-000001")
    assert seen and seen[0].startswith(".ckpt-000001.del-")
    assert ck.list_checkpoints(tmp_path) == []  # gone from every loader's view before the removal


# --------------------------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------------------------

def _mount_tmpfs(where: Path, size: str, read_only: bool = False) -> bool:
    if shutil.which("mount") is None or (hasattr(os, "geteuid") and os.geteuid() != 0):
        return False
    opts = f"size={size}" + (",ro" if read_only else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("size", ["300k", "2m"])
def test_disk_full_keeps_the_last_checkpoint_and_says_where(corpus, tmp_path, size):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not _mount_tmpfs(mnt, size):
        pytest.skip("mounting a tmpfs is not permitted here (needs root)")
    try:
        out = mnt / "run"
        with pytest.raises(files.DiskFullError) as info:
            train(tiny_model(), _cfg(corpus, out, steps=100000, save_every=1, eval_every=0, keep_last=100))
        message = str(info.value)
        assert f"no space left on {mnt}" in message and "while writing" in message
        latest = ck.latest_checkpoint(out)
        if latest is not None:
            assert str(latest) in message
            ck.load_checkpoint(latest, tiny_model(), None)
        else:
            assert "no checkpoint was written" in message
        assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # the partial save was removed
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_writing_names_the_file_for_any_writers_full_disk_error(tmp_path, monkeypatch):
    import errno

    with pytest.raises(files.DiskFullError, match=f"while writing {tmp_path / 'x.bin'}"):
        with files.writing(tmp_path / "x.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(files, "is_disk_full", lambda exc, d: True)  # torch.save's zip writer error
    with pytest.raises(files.DiskFullError):
        with files.writing(tmp_path / "x.pt"):
            raise RuntimeError("unexpected pos 234176 vs 234068")
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="unrelated"):  # space left: the error passes through
        with files.writing(tmp_path / "x.pt"):
            raise RuntimeError("unrelated")


# --------------------------------------------------------------------------------------------
# Corrupted and truncated files
# --------------------------------------------------------------------------------------------

def test_a_truncated_token_file_is_named_at_the_start(corpus, tmp_path):
    copy = tmp_path / "prep"
    shutil.copytree(corpus, copy)
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(os.path.getsize(copy / "train.bin") - 7)
    with pytest.raises(ValueError, match=r"train\.bin holds .* bytes, but .*manifest\.json says"):
        train(tiny_model(), _cfg(copy, tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_truncated_manifest_and_run_json_are_named(corpus, run, tmp_path, capsys):
    copy = tmp_path / "prep"
    shutil.copytree(corpus, copy)
    (copy / "manifest.json").write_text((copy / "manifest.json").read_text()[:40])
    with pytest.raises(ValueError, match=r"manifest\.json: not valid JSON .* line"):
        data.read_manifest(copy)
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    (broken / "run.json").write_text((broken / "run.json").read_text()[:100])
    err = cli_error(capsys, ["train", "--resume", str(broken), "--progress", "false"])
    assert "run.json: not valid JSON" in err and "line" in err


# --------------------------------------------------------------------------------------------
# Resume, signals
# --------------------------------------------------------------------------------------------

def test_resume_refuses_conflicting_flags_and_names_them(run, tmp_path, capsys):
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    err = cli_error(capsys, ["train", "--resume", str(copy), "--d-model", "128", "--lr", "0.1", "--progress", "false"])
    assert "--d-model 128" in err and "--lr 0.1" in err and "may change only" in err
    err = cli_error(capsys, ["train", "--resume", str(copy), "--data", "x.txt", "--progress", "false"])
    assert "--data" in err
    # a setting that may change: the run goes on to the new end
    assert main(["train", "--resume", str(copy), "--steps", "5", "--progress", "false"]) == 0
    assert ck.read_state(ck.latest_checkpoint(copy))["step"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_by_a_signal_saves_and_exits_128_plus_the_signal(tmp_path, sig, code):
    (tmp_path / "docs").mkdir()
    for k in range(20):
        (tmp_path / "docs" / f"{k}.txt").write_text(TEXT * 5)
    tok = tmp_path / "tok.json"
    byte_tokenizer().save(tok)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "logitlab", "train", *T, "--tokenizer", str(tok), "--data", str(tmp_path / "docs"),
           "--out-dir", str(out), "--steps", "100000", "--eval-every", "0", "--log-every", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        metrics = out / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2, proc)
        proc.send_signal(sig)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, proc.stderr.read().decode()[-2000:]
    assert ck.latest_checkpoint(out) is not None
