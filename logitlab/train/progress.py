"""The progress a Python `train()` shows by itself: a line per evaluation, and in a terminal a
status line of step, loss and speed rewritten in place.

progress.py owns the one place where the library writes to a stream for a person: train() runs
for minutes to hours, and `train(model, config)` from a script or a notebook would otherwise say
nothing until it returns (nanoGPT and the Hugging Face Trainer both print as they go). It is a
train callback like any other, writing plain text to the stream it is given (stderr by default);
the CLI draws its own richer view (cli/progress.py) and passes progress=False.
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
    """A train callback that writes progress to `stream`: the start and every evaluation as a line;
    in a terminal also a status line (step, loss, tokens/s) rewritten at most every `interval` s."""

    def __init__(self, stream=None, interval: float = 0.5) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval, self.last, self.steps, self.status = interval, 0.0, None, False

    def __call__(self, event: str, r: dict) -> None:
        if event == "start":
            self.steps = r.get("steps")
            self._line(f"training on {r.get('device')}, {r.get('tokens_per_step', 0):,} tokens/step, "
                       f"{self.steps} steps -> {r.get('run_dir')}")
        elif event == "step" and self.live and time.monotonic() - self.last >= self.interval:
            self.last = time.monotonic()
            self.stream.write(f"\rstep {r['step']}/{self.steps}  loss {r['loss']:.4f}  "
                              f"{r.get('tokens_per_s', 0):,.0f} tok/s ")
            self.stream.flush()
            self.status = True
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


def chain(*callbacks):
    """One train callback that calls each of `callbacks` (None ones left out) in turn."""
    live = [c for c in callbacks if c is not None]

    def call(event: str, record: dict) -> None:
        for c in live:
            c(event, record)

    return call
