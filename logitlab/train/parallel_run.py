"""Training with an N-D parallel layout (logitlab.parallel: ZeRO stages, tensor/sequence and
pipeline parallelism, hybrid meshes, activation checkpointing) through the main loop
(loop.train), and the export of a sharded checkpoint to a Hugging Face directory.

`train_parallel` is loop.train with layouts.sharded_hooks (an N-D layout with sharded
checkpoints RUN/dcp-STEP, sharded_run.NDLayout: the main loop's data order, evaluation, run
files, metrics, retention and resume, on any mesh), returning the losses of the steps it ran.
`export_sharded_to_hf` turns one such checkpoint into a Hugging Face directory.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from logitlab.io import files
from logitlab.parallel import sharded
from logitlab.parallel.mesh import ParallelPlan
from logitlab.parallel.setup import DistInfo, init_distributed
from logitlab.train.config import TrainConfig
from logitlab.train.layouts import nd_hooks, sharded_hooks  # noqa: F401  (nd_hooks: kept importable from here)
from logitlab.train.sharded_run import CKPT_PREFIX, latest_sharded, resumes_sharded  # noqa: F401  (the same)


@dataclass
class ParallelResult:
    run_dir: Path
    step: int
    losses: list[float]          # the global loss of every step this call ran
    checkpoint: Path | None
    val_loss: float | None = None


def train_parallel(model, config: TrainConfig, plan: ParallelPlan, *, run_dir: str | os.PathLike | None = None,
                   resume: bool = False, info: DistInfo | None = None, tokenizer=None) -> ParallelResult:
    """Train `model` (built, the same weights on every rank) per `config` with layout `plan`:
    loop.train with sharded_hooks (in one process: the layout collapsed to it)."""
    from logitlab.train.loop import train

    info = info or init_distributed(device="cpu" if config.device == "cpu" else None)
    run_dir = Path(run_dir or config.out_dir)
    config = dataclasses.replace(config, out_dir=str(run_dir))
    hooks = sharded_hooks(config, info, resume=resume, plan=plan if info.distributed else ParallelPlan())
    losses: list[float] = []

    def collect(event: str, record: dict) -> None:
        if event == "step":
            losses.append(record["loss"])

    result = train(model, config, run_dir=run_dir, tokenizer=tokenizer, resume=resume, callback=collect, progress=None,
                   parallel=hooks)
    return ParallelResult(run_dir, result.step, losses, result.checkpoint, result.val_loss)


def export_sharded_to_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, tokenizer=None, *,
                         overwrite: bool = False) -> Path:
    """A sharded checkpoint (any layout) -> a Hugging Face directory, in one process on the CPU,
    reading the weights only (the optimizer state's shards are never loaded). The tokenizer
    defaults to the run's (RUN/tokenizer.logitlab.json beside RUN/dcp-STEP), when it has one."""
    from logitlab.io.checkpoint import TOKENIZER_FILE
    from logitlab.io.hf import HF_KIND, check_exportable, load_tokenizer, save_pretrained
    from logitlab.model.config import ModelConfig
    from logitlab.model.transformer import Transformer

    run_dir = Path(checkpoint_dir).resolve().parent
    if tokenizer is None and (run_dir / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(run_dir)

    config = ModelConfig.from_dict(sharded.read_meta(checkpoint_dir)["model_config"])
    check_exportable(config, checkpoint_dir)                     # before anything is read or written
    files.check_output_dir(out_dir, HF_KIND, overwrite=overwrite, source=checkpoint_dir)
    _, state = sharded.read_model_state(checkpoint_dir)
    with torch.device("meta"):
        model = Transformer(config)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
        expected = set(model.state_dict()) - {"lm_head.weight"}
    else:
        expected = set(model.state_dict())
    if set(state) != expected:
        raise ValueError(f"{checkpoint_dir}: weights do not match the model config: missing "
                         f"{sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.rebuild_buffers()
    return save_pretrained(model, out_dir, tokenizer, overwrite=overwrite, source=checkpoint_dir)
