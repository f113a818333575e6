"""The training loop with Muon and warmup-stable-decay on several ranks (tests/test_parallel_muon.py):

    torchrun --nproc_per_node 2 tests/_dist_muon.py OUT ddp fsdp

runs logitlab.train.train once per layout named, on the corpus OUT/prep, writing OUT/run_muon_<layout>
(the run that _dist_worker.train_config describes: global batch 8 rows, 2 micro-steps), with
optimizer="muon" and lr_schedule="wsd". Run in one plain process with the layout "none", it is the
reference the ranks must equal."""

from __future__ import annotations

import sys
from pathlib import Path

import _dist_worker as worker
import torch

from logitlab import parallel

RECIPE = dict(optimizer="muon", lr_schedule="wsd", decay_fraction=0.5, muon_ns="polar_express",
              muon_weight_decay=0.01, embedding_lr=1e-2)


def config(out: Path, layout: str):
    """The run of `layout` ("none": one process)."""
    return worker.train_config(out, layout, out_dir=str(out / f"run_muon_{layout}"),
                               parallel="none" if layout == "none" else layout, **RECIPE)


def run(out: Path, layout: str, resume: bool = False):
    from logitlab.train.loop import train

    return train(worker.tiny_model(vocab_size=257), config(out, layout), resume=resume)


def main(argv: list[str]) -> int:
    out, layouts = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    parallel.init_distributed(timeout_s=300)
    try:
        for layout in layouts:
            run(out, layout)
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
