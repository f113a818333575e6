"""The set-up of a training run, before its first step: the data and sampler, the model on its
device, a resume (weights, step, sampler position, optimizer and generator states, so the run
continues bit for bit) or a fresh seed, the wrapped model with its optimizer and the step's loss,
and the run directory's files. `Run` holds what the loop's parts share.

A resume may also extend the model's context: when the model given has a longer context_length
and/or another rope_scaling than the checkpoint's config.json (nothing else may differ), the
weights and optimizer state load unchanged, the sampler keeps its batch counter but draws
windows of the new length, and a metrics record {"extended": ...} holds the change with the
validation loss just before it (at the old length) and of the extended model before its first
step (at the new one). run.json and every later checkpoint carry the extended config."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from logitlab.data import tokens as data_io
from logitlab.io import checkpoint as ckpt_io
from logitlab.io import files
from logitlab.train import runtime
from logitlab.train.config import TrainConfig
from logitlab.train.hooks import ParallelHooks
from logitlab.train.loss import evaluate, loss_fn
from logitlab.train.optim import build_adamw, build_adamw_by_role, role_groups

RUN_FILE = "run.json"


@dataclass
class Run:
    """What one training run holds between its parts: the model (unwrapped, for saving) and what
    wraps it, the optimizer, schedule, sampler and validation tokens, where and how it computes,
    and the progress a checkpoint keeps (step, best validation loss, metrics, last checkpoint)."""

    config: TrainConfig
    run_dir: Path
    par: ParallelHooks
    model: torch.nn.Module
    device: torch.device
    amp_dtype: torch.dtype | None
    seq_len: int
    manifest: dict
    sampler: data_io.RandomWindows
    val_tokens: object
    schedule: object = None
    wrapped: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    compute_loss: Callable | None = None
    step: int = 0
    best_val: float | None = None
    metrics: list = field(default_factory=list)
    last_ckpt: Path | None = None
    tokenizer: object = None
    extra_state: dict | None = None
    extension: dict | None = None      # a resume that extends the context: {field: [before, after]}
    tokens_offset: int = 0             # tokens_seen - step * tokens_per_step (non-zero after an extension)
    fault_watch: object = None         # keep_freed_memory "auto": the allocator.FaultWatch deciding it
    route_record: dict | None = None   # the CPU bf16 routes installed (cpu_bf16.Installed.record), until recorded
    routing: object = None             # an MoE model: train.moe.RoutingLog (router losses and loads per step)

    @property
    def has_val(self) -> bool:
        return len(self.val_tokens) > self.seq_len

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step, summed over all ranks."""
        return self.config.batch_size * self.config.grad_accum * self.seq_len

    @property
    def tokens_seen(self) -> int:
        """Training tokens up to this step, each step counted at its own shape."""
        return self.tokens_offset + self.step * self.tokens_per_step

    def count_tokens_from(self, state: dict) -> None:
        """Continue a checkpoint's token count (its state's tokens_seen at self.step) at this
        run's tokens per step, which an extension may have changed."""
        seen = int(state.get("tokens_seen", self.step * self.tokens_per_step))
        self.tokens_offset = seen - self.step * self.tokens_per_step


def build_data(model, config: TrainConfig, run_dir: Path, par: ParallelHooks, device: torch.device,
               amp_dtype) -> Run:
    """The data side of a run: train windows (RandomWindows, this rank's slice) and validation tokens."""
    seq_len = config.seq_len or model.config.context_length
    train_tokens = data_io.load_tokens(config.data_dir, "train")
    sampler = data_io.RandomWindows(train_tokens, seq_len, config.batch_size, config.seed, par.rank,
                                    par.world_size)
    return Run(config, run_dir, par, model, device, amp_dtype, seq_len, data_io.read_manifest(config.data_dir),
               sampler, data_io.load_tokens(config.data_dir, "val"), schedule=config.schedule())


def load_resume(run: Run, resume: bool) -> dict | None:
    """Clear what a killed writer left (we hold the lock), refuse a new run in a used directory,
    and with resume load the latest checkpoint's weights (unless the hooks load them), step,
    best validation loss, metrics and sampler position into `run`; without, seed every generator.
    -> the loaded checkpoint (None for a new run)."""
    if run.par.main:
        ckpt_io.remove_stale_temporaries(run.run_dir)
    if not resume:
        check_new_run_dir(run.run_dir)
        runtime.seed_everything(run.config.seed)
        return None
    latest = ckpt_io.latest_checkpoint(run.run_dir)
    if latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {run.run_dir}")
    run.extension = context_extension(ckpt_io.read_model_config(latest), run.model.config, latest)
    loaded = ckpt_io.load_checkpoint(latest, None if run.par.load_state else run.model)
    state = loaded["state"]
    run.step, run.best_val, run.metrics = state["step"], state.get("best_val_loss"), loaded["metrics"]
    if run.extension is None:
        run.sampler.load_state_dict(state["sampler"])
    elif run.step >= run.config.steps:
        raise ValueError(f"{latest} is at step {run.step}: extending the model there needs steps beyond it "
                         f"(steps is {run.config.steps})")
    else:  # the same counter, windows of the new length (seed unchanged: the run's own data order)
        if state["sampler"]["seed"] != run.sampler.seed:
            raise ValueError(f"sampler state has seed={state['sampler']['seed']}, this run has {run.sampler.seed}")
        run.sampler.index = int(state["sampler"]["index"])
        run.extension["seq_len"] = [state["sampler"]["seq_len"], run.seq_len]
        run.extension["batch_size"] = [state["sampler"]["batch_size"], run.config.batch_size]
        run.best_val = None   # losses at the new length do not compare with those at the old one
    run.count_tokens_from(state)
    run.last_ckpt = latest
    return loaded


