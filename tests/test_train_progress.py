"""The progress a Python train() shows by itself (train/progress.py): lines for the start and
each evaluation in any stream; in a terminal also a status line rewritten in place."""

from __future__ import annotations

import io

import test_train
from test_train import _cfg, tiny_model

from logitlab.train.loop import train
from logitlab.train.progress import TextProgress, chain, plan_line, resolve, wanted

corpus = test_train.corpus                                 # the fixture, shared


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream) -> str:
    p = TextProgress(stream, interval=0.0)
    p("start", {"steps": 20, "tokens_per_step": 2048, "device": "cpu", "run_dir": "runs/x"})
    for step in range(1, 21):
        record = {"step": step, "loss": 4.0 - step / 10, "tokens_per_s": 1000.0}
        if step % 10 == 0:
            record.update(val_loss=3.5, val_ppl=33.1)
            p("eval", record)
        p("step", record)
    p("end", {"step": 20, "val_loss": 3.5})
    return stream.getvalue()


def test_a_pipe_or_notebook_gets_whole_lines_only():
    text = _run(io.StringIO())
    assert text.splitlines() == ["training on cpu, 2,048 tokens/step, 20 steps -> runs/x",
                                 "step 10: loss 3.0000, val 3.5000 (ppl 33.1)",
                                 "step 20: loss 2.0000, val 3.5000 (ppl 33.1)", "done at step 20, val 3.5000"]


def test_a_terminal_also_gets_a_status_line_that_evaluation_lines_never_overwrite():
    text = _run(_Terminal())
    assert "\rstep 5/20  loss 3.5000  1,000 tok/s" in text
    assert "\nstep 10: loss 3.0000, val 3.5000 (ppl 33.1)\n" in text      # on a line of its own
    assert text.endswith("done at step 20, val 3.5000\n")


def test_progress_is_wanted_in_a_terminal_only_by_default(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert wanted(_Terminal()) and not wanted(io.StringIO())
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    assert wanted(io.StringIO())


def test_chain_calls_every_callback():
    seen = []
    chain(None, lambda e, r: seen.append(("a", e)), lambda e, r: seen.append(("b", e)))("eval", {})
    assert seen == [("a", "eval"), ("b", "eval")]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_pipe_gets_the_status_as_a_whole_line_every_every_s_seconds():
    clock, stream = _Clock(), io.StringIO()
    p = TextProgress(stream, every_s=60.0, clock=clock)
    p("start", {"steps": 9, "tokens_per_step": 64, "device": "cpu", "run_dir": "r"})
    for step in range(1, 10):
        clock.now += 25.0                                   # a step every 25 s: a status line at 75 s and 150 s
        p("step", {"step": step, "loss": 1.0, "tokens_per_s": 10.0})
    lines = stream.getvalue().splitlines()
    assert lines[1:] == ["step 3/9  loss 1.0000  10 tok/s", "step 6/9  loss 1.0000  10 tok/s",
                         "step 9/9  loss 1.0000  10 tok/s"]
    quiet = io.StringIO()
    only = TextProgress(quiet, every_s=60.0, status_only=True, clock=clock)
    only("start", {"steps": 9})
    only("eval", {"step": 1, "loss": 1.0, "val_loss": 1.0, "val_ppl": 2.7})
    clock.now += 61.0
    only("step", {"step": 2, "loss": 1.0})
    assert quiet.getvalue() == "step 2/9  loss 1.0000  0 tok/s\n"     # the status alone


def test_a_time_fits_final_plan_is_a_line_and_few_steps_a_warning():
    stream = io.StringIO()
    p = TextProgress(stream)
    plan = {"step": 3, "steps": 40, "eval_every": 4, "warmup_steps": 4, "step_s": 1.5, "limit_s": 60.0,
            "final": False, "few": True}
    p("plan", plan)
    assert stream.getvalue() == "" and p.steps == 40                 # a plan still to be made again: no line
    p("plan", dict(plan, final=True))
    text = stream.getvalue()
    assert text.startswith("time limit 60 s: a step took 1.5 s in the first 3, so 40 steps fit (warmup 4")
    assert "Warning: only 40 steps fit" in text and "--steps without --time-limit-s" in text
    assert "Warning" not in plan_line(dict(plan, few=False))


def test_resolve_turns_train_progress_argument_into_a_callback(monkeypatch):
    import sys

    import pytest

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    mine = chain()
    assert resolve(None) is None and resolve(False) is None and resolve(mine) is mine
    assert isinstance(resolve(True), TextProgress)
    assert resolve("auto") is None                                 # stderr is no terminal under pytest
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    assert isinstance(resolve("auto"), TextProgress)               # a notebook
    with pytest.raises(ValueError, match="progress must be"):
        resolve("yes")


def test_train_prints_nothing_by_default_and_its_progress_when_asked(corpus, tmp_path, capsys):
    train(tiny_model(), _cfg(corpus, tmp_path / "quiet", steps=2, save_every=0))
    assert capsys.readouterr() == ("", "")
    train(tiny_model(), _cfg(corpus, tmp_path / "shown", steps=4, save_every=0), progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("training on cpu, 128 tokens/step, 4 steps -> ") and err[-1].startswith("done at step 4")
    assert any(line.startswith("step 4: loss ") for line in err)
