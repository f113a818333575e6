"""Flags mean one thing everywhere: a command's first argument MODEL is the model it reads, of any
kind, and `--out DIR` the output (the old --checkpoint / --hf / --base and export's --hf still
work, with a note); list flags never swallow the positional prompt; tokens are quoted the same
way by `tokenizer show`, `inspect` and the demo; exported files share one mode."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest
import torch

from logitlab.cli.common import quote_token
from logitlab.cli.main import main


def _model_dir(tmp_path: Path) -> tuple[Path, object]:
    """A small logitlab model directory with its tokenizer (bytes + a few merges + <|endoftext|>)."""
    from logitlab.io import checkpoint
    from logitlab.model import ModelConfig, Transformer
    from logitlab.tokenizer.core import Tokenizer

    merges = [(b"d", b"e"), (b"de", b"f"), (b" ", b"p"), (b"\n", b" ")]
    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        vocab[len(vocab)] = a + b
    tok = Tokenizer(vocab, merges, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=2, n_heads=4))
    d = tmp_path / "m"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    return d, tok


# -------------------- export: --out, and the deprecated --hf

def test_export_writes_to_out_and_every_file_has_one_mode(tmp_path, capsys):
    d, _ = _model_dir(tmp_path)
    out = tmp_path / "hf"
    assert main(["export", str(d), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "deprecated" not in captured.err and (out / "model.safetensors").is_file()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes
    # a checkpoint written the same way (atomic_directory) gets the same modes
    assert stat.S_IMODE((d / "model.safetensors").stat().st_mode) == 0o644


def test_export_hf_still_works_with_a_deprecation_warning(tmp_path, capsys):
    d, _ = _model_dir(tmp_path)
    assert main(["export", str(d), "--hf", str(tmp_path / "old")]) == 0
    captured = capsys.readouterr()
    assert "deprecated" in captured.err and "--out DIR" in captured.err and "deprecated" not in captured.out
    assert (tmp_path / "old" / "config.json").is_file()
    assert main(["export", str(d)]) == 2
    assert "export needs --out DIR" in capsys.readouterr().err
    assert main(["export", str(d), "--out", str(tmp_path / "a"), "--hf", str(tmp_path / "b")]) == 2
    assert "give the output directory once" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_help_states_the_flag_convention(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "first argument MODEL is the model it reads" in text and "--out is what it writes" in text
    assert "--batch-size and --seq-len" in text
    for command in (["generate"], ["inspect"], ["chat"], ["serve"], ["sft"], ["convert"], ["eval", "bpb"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "MODEL" in text and "hub id" in text and "--revision" in text, command
        assert "--checkpoint" not in text and "--base" not in text, command
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    assert "--out OUT_DIR" in text and "--hf" not in text.split("options:")[-1].split("example:")[0]


# -------------------- list flags and the prompt

def _generate_parser():
    from logitlab.cli.generate import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser


def test_banned_and_stop_ids_never_swallow_the_prompt(tmp_path):
    from logitlab.cli.generate import sample_config

    parser = _generate_parser()
    args = parser.parse_args(["generate", "d", "--banned-ids", "10", "def parse("])
    assert args.model == "d" and args.prompt == "def parse(" and sample_config(args).banned_ids == (10,)
    args = parser.parse_args(["generate", "d", "--banned-ids", "10,13", "--banned-ids", "7",
                              "--stop-ids", "5", "x"])
    cfg = sample_config(args)
    assert args.prompt == "x" and cfg.banned_ids == (10, 13, 7) and cfg.stop_ids[:1] == (5,)
    toml = tmp_path / "s.toml"
    toml.write_text("[sample]\nbanned_ids = [1, 2]\n")
    args = parser.parse_args(["generate", "d", "--config", str(toml), "p"])
    assert sample_config(args).banned_ids == (1, 2)                 # from the file
    args = parser.parse_args(["generate", "d", "--config", str(toml), "--banned-ids", "3", "p"])
    assert sample_config(args).banned_ids == (3,)                   # the flag replaces the file's list


@pytest.mark.parametrize("bad", ["ten", "1,,x", "-1"])
def test_banned_ids_refuse_what_is_not_ids(bad, capsys):
    with pytest.raises(SystemExit):
        _generate_parser().parse_args(["generate", "d", "--banned-ids", bad, "p"])
    assert "token ids separated by commas" in capsys.readouterr().err


def test_chat_takes_the_same_id_flags():
    from logitlab.cli.chat import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["chat", "d", "--banned-ids", "4,5"])
    assert args.banned_id_lists == [(4, 5)]


# -------------------- one way to quote a token

def test_quote_token_escapes():
    assert quote_token(" world") == "' world'"
    assert quote_token("\n\t\r") == r"'\n\t\r'"
    assert quote_token("it's \\") == r"'it\'s \\'"
    assert quote_token("\x00\x7f") == r"'\u0000\u007f'"
    assert quote_token(b" \xe2") == r"' \xe2'"                     # half of a multi-byte character
    assert quote_token("\u20ac".encode()) == "'\u20ac'" and quote_token("[b]x[/b]") == "'[b]x[/b]'"


def test_tokenizer_show_and_inspect_quote_tokens_alike(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    d, tok = _model_dir(tmp_path)
    text = "def\n p"
    ids = tok.encode(text)
    assert main(["tokenizer", "show", "--tokenizer", str(d / "tokenizer.logitlab.json"), text]) == 0
    shown = capsys.readouterr().out
    assert main(["inspect", str(d), text]) == 0
    inspected = capsys.readouterr().out
    for i in ids:
        cell = quote_token(tok.token_bytes(i))
        assert cell in shown and cell in inspected, cell
    assert r"'\n'" in shown and r"'\n'" in inspected                # a newline token, escaped in both


def test_file_mode_of_atomic_writes_matches_directories(tmp_path):
    from logitlab.io.files import FILE_MODE, atomic_directory, atomic_write_text

    atomic_write_text(tmp_path / "a.txt", "x")
    with atomic_directory(tmp_path / "d", "model") as tmp:
        (tmp / "w.bin").write_bytes(b"1")
        os.chmod(tmp / "w.bin", 0o600)                                  # as safetensors' writer leaves it
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == FILE_MODE
    assert stat.S_IMODE((tmp_path / "d" / "w.bin").stat().st_mode) == FILE_MODE


# -------------------- train --time-limit-s fits the schedule; the default learning rate

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200))


def _train_argv(tmp_path: Path, *extra: str) -> list[str]:
    (tmp_path / "code.txt").write_text(TEXT)
    return ["train", "--data", str(tmp_path / "code.txt"), "--tokenizer-vocab", "300", "--d-model", "32",
            "--n-heads", "2", "--n-kv-heads", "1", "--d-ff", "64", "--batch-size", "2", "--seq-len", "16",
            "--eval-tokens", "64", "--val-fraction", "0.2", "--workers", "1", "--progress", "false",
            "--device", "cpu", *extra]


class _StepClock:
    """Every training step takes `step_s` seconds and nothing else any (the loop reads the clock
    once as it starts, then at each step's start and end)."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.readings = step_s, 0

    def __call__(self) -> float:
        self.readings += 1
        return self.step_s * ((self.readings - 1) // 2)


def _fake_time(monkeypatch, timed_s: float, step_s: float) -> list:
    """The step timed before the run takes `timed_s`, the run's own steps `step_s` (a fake clock):
    the plans are deterministic. -> the (batch, length) pairs timed."""
    import functools

    from logitlab.train import budget, timefit

    calls = []

    def timed(model, batch_size, seq_len, **kw):
        calls.append((batch_size, seq_len))
        return 1, timed_s

    monkeypatch.setattr(budget, "time_training_step", timed)
    monkeypatch.setattr(timefit, "TimeFit", functools.partial(timefit.TimeFit, clock=_StepClock(step_s)))
    return calls


@pytest.mark.slow
def test_time_limit_fits_warmup_and_cosine_inside_the_budget(tmp_path, capsys, monkeypatch):
    import json

    from logitlab.train import budget, timefit

    calls = _fake_time(monkeypatch, 2.0, 1.0)   # timed before the run at 2 s a step; its own steps take 1 s
    run = tmp_path / "run"
    assert main(_train_argv(tmp_path, "--time-limit-s", "60", "--out-dir", str(run))) == 0
    out = " ".join(capsys.readouterr().out.split())
    fit = budget.fit_steps_to_budget(60, 2.0, budget.eval_seconds(2.0, 1, 2, 16, 64))
    assert calls == [(2, 16)] and fit.steps > 1
    assert f"time budget 60 s: a step takes 2 s here, so {fit.steps} steps fit" in out
    assert f"then the cosine to step {fit.steps}" in out and "the run still stops at 60 s" in out
    # the run's own steps are twice as fast: planned again after its third, 3 s in
    steps, every, _ = timefit.replan(timefit.TimeFit(), 60, 3.0, [1.0] * 3, 3, budget.eval_seconds(1.0, 1, 2, 16, 64))
    assert steps > fit.steps and f"re-planned after 3 step(s) at 1 s a step: {steps} steps fit 60 s" in out
    cfg = json.loads((run / "run.json").read_text())["train"]
    assert cfg["steps"] == steps and cfg["eval_every"] == every
    assert cfg["warmup_steps"] == min(100, steps // 10) and cfg["lr"] == 3e-3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "lr" in r][-1]
    peak = max(r["lr"] for r in records if "lr" in r)
    assert last["step"] == steps and peak == pytest.approx(3e-3)
    assert last["lr"] < 1.1 * 3e-4                                   # the cosine ran down to min_lr = lr / 10
    assert f"done: {steps} steps" in out and "learning rate 0.003 (the default" in out


def test_time_limit_warns_when_few_steps_fit(tmp_path, capsys, monkeypatch):
    _fake_time(monkeypatch, 0.5, 10.0)          # planned at 0.5 s a step; the run's own steps take 10 s
    assert main(_train_argv(tmp_path, "--time-limit-s", "60", "--out-dir", str(tmp_path / "run"))) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "re-planned after 3 step(s) at 10 s a step: 4 steps fit 60 s" in out and "done: 4 steps" in out
    assert "warning: only 4 steps: expect a validation loss far above a full run's" in out
    assert "went from ln V = 8.32 to 3.63 in 1,016 steps on an idle 2-core machine" in out
    assert "--steps N without --time-limit-s" in out


def test_time_limit_keeps_given_steps_and_warmup_as_bounds(tmp_path, capsys, monkeypatch):
    import json

    from logitlab.train import budget

    monkeypatch.setattr(budget, "time_training_step", lambda *a, **k: (1, 0.001))
    run = tmp_path / "run"
    argv = _train_argv(tmp_path, "--time-limit-s", "60", "--steps", "6", "--warmup-steps", "2", "--lr", "1e-3",
                       "--out-dir", str(run))
    assert main(argv) == 0
    out = capsys.readouterr().out
    cfg = json.loads((run / "run.json").read_text())["train"]
    assert cfg["steps"] == 6 and cfg["warmup_steps"] == 2 and cfg["lr"] == 1e-3   # --steps caps the fit
    assert "learning rate 0.001\n" in out


def test_train_help_shows_the_lr_rule_and_the_time_budget(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--lr LR peak learning rate (default: 3e-3 for models under 50 M parameters" in text
    assert "tiny, gpt2-tiny and small presets; 3e-4 from there up" in text
    assert "--time-limit-s TIME_LIMIT_S time budget in seconds" in text and "fits the step count" in text