EXTENDABLE = ("context_length", "rope_scaling")


def context_extension(before, after, where) -> dict | None:
    """{field: [before, after]} for the EXTENDABLE fields that differ between the checkpoint's
    ModelConfig and the model's, or None when they are equal. Any other difference, or a
    shorter context, is a ValueError naming it (`where` is the checkpoint)."""
    b, a = before.to_dict(), after.to_dict()
    if b == a:
        return None
    other = sorted(k for k in set(b) | set(a) if k not in EXTENDABLE and b.get(k) != a.get(k))
    if other:
        shown = "; ".join(f"{k}: {b.get(k)!r} -> {a.get(k)!r}" for k in other)
        raise ValueError(f"{where}: the model differs from the checkpoint's in {shown}; a resume may change "
                         f"only {' and '.join(EXTENDABLE)}")
    if a["positions"] == "learned" and a["context_length"] != b["context_length"]:
        raise ValueError(f"{where}: positions='learned' has a table of {b['context_length']} rows; its context "
                         "cannot be extended on a resume")
    if a["context_length"] < b["context_length"]:
        raise ValueError(f"{where}: context_length {b['context_length']} -> {a['context_length']}: a resume "
                         "may lengthen the context, not shorten it")
    return {k: [b[k], a[k]] for k in EXTENDABLE if b[k] != a[k]}


def record_extension(run: Run) -> None:
    """The metrics record of a context extension (see the module docstring): the last validation
    loss before it and the extended model's at the new length, before any step."""
    if run.extension is None:
        return
    before = [m["val_loss"] for m in run.metrics if "val_loss" in m]
    record = {"step": run.step, "extended": dict(run.extension),
              "val_loss_before": before[-1] if before else None}
    if run.has_val:
        c, par = run.config, run.par
        val = evaluate(run.wrapped, run.val_tokens, run.seq_len, c.batch_size // par.world_size, c.eval_tokens,
                       run.device, run.amp_dtype, par.rank, par.world_size, par.all_reduce)
        record.update(val_loss=val, val_ppl=math.exp(min(val, 700.0)))
    run.metrics.append(record)


def build_optimizer(run: Run) -> None:
    """Wrap the model (before the optimizer: FSDP2 replaces the parameters with sharded ones),
    build the optimizer (build_training_optimizer), and the step's loss (compiled: the model and
    the loss as one graph; a wrapped model may break it)."""
    config, par = run.config, run.par
    if config.attention_kernel == "triton":  # installed into the model before any wrapper sees it
        from logitlab.kernels import triton_install

        triton_install.install(run.model)
    run.wrapped = par.wrap(run.model) if par.wrap is not None else run.model
    run.optimizer = build_training_optimizer(run.model, config)
    run.compute_loss = loss_fn(run.wrapped, config.compile, fullgraph=par.wrap is None)
    if run.model.config.is_moe:  # + the router's losses; their parts logged (train.moe)
        from logitlab.train.moe import RouterLoss, RoutingLog

        run.compute_loss = RouterLoss(run.wrapped, run.model.config, config.compile)
        run.routing = RoutingLog(config.router_bias_update_rate)


