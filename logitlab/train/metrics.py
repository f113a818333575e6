"""The metrics sink of a run: one JSON record a line in RUN/metrics.jsonl, the same scalars to
TensorBoard when it is installed, and the list of records every checkpoint keeps a copy of.
Only the writing process (rank 0) writes files."""

from __future__ import annotations

import json
from pathlib import Path

from logitlab.io import checkpoint as ckpt_io
from logitlab.io import files

SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss", "val_ppl",
           "ce_loss", "aux_loss", "z_loss", "router_entropy", "dropped")   # the last five: MoE runs


def tensorboard_writer(run_dir: Path):
    """A TensorBoard SummaryWriter for RUN/tensorboard, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


class MetricsSink:
    """Records in, lines out. `metrics` is the run's record list (a resumed run's starts with
    the checkpoint's copy, and metrics.jsonl is rewritten from it, dropping steps past it).
    Nothing is written when `main` is False; close() closes the file and the writer."""

    def __init__(self, run_dir: Path, metrics: list[dict], main: bool, writer=None):
        self.metrics, self.writer = metrics, writer
        self._file = None
        if main:
            path = run_dir / ckpt_io.METRICS_FILE
            files.atomic_write_text(path, "".join(json.dumps(m) + "\n" for m in metrics))
            self._file = path.open("a")

    def add(self, record: dict, scalars: bool = True) -> None:
        """Append `record` (its "step" is the TensorBoard step); scalars=False: the file only."""
        self.metrics.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if scalars and self.writer is not None:
            for key in SCALARS:
                if key in record:
                    self.writer.add_scalar(key, record[key], record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.writer is not None:
            self.writer.close()
