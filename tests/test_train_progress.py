"""The progress a Python train() shows by itself (train/progress.py): lines for the start and
each evaluation in any stream; in a terminal also a status line rewritten in place."""

from __future__ import annotations

import io

from logitlab.train.progress import TextProgress, chain, wanted


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
