"""Training with an N-D parallel layout (logitlab.parallel: ZeRO stages, tensor/sequence and
pipeline parallelism, hybrid meshes, activation checkpointing) and sharded checkpoints, and the
export of a sharded checkpoint to a Hugging Face directory.

`train_parallel` is the compact loop for layouts the main loop (loop.py) does not take yet
(pipeline schedules, tensor parallelism): the same data (RandomWindows, each data-parallel rank
its rows of every global batch), schedule, clipping and AdamW, a sharded checkpoint
RUN/dcp-STEP every `save_every` steps, and RUN/metrics.jsonl from rank 0. Resume reads the
newest sharded checkpoint, whichever layout wrote it. `nd_hooks` instead lets the main loop
run the data-parallel layouts of a plan (ddp, zero2, fsdp, HSDP) with its gathered checkpoints.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from logitlab.data import tokens as data_io
from logitlab.io import files
from logitlab.parallel import sharded
from logitlab.parallel.apply import parallelize
from logitlab.parallel.mesh import ParallelPlan
from logitlab.parallel.setup import DistInfo, init_distributed
from logitlab.parallel.wrap import shard_for_rank
from logitlab.train.config import TrainConfig

CKPT_PREFIX = "dcp-"


@dataclass
class ParallelResult:
    run_dir: Path
    step: int
    losses: list[float]
    checkpoint: Path | None


def latest_sharded(run_dir: str | os.PathLike) -> Path | None:
    """The newest RUN/dcp-STEP directory (complete by construction: written atomically)."""
    run_dir = Path(run_dir)
    found = sorted(p for p in run_dir.glob(f"{CKPT_PREFIX}*") if p.is_dir() and p.name[len(CKPT_PREFIX):].isdigit())
    return found[-1] if found else None


def _rows(sampler_offsets, tokens, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 tokens at the offsets -> inputs (B, T), targets (B, T)."""
    windows = torch.stack([torch.as_tensor(tokens[o:o + seq_len + 1].astype("int64")) for o in sampler_offsets])
    return windows[:, :-1], windows[:, 1:]


def _batch(tokens, seq_len: int, global_batch: int, seed: int, step: int, dp: DistInfo):
    """This data-parallel rank's rows of the global batch of `step` (drawn from seed and step
    alone: the same for every layout and after a resume)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    offsets = torch.randint(0, len(tokens) - seq_len - 1, (global_batch,), generator=g).tolist()
    return _rows(shard_for_rank(offsets, dp), tokens, seq_len)


def train_parallel(model, config: TrainConfig, plan: ParallelPlan, *, run_dir: str | os.PathLike | None = None,
                   resume: bool = False, info: DistInfo | None = None) -> ParallelResult:
    """Train `model` (built, the same weights on every rank) per `config` with layout `plan`."""
    info = info or init_distributed(device="cpu" if config.device == "cpu" else None)
    config = config.for_model(model)   # lr: the size's default unless set
    run_dir = Path(run_dir or config.out_dir)
    seq_len = config.seq_len or model.config.context_length
    tokens = data_io.load_tokens(config.data_dir, "train")
    par = parallelize(model, plan, info, seq_len=seq_len, mixed_precision=config.precision == "bf16")
    optimizer = par.build_optimizer(config.lr, config.weight_decay, (config.beta1, config.beta2), config.eps)
    schedule, step, losses, last = config.schedule(), 0, [], None
    if resume:
        last = latest_sharded(run_dir)
        if last is None:
            raise FileNotFoundError(f"--resume: no sharded checkpoint ({CKPT_PREFIX}STEP) in {run_dir}")
        step = sharded.load_sharded(last, par, optimizer)["step"]
    while step < config.steps:
        lr = schedule.apply(optimizer, step)
        local = None
        for micro in range(config.grad_accum):
            x, y = _batch(tokens, seq_len, config.batch_size, config.seed, step * config.grad_accum + micro, par.dp)
            out = par.forward_backward(x, y, sync=micro == config.grad_accum - 1, scale=1 / config.grad_accum)
            local = out if local is None or out is None else local + out
        loss = par.global_loss(None if local is None else local / config.grad_accum)
        norm = par.clip_grad_norm(config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        losses.append(loss)
        if info.is_main:
            _append_metrics(run_dir, {"step": step, "loss": loss, "grad_norm": norm, "lr": lr})
        if step == config.steps or (config.save_every and step % config.save_every == 0):
            last = sharded.save_sharded(run_dir / f"{CKPT_PREFIX}{step:06d}", par, optimizer, step=step,
                                        state={"train_config": config.to_dict()})
    return ParallelResult(run_dir, step, losses, last)


def _append_metrics(run_dir: Path, record: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def export_sharded_to_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, tokenizer=None, *,
                         overwrite: bool = False) -> Path:
    """A sharded checkpoint (any layout) -> a Hugging Face directory, in one process on the CPU,
    reading the weights only (the optimizer state's shards are never loaded)."""
    from logitlab.io.hf import HF_KIND, save_pretrained
    from logitlab.model.config import ModelConfig
    from logitlab.model.transformer import Transformer

    files.check_output_dir(out_dir, HF_KIND, overwrite=overwrite, source=checkpoint_dir)
    meta, state = sharded.read_model_state(checkpoint_dir)
    config = ModelConfig.from_dict(meta["model_config"])
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


def nd_hooks(config: TrainConfig, plan: ParallelPlan, info: DistInfo | None = None):
    """ParallelHooks that let the main loop (loop.train) run a data-parallel layout of a plan:
    ddp, zero2, fsdp over dp_shard, HSDP over dp_replicate x dp_shard, with activation
    checkpointing. Checkpoints stay the gathered format (full states on rank 0, fused keys)."""
    from logitlab.parallel import setup, state, tensor, wrap
    from logitlab.parallel.apply import clip_grad_norm_nd
    from logitlab.train.hooks import ParallelHooks

    info = info or init_distributed(device="cpu" if config.device == "cpu" else None)
    plan = plan.resolve(info.world_size)
    if plan.pp > 1 or plan.tp > 1:
        raise ValueError("nd_hooks: --pp and --tp run through train_parallel: the main loop gives every rank "
                         "its own rows and lets rank 0 alone write, but TP ranks share rows and a pipeline "
                         "schedule owns forward and backward")
    if plan.parallel == "zero1" and plan.dp > 1:
        raise ValueError("nd_hooks: zero1 needs the loop to build parallel.zero.build_zero_optimizer "
                         "(ZeroRedundancyOptimizer); use train_parallel")
    holder = {}

    def wrap_model(model):
        holder["par"] = parallelize(model, plan, info, seq_len=config.seq_len,
                                    mixed_precision=config.precision == "bf16")
        return holder["par"].model

    def model_state(wrapped):
        return tensor.join_fused_state(state.full_state_dict(wrapped))

    def load_state(wrapped, full, optimizer, optimizer_state):
        config_ = wrap.unwrap(wrapped).config
        state.load_full_state_dict(wrapped, tensor.split_fused_state(full, config_), optimizer, optimizer_state)

    return ParallelHooks(
        rank=info.rank, world_size=info.world_size, wrap=wrap_model,
        all_reduce=lambda v: float(setup.all_reduce_mean(float(v))),
        clip=lambda wrapped, max_norm: clip_grad_norm_nd(list(wrapped.parameters()), max_norm),
        model_state=model_state, optimizer_state=state.full_optimizer_state_dict, load_state=load_state,
        barrier=setup.barrier, sync=wrap.sync_gradients)