def build_training_optimizer(model, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `config` asks for over `model` (unwrapped; after FSDP2 has sharded it):
    AdamW in its two groups (decay / no decay) unless a rate per role is set (embedding_lr,
    head_lr, matrix_lr: optim.role_groups), or MuonAdamW (muon.py) over the role groups."""
    rates = {"embedding": config.embedding_lr, "head": config.head_lr, "matrix": config.matrix_lr}
    if config.head_lr is not None and model.config.tie_embeddings:
        raise ValueError("head_lr needs an untied LM head (tie_embeddings=False): a tied head is the embedding "
                         "table, whose rate is embedding_lr")
    betas = (config.beta1, config.beta2)
    if config.optimizer == "adamw":
        if all(v is None for v in rates.values()):
            return build_adamw(model, config.lr, config.weight_decay, betas, config.eps, config.decay_embeddings)
        return build_adamw_by_role(model, config.lr, rates, config.weight_decay, betas, config.eps,
                                   config.decay_embeddings)
    from logitlab.train.muon import MUON_LR, MuonAdamW, row_blocks

    muon = dict(lr=config.matrix_lr or MUON_LR, weight_decay=config.muon_weight_decay,
                momentum=config.muon_momentum, nesterov=True, ns_steps=config.muon_ns_steps,
                ns_method=config.muon_ns, blocks=row_blocks(model))
    groups = role_groups(model, config.lr, weight_decay=config.weight_decay,
                         decay_embeddings=config.decay_embeddings, rates={**rates, "matrix": None}, muon=muon)
    return MuonAdamW(groups, betas=betas, eps=config.eps)


def restore_optimizer(run: Run, loaded: dict | None) -> None:
    """A resumed run: the optimizer's state (and the model's, through the hooks) and every
    generator's state from the checkpoint `run.last_ckpt`."""
    if loaded is None:
        return
    latest = run.last_ckpt
    opt_state = ckpt_io.load_optimizer_state(latest)
    if run.par.load_state is not None:
        run.par.load_state(run.wrapped, ckpt_io.load_model_state(latest), run.optimizer, opt_state)
    else:
        _load_optimizer_state(run.optimizer, opt_state, run.config, latest)
    if loaded["rng"] is not None:
        try:
            runtime.restore_rng_state(loaded["rng"])
        except ValueError as exc:
            raise ValueError(f"{latest / ckpt_io.RNG_FILE}: {exc}") from None


def _load_optimizer_state(optimizer, state: dict, config: TrainConfig, where) -> None:
    """optimizer.load_state_dict(state), a mismatch named: which optimizer wrote the checkpoint."""
    try:
        optimizer.load_state_dict(state)
    except ValueError as exc:
        groups = state.get("param_groups", [])
        wrote = "muon" if any(g.get("kind") == "muon" for g in groups) else "adamw"
        raise ValueError(f"{where}: its optimizer state ({wrote}, {len(groups)} groups) does not fit this run's "
                         f"optimizer ({config.optimizer}, {len(optimizer.param_groups)} groups: the optimizer and "
                         f"the rates per role must stay as the run began): {exc}") from None


def setup(model, config: TrainConfig, run_dir: Path, par: ParallelHooks, resume: bool, device: torch.device,
          amp_dtype, tokenizer=None, extra_state: dict | None = None) -> Run:
    """Everything a run needs before its first step, in order: data, the model on its device in
    training mode, resume or seed, wrap + optimizer, then the checkpoint's optimizer and RNG states."""
    run = build_data(model, config, run_dir, par, device, amp_dtype)
    run.tokenizer, run.extra_state = tokenizer, extra_state
    model.to(device).train()
    loaded = load_resume(run, resume)
    build_optimizer(run)
    restore_optimizer(run, loaded)
    record_extension(run)
    return run


def write_run_files(run: Run) -> None:
    """run.json (train and model configs, the data manifest) and the tokenizer; rank 0 only."""
    if not run.par.main:
        return
    run.run_dir.mkdir(parents=True, exist_ok=True)
    files.atomic_write_text(run.run_dir / RUN_FILE, json.dumps(
        {"train": run.config.to_dict(), "model": run.model.config.to_dict(), "data": run.manifest},
        indent=2) + "\n")
    if run.tokenizer is not None:
        with files.writing(run.run_dir / ckpt_io.TOKENIZER_FILE):
            run.tokenizer.save(run.run_dir / ckpt_io.TOKENIZER_FILE)


def check_new_run_dir(run_dir: str | os.PathLike) -> None:
    """A new run writes run.json, metrics.jsonl and the tokenizer into `run_dir`: refuse a
    directory whose run.json or metrics.jsonl are not a logitlab run's (nothing of the user's is
    overwritten), and one that already holds checkpoints (that is a resume)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} exists and is not a directory")
    if ckpt_io.latest_checkpoint(run_dir) is not None:
        raise ValueError(f"{run_dir} already holds checkpoints; use --resume {run_dir} or another --out")
    run_json, metrics = run_dir / RUN_FILE, run_dir / ckpt_io.METRICS_FILE
    ours = False
    if run_json.exists():
        try:
            payload = files.read_json(run_json)
            ours = isinstance(payload, dict) and {"train", "model"} <= set(payload)
        except ValueError:
            ours = False
        if not ours:
            raise ValueError(f"{run_json} exists and is not a logitlab run's run.json; "
                             f"nothing is overwritten: choose another --out")
    if metrics.exists() and not ours:
        raise ValueError(f"{metrics} exists without a logitlab run.json beside it; "
                         f"nothing is overwritten: choose another --out")
