"""The progress a Python `train()` shows when asked (`train(..., progress=True)`, or "auto": in a
terminal or a notebook): a line per evaluation; in a terminal a status line of step, loss and
speed rewritten in place, elsewhere (a pipe, a log file, a notebook) that status as a whole line
every `every_s` seconds.

progress.py owns the one place where the library writes to a stream for a person: train() runs
for minutes to hours, and a script or a notebook would otherwise hear nothing until it returns
(nanoGPT and the Hugging Face Trainer both print as they go). It is a train callback like any
other, writing plain text to the stream it is given (stderr by default); by default train()
shows nothing. The CLI draws its own richer view (cli/progress.py) and, when its output is not a
terminal, adds TextProgress's periodic status lines (status_only).
"""

from __future__ import annotations

import sys
import time


def wanted(stream=None) -> bool:
    """Whether progress should show by default: the stream is a terminal, or this is a notebook
    (an IPython kernel is running; its stderr is not a terminal but is shown to the reader)."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) or "ipykernel" in sys.modules


class TextProgress:
    """A train callback that writes progress to `stream`: the start, every evaluation, a time fit's
    plan (train.timefit) and the end as lines; the status (step, loss, tokens/s) rewritten in
    place at most every `interval` s in a terminal, else as a whole line at most every `every_s` s
    (0: never). status_only: the status alone (a caller that writes the other lines itself).
    `clock`: the time source of both intervals (time.monotonic; tests pass their own)."""

    def __init__(self, stream=None, interval: float = 0.5, every_s: float = 60.0, status_only: bool = False,
                 clock=time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval, self.steps, self.status = (interval if self.live else every_s), None, False
        self.status_only, self.clock = status_only, clock
        self.last = clock()

    def __call__(self, event: str, r: dict) -> None:
        if event == "start":
            self.steps, self.last = r.get("steps"), self.clock()
            if not self.status_only:
                self._line(f"training on {r.get('device')}, {r.get('tokens_per_step', 0):,} tokens/step, "
                           f"{self.steps} steps -> {r.get('run_dir')}")
        elif event == "plan":
            self.steps = r["steps"]
            if r["final"] and not self.status_only:
                self._line(plan_line(r))
        elif event == "step" and (self.live or self.interval > 0) and self.clock() - self.last >= self.interval:
            self.last = self.clock()
            text = f"step {r['step']}/{self.steps}  loss {r['loss']:.4f}  {r.get('tokens_per_s', 0):,.0f} tok/s"
            if self.live:
                self.stream.write(f"\r{text} ")
                self.stream.flush()
                self.status = True
            else:
                self._line(text)
        elif self.status_only:
            return
        elif event == "eval":
            loss = f"loss {r['loss']:.4f}, " if r.get("loss") is not None else ""
            self._line(f"step {r['step']}: {loss}val {r['val_loss']:.4f} (ppl {r['val_ppl']:.1f})")
        elif event == "end":
            val = r.get("val_loss")
            self._line(f"done at step {r.get('step')}" + (f", val {val:.4f}" if val is not None else ""))

    def _line(self, text: str) -> None:
        """A whole line, first ending the status line when one is showing."""
        self.stream.write(("\n" if self.status else "") + text + "\n")
        self.stream.flush()
        self.status = False


def plan_line(plan: dict) -> str:
    """A time fit's plan (train.timefit.Plan as a dict) as a line, with a warning when few steps fit."""
    line = (f"time limit {plan['limit_s']:g} s: a step took {plan['step_s']:.3g} s in the first {plan['step']}, "
            f"so {plan['steps']:,} steps fit (warmup {plan['warmup_steps']}, the schedule ending at step "
            f"{plan['steps']}; evaluating every {plan['eval_every']})")
    if plan["few"]:
        line += (f". Warning: only {plan['steps']} steps fit, too few for the loss to come near what this model "
                 "reaches with a full schedule; give more time, or a fixed number of steps (--steps without "
                 "--time-limit-s) however long they take")
    return line


def resolve(progress):
    """train()'s `progress` argument -> a callback or None: None / False: none; True: TextProgress
    on stderr; "auto": TextProgress when `wanted()`; a callable: itself."""
    if progress is None or progress is False:
        return None
    if progress is True or (progress == "auto" and wanted()):
        return TextProgress()
    if progress == "auto":
        return None
    if callable(progress):
        return progress
    raise ValueError(f"progress must be None, True, False, 'auto' or a callback (event, record), got {progress!r}")


def chain(*callbacks):
    """One train callback that calls each of `callbacks` (None ones left out) in turn."""
    live = [c for c in callbacks if c is not None]

    def call(event: str, record: dict) -> None:
        for c in live:
            c(event, record)

    return call
