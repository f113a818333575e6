"""The training loop: TrainConfig, teacher-forced cross-entropy, evaluation, metrics, checkpoints.

train.py owns TrainConfig (frozen, validated; field help feeds the CLI flags) and `train()`,
one loop that: draws batches (data.RandomWindows), runs forward under bf16 autocast where
runtime chose it, computes cross-entropy on float32 logits, accumulates gradients over
micro-steps, clips by the global norm, steps AdamW on the warmup+cosine schedule, evaluates on
the fixed validation pass every `eval_every` steps, appends a metrics record per step to
RUN/metrics.jsonl (and TensorBoard when installed), and writes atomic run checkpoints
(checkpoint.save_checkpoint) that resume bit for bit.

Failure handling: a NaN/inf loss raises TrainingDiverged naming the step before the optimizer
applies it (the last good checkpoint stays); SIGINT/SIGTERM finish the current step, save a
checkpoint and return. Progress display is the caller's: `callback(event, record)`.

Several processes: the loop is written for one, and `ParallelHooks` (filled in from outside by
parallel.py) tells it this process's rank (its slice of each global batch and of the validation
windows), how to wrap the model (DDP/FSDP, before the optimizer is built), average a float over
ranks, clip sharded gradients, gather full model/optimizer states for saving and load them back.
Only rank 0 writes files. The defaults are one plain process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from logitlab import checkpoint as ckpt_io
from logitlab import data as data_io
from logitlab import files, layers, runtime
from logitlab.model import check_field_types, config_from_dict
from logitlab.optim import WarmupCosine, build_adamw, clip_grad_norm


def _f(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run (the model's live in ModelConfig)."""

    data_dir: str | None = _f(None, "prepared token directory (logitlab prepare); default: prepare the stdlib corpus")
    out_dir: str = _f("runs/run", "run directory: checkpoints, metrics.jsonl, plots")
    steps: int = _f(1000, "optimizer steps")
    batch_size: int = _f(16, "sequences per micro-step, summed over all ranks (B)")
    grad_accum: int = _f(1, "micro-steps accumulated per optimizer step")
    seq_len: int | None = _f(None, "tokens per sequence T (default: the model's context_length)")
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float | None = _f(None, "learning-rate floor of the cosine decay (default lr / 10)")
    warmup_steps: int | None = _f(None, "linear warmup steps (default min(100, steps // 10))")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)")
    decay_embeddings: bool = _f(False, "also decay the embedding tables")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    eval_every: int = _f(100, "evaluate every N steps (0 = only at the end)")
    eval_tokens: int = _f(65536, "validation tokens per evaluation (a fixed sequential pass)")
    eval_at_start: bool = _f(True, "also evaluate the untrained model (a step-0 record; about ln V)")
    save_every: int | None = _f(None, "checkpoint every N steps (default eval_every; 0 = only at the end)")
    keep_last: int = _f(2, "checkpoints kept besides the best by validation loss")
    seed: int = _f(1337, "seed of the model init, data order and dropout")
    device: str = _f("auto", "auto, cpu, cuda, cuda:N or mps")
    precision: Literal["auto", "fp32", "bf16"] = _f("auto", "auto = bf16 autocast on capable GPUs, else fp32")
    bf16_matmul: Literal["auto", "native", "fp32"] = _f(
        "auto", "bf16 matrix products on CPU: fp32 = float32 GEMMs over the bf16-rounded operands (same "
        "values up to summation order; 1.5-1.8x faster without AMX), native = bf16 kernels, auto = fp32 "
        "unless the CPU has AMX")
    keep_freed_memory: Literal["auto", "on", "off"] = _f(
        "auto", "CPU: let malloc keep freed tensor memory for reuse rather than page-faulting it in again "
        "every step (glibc; process-wide, see runtime.keep_freed_memory); auto = when compiling in fp32")
    compile: bool = _f(False, "torch.compile the model")
    parallel: Literal["none", "ddp", "fsdp"] = _f(
        "ddp", "under torchrun: data parallel (ddp) or fully sharded (fsdp); none = ignore other ranks")
    log_every: int = _f(1, "metrics record every N steps")
    time_limit_s: float | None = _f(None, "stop (evaluate, save) after the step that passes this many seconds")
    tensorboard: bool = _f(True, "also write TensorBoard events when tensorboard is installed")

    def __post_init__(self) -> None:
        if self.parallel not in ("none", "ddp", "fsdp"):
            raise ValueError(f"parallel must be 'none', 'ddp' or 'fsdp', got {self.parallel!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")
        if self.keep_freed_memory not in ("auto", "on", "off"):
            raise ValueError(f"keep_freed_memory must be 'auto', 'on' or 'off', got {self.keep_freed_memory!r}")
        if self.bf16_matmul not in layers.BF16_MATMUL_MODES:
            raise ValueError(f"bf16_matmul must be one of {layers.BF16_MATMUL_MODES}, got {self.bf16_matmul!r}")
        check_field_types(self)  # then types: a string "3e-4" for lr is named, and every float is finite
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", min(100, self.steps // 10))
        self._check_ranges()

    def _check_ranges(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_tokens", "keep_last", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("time_limit_s", "seq_len"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.eps <= 0:
            raise ValueError(f"weight_decay ({self.weight_decay}) and grad_clip ({self.grad_clip}) must be "
                             f">= 0 and eps ({self.eps}) > 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Inverse of to_dict; unknown keys are an error naming them."""
        return config_from_dict(cls, data)

    def schedule(self) -> WarmupCosine:
        min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        return WarmupCosine(self.lr, self.warmup_steps, self.steps, min_lr)


@dataclass
class ParallelHooks:
    """How the loop talks to other processes; the defaults are a single plain process.

    Collective hooks (all_reduce, clip, model_state, optimizer_state, load_state) are called on
    every rank at the same points; model_state / optimizer_state return full CPU states on rank 0
    (in the single-process layout, so a run saved with N ranks resumes with M)."""

    rank: int = 0
    world_size: int = 1
    wrap: Callable | None = None               # model -> wrapped module (DDP / FSDP2), in place or not
    all_reduce: Callable | None = None         # float -> mean over ranks
    clip: Callable | None = None               # (wrapped, max_norm) -> pre-clip global norm
    model_state: Callable | None = None        # wrapped -> full state dict (rank 0)
    optimizer_state: Callable | None = None    # (wrapped, optimizer) -> full optimizer state (rank 0)
    load_state: Callable | None = None         # (wrapped, model_state, optimizer, optimizer_state) -> None
    barrier: Callable | None = None            # wait for every rank (after rank 0 saved)
    sync: Callable | None = None               # (wrapped, sync: bool) -> context for a micro-step's backward

    @property
    def main(self) -> bool:
        return self.rank == 0


def _launched_distributed() -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()) or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def parallel_hooks(config: TrainConfig) -> ParallelHooks:
    """ParallelHooks for the job torchrun started (parallel.py: process group from the launcher's
    environment, config.parallel = "ddp" or "fsdp"); a plain process gets the defaults."""
    from logitlab import parallel as P

    if config.parallel == "none":
        return ParallelHooks()
    info = P.init_distributed(device="cpu" if config.device == "cpu" else None)
    if not info.distributed:
        return ParallelHooks()
    mixed = config.precision == "bf16" or (config.precision == "auto" and info.device.type == "cuda")
    return ParallelHooks(
        rank=info.rank, world_size=info.world_size,
        wrap=lambda m: P.wrap_model(m, config.parallel, mixed_precision=mixed, info=info),
        all_reduce=lambda v: float(P.all_reduce_mean(float(v))), clip=P.clip_grad_norm,
        model_state=P.full_state_dict, optimizer_state=P.full_optimizer_state_dict,
        load_state=P.load_full_state_dict, barrier=P.barrier, sync=P.sync_gradients)


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite (the update is never applied), or the
    weights did (never saved); the message names the step and the last good checkpoint."""


def _last_good(ckpt: Path | None) -> str:
    return f"the last good checkpoint is {ckpt}" if ckpt else "no checkpoint was written"


@dataclass
class TrainResult:
    run_dir: Path
    step: int                      # optimizer steps completed
    last_loss: float | None
    val_loss: float | None
    stopped: Literal["done", "signal", "time"]
    checkpoint: Path | None
    signal: int | None = None      # the signal that stopped the run (SIGINT 2, SIGTERM 15)


# --------------------------------------------------------------------------------------------
# Loss and evaluation
# --------------------------------------------------------------------------------------------

IGNORE_INDEX = -100  # a target equal to it adds nothing to the loss (F.cross_entropy's default)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats: logits (B, T, V) upcast to float32, targets (B, T)
    in [0, V) or IGNORE_INDEX (left out of the mean). Eager it is F.cross_entropy; compiled,
    _CrossEntropy (the same value, a backward the compiler fuses into one pass)."""
    B, T, V = logits.shape
    logits, targets = logits.reshape(B * T, V), targets.reshape(B * T)
    if torch.compiler.is_compiling():
        return _CrossEntropy.apply(logits, targets)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)


class _CrossEntropy(torch.autograd.Function):
    """F.cross_entropy(x.float(), t) (mean over the targets that are not IGNORE_INDEX) with its
    gradient written out: g * (softmax(x) - onehot(t)) / n on each kept row, zero on ignored ones.

    For the compiler only. Traced from F.cross_entropy, backward sums each row's one-hot gradient
    over V (a second pass comparing every column index with the target, in int64) before the
    softmax pass; here one pass recomputes the softmax from the saved logits and log-sum-exp,
    subtracts the one-hot part and writes the gradient in the logits' dtype (no float32 (N, V)
    buffer under bf16 autocast). The loss's fused kernels, forward + backward, CPU, 1 thread:
    small-Llama fp32 step (2048 x 8192 logits) 37-41 -> 24-29 ms, GPT-2 small bf16 step (1024 x
    50257) 106 -> 77 ms. Out-of-range targets fail in the compiled kernel's index check, as they
    do when F.cross_entropy is compiled."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        xf = x.float()                                               # (N, V)
        keep = t != IGNORE_INDEX                                     # (N,)
        t = torch.where(keep, t, 0)
        lse = torch.logsumexp(xf, dim=-1)                            # (N,)
        n = keep.sum()
        loss = torch.where(keep, lse - xf.gather(1, t[:, None]).squeeze(1), 0.0).sum() / n
        ctx.save_for_backward(x, t, keep, lse, n)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, t, keep, lse, n = ctx.saved_tensors
        w = torch.where(keep, grad / n, 0.0)[:, None]                # (N, 1) each row's weight
        pw = torch.exp(x.float() - lse[:, None]) * w                 # (N, V) softmax * weight
        cols = torch.arange(x.shape[1], device=x.device, dtype=torch.int32)
        onehot = cols == t.to(torch.int32)[:, None]                  # (N, V), int32: the cheaper compare
        return torch.where(onehot, pw - w, pw).to(x.dtype), None     # one pass, written in x's dtype


def loss_fn(model, compile: bool | str = False, fullgraph: bool = True) -> Callable:
    """-> loss(ids (B, T), targets (B, T)) = cross_entropy(model(ids), targets), the training step's loss.

    compile: False (eager), True (inductor) or a torch.compile backend name. Compiled, the model
    and the loss are traced as one graph, so the float32 upcast of the (B, T, V) logits, the
    log-softmax and their backward fuse with the LM head's output instead of running as separate
    passes over B x T x V floats (the largest tensors of a small model's step): the training step
    ran 1.01-1.04x faster than with the model compiled alone (small Llama and GPT-2 shapes of
    bench.model, fp32 and bf16 autocast, CPU, 1 thread).
    fullgraph: a graph break is an error (the plain model has none); pass False for a model
    wrapped by DDP/FSDP, whose hooks may break the graph."""
    def loss(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(model(ids), targets)
    if not compile:
        return loss
    backend = compile if isinstance(compile, str) else "inductor"
    return torch.compile(loss, fullgraph=fullgraph, backend=backend)


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Slow reference: -log softmax(logits)[target], averaged over every (b, t)."""
    logp = logits.double() - logits.double().logsumexp(dim=-1, keepdim=True)  # (B, T, V)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()


@torch.no_grad()
def evaluate(model, tokens, seq_len: int, batch_size: int, max_tokens: int, device,
             amp_dtype=None, rank: int = 0, world_size: int = 1, all_reduce=None) -> float:
    """Mean cross-entropy (nats/token) over the fixed sequential validation pass."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in data_io.eval_windows(tokens, seq_len, batch_size, max_tokens, rank, world_size):
        x, y = x.to(device), y.to(device)
        with runtime.autocast(device, amp_dtype):
            logits = model(x)
        total += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"))
        count += y.numel()
    model.train(was_training)
    if all_reduce is not None:
        total, count = all_reduce(total), all_reduce(float(count))
    return total / max(count, 1)


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token at context seq_len: accounting.flops_per_token's count (3 x the
    forward: 2 per matmul weight, LM head included, plus causal attention scores and values)."""
    from logitlab.accounting import flops_per_token as counted

    return float(counted(model.config, seq_len)["training"])


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------

class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves and returns after the current step. Installed
    only from the main thread; previous handlers are restored afterwards."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops without waiting
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _tensorboard_writer(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def train(model, config: TrainConfig, *, run_dir: str | os.PathLike | None = None, tokenizer=None,
          resume: bool = False, callback: Callable[[str, dict], None] | None = None,
          parallel: ParallelHooks | None = None, extra_state: dict | None = None,
          lock: bool = True) -> TrainResult:
    """Train `model` (an unwrapped Transformer, already initialised) per `config`.

    With resume=True the latest checkpoint of the run directory is loaded (weights, optimizer,
    schedule step, sampler position, RNG states, metrics) and the run continues exactly.
    `callback(event, record)` receives "start", "step", "eval", "checkpoint" and "end".
    `extra_state` (JSON) is stored in every checkpoint's state.json. `parallel` (ParallelHooks)
    defaults to parallel_hooks(config) inside a torchrun job or an initialised process group, else
    to one plain process. The writing process holds the run directory's lock (files.RunLock) for
    the whole run, so a second training in the same directory is refused; lock=False when the
    caller already holds it."""
    run_dir = Path(run_dir or config.out_dir)
    par = parallel if parallel is not None else (
        parallel_hooks(config) if _launched_distributed() else ParallelHooks())
    _check_inputs(model, config, tokenizer, par.world_size)  # every input error before anything is written
    with files.RunLock(run_dir) if (lock and par.main) else contextlib.nullcontext():
        return _train(model, config, run_dir, tokenizer, resume, callback, par, extra_state)


def _check_inputs(model, config: TrainConfig, tokenizer, world_size: int) -> None:
    """Errors in the data, the model's fit to it, or the batch split: raised before any write."""
    if config.data_dir is None:
        raise ValueError("TrainConfig.data_dir is not set: prepare a corpus first (logitlab prepare)")
    manifest = data_io.read_manifest(config.data_dir)
    seq_len = config.seq_len or model.config.context_length
    if seq_len > model.config.context_length:
        raise ValueError(f"seq_len ({seq_len}) exceeds the model's context_length ({model.config.context_length})")
    if manifest["vocab_size"] > model.config.vocab_size:
        raise ValueError(f"data vocab_size ({manifest['vocab_size']}) exceeds the model's vocab_size "
                         f"({model.config.vocab_size})")
    if tokenizer is not None and tokenizer.fingerprint() != manifest["tokenizer_fingerprint"]:
        raise ValueError(f"{config.data_dir} was tokenized with a different tokenizer "
                         f"(fingerprint {manifest['tokenizer_fingerprint'][:12]} vs {tokenizer.fingerprint()[:12]})")
    if config.batch_size % world_size:
        raise ValueError(f"batch_size ({config.batch_size}) must be divisible by world_size ({world_size})")
    for split in ("train", "val"):
        data_io.load_tokens(config.data_dir, split)  # sizes checked against the manifest


def check_new_run_dir(run_dir: str | os.PathLike) -> None:
    """A new run writes run.json, metrics.jsonl and the tokenizer into `run_dir`: refuse a
    directory whose run.json or metrics.jsonl are not a logitlab run's (nothing of the user's is
    overwritten), and one that already holds checkpoints (that is a resume)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} exists and is not a directory")
    if ckpt_io.latest_checkpoint(run_dir) is not None:
        raise ValueError(f"{run_dir} already holds checkpoints; use --resume {run_dir} or another --out-dir")
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
                             f"nothing is overwritten: choose another --out-dir")
    if metrics.exists() and not ours:
        raise ValueError(f"{metrics} exists without a logitlab run.json beside it; "
                         f"nothing is overwritten: choose another --out-dir")


RUN_FILE = "run.json"


def _train(model, config: TrainConfig, run_dir: Path, tokenizer, resume: bool, callback, par: ParallelHooks,
           extra_state: dict | None) -> TrainResult:
    rank, world_size, all_reduce, main = par.rank, par.world_size, par.all_reduce, par.main
    emit = callback or (lambda event, record: None)
    manifest = data_io.read_manifest(config.data_dir)
    seq_len = config.seq_len or model.config.context_length
    train_tokens = data_io.load_tokens(config.data_dir, "train")
    val_tokens = data_io.load_tokens(config.data_dir, "val")
    has_val = len(val_tokens) > seq_len
    device = runtime.pick_device(config.device)
    amp_dtype = runtime.autocast_dtype(device, config.precision)
    sampler = data_io.RandomWindows(train_tokens, seq_len, config.batch_size, config.seed, rank, world_size)
    schedule = config.schedule()

    model.to(device).train()
    metrics: list[dict] = []
    step, best_val, loaded = 0, None, None
    if main:  # we hold the lock: what a killed writer left is ours to clear
        ckpt_io.remove_stale_temporaries(run_dir)
    if not resume:
        check_new_run_dir(run_dir)
    latest = ckpt_io.latest_checkpoint(run_dir)
    if resume:
        if latest is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}")
        loaded = ckpt_io.load_checkpoint(latest, None if par.load_state else model)
        state = loaded["state"]
        step, best_val, metrics = state["step"], state.get("best_val_loss"), loaded["metrics"]
        sampler.load_state_dict(state["sampler"])
    else:
        runtime.seed_everything(config.seed)
    # wrap before building the optimizer: FSDP2 replaces the parameters with sharded ones
    wrapped = par.wrap(model) if par.wrap is not None else model
    optimizer = build_adamw(model, config.lr, config.weight_decay, (config.beta1, config.beta2),
                            config.eps, config.decay_embeddings)
    if loaded is not None:
        opt_state = ckpt_io.load_optimizer_state(latest)
        if par.load_state is not None:
            par.load_state(wrapped, ckpt_io.load_model_state(latest), optimizer, opt_state)
        else:
            optimizer.load_state_dict(opt_state)
        if loaded["rng"] is not None:
            try:
                runtime.restore_rng_state(loaded["rng"])
            except ValueError as exc:
                raise ValueError(f"{latest / ckpt_io.RNG_FILE}: {exc}") from None
    # compiled: the model and the loss as one graph (a wrapped model may break it)
    compute_loss = loss_fn(wrapped, config.compile, fullgraph=par.wrap is None)

    tokens_per_step = config.batch_size * config.grad_accum * seq_len  # global, all ranks
    fpt = flops_per_token(model, seq_len)
    peak = runtime.matmul_peak_flops(device, amp_dtype) * world_size
    writer = _tensorboard_writer(run_dir) if (main and config.tensorboard) else None
    save_every = config.eval_every if config.save_every is None else config.save_every
    metrics_path = run_dir / ckpt_io.METRICS_FILE
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        files.atomic_write_text(run_dir / RUN_FILE, json.dumps(
            {"train": config.to_dict(), "model": model.config.to_dict(), "data": manifest}, indent=2) + "\n")
        if tokenizer is not None:
            with files.writing(run_dir / ckpt_io.TOKENIZER_FILE):
                tokenizer.save(run_dir / ckpt_io.TOKENIZER_FILE)
        # after a resume the file restarts from the checkpoint's copy (drops steps past it)
        files.atomic_write_text(metrics_path, "".join(json.dumps(m) + "\n" for m in metrics))
    metrics_file = metrics_path.open("a") if main else None

    def save(val_loss: float | None) -> Path | None:
        model_state = par.model_state(wrapped) if par.model_state is not None else None  # collective
        opt_state = par.optimizer_state(wrapped, optimizer) if par.optimizer_state is not None else None
        if not main:
            if par.barrier is not None:
                par.barrier()
            return None
        state = {"sampler": sampler.state_dict(), "schedule": dataclasses.asdict(schedule),
                 "train_config": config.to_dict(), "val_loss": val_loss, "best_val_loss": best_val,
                 "tokens_seen": step * tokens_per_step, **(extra_state or {})}
        try:
            path = ckpt_io.save_checkpoint(run_dir, step, model, optimizer, state=state,
                                           rng=runtime.capture_rng_state(), tokenizer=tokenizer,
                                           metrics=metrics, keep_last=config.keep_last,
                                           model_state=model_state, optimizer_state=opt_state)
        except files.DiskFullError as exc:
            raise files.DiskFullError(exc.errno, f"{exc.strerror}; {_last_good(last_ckpt)}") from exc
        except ckpt_io.NonFiniteError as exc:
            raise TrainingDiverged(f"{exc} at step {step}; {_last_good(last_ckpt)}") from exc
        if par.barrier is not None:
            par.barrier()
        emit("checkpoint", {"step": step, "path": str(path)})
        return path

    # auto: compiled float32 steps only. A compiled fp32 step reuses a few planned buffers, so
    # keeping freed memory costs it little peak (GPT-2 small: 0-11%); under bf16 autocast the
    # casts of every size fragment the kept heap: GPT-2 small's compiled bf16 step peaked at
    # 3,054-3,288 MiB with it and 2,410 without (transformers: 3,063-3,101), the eager one +29%.
    keep = config.keep_freed_memory == "on" or (
        config.keep_freed_memory == "auto" and config.compile and amp_dtype is None)
    if device.type == "cpu" and keep:
        runtime.keep_freed_memory()                                # process-wide, not undone
    matmul_mode = layers.bf16_matmul_mode()
    layers.set_bf16_matmul(config.bf16_matmul)                     # restored when the run ends
    try:  # the metrics file and the TensorBoard writer are closed however the run ends
        emit("start", {"step": step, "steps": config.steps, "tokens_per_step": tokens_per_step,
                       "device": str(device), "amp": str(amp_dtype), "run_dir": str(run_dir)})
        if step == 0 and has_val and config.eval_at_start:  # no RNG is drawn: resume stays exact
            val0 = evaluate(wrapped, val_tokens, seq_len, config.batch_size // world_size, config.eval_tokens,
                            device, amp_dtype, rank, world_size, all_reduce)
            record0 = {"step": 0, "tokens": 0, "val_loss": val0, "val_ppl": math.exp(min(val0, 700.0))}
            metrics.append(record0)
            if metrics_file is not None:
                metrics_file.write(json.dumps(record0) + "\n")
                metrics_file.flush()
            emit("eval", record0)
        last_loss, val_loss, last_ckpt, stopped = None, None, latest if resume else None, "done"
        started = time.perf_counter()
        with _StopFlag() as stop:
            while step < config.steps:
                t0 = time.perf_counter()
                lr = schedule.apply(optimizer, step)
                loss_sum = 0.0
                for micro in range(config.grad_accum):
                    x, y = sampler.next()
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    # several processes: gradients are averaged over ranks on the last micro-step only
                    last = micro == config.grad_accum - 1
                    with par.sync(wrapped, last) if par.sync is not None else contextlib.nullcontext():
                        with runtime.autocast(device, amp_dtype):
                            loss = compute_loss(x, y)
                        (loss / config.grad_accum).backward()
                    loss_sum += float(loss.detach())
                step_loss = loss_sum / config.grad_accum
                if all_reduce is not None:
                    step_loss = all_reduce(step_loss)
                if not math.isfinite(step_loss):
                    optimizer.zero_grad(set_to_none=True)
                    raise TrainingDiverged(f"loss is {step_loss} at step {step + 1} (lr {lr:.3g}); "
                                           f"the run stopped before applying it; {_last_good(last_ckpt)}")
                grad_norm = (par.clip(wrapped, config.grad_clip) if par.clip is not None
                             else clip_grad_norm(model.parameters(), config.grad_clip))
                if not math.isfinite(grad_norm):  # the loss was finite, its gradient is not
                    optimizer.zero_grad(set_to_none=True)
                    raise TrainingDiverged(f"gradient norm is {grad_norm} at step {step + 1} (loss {step_loss:.4g}, "
                                           f"lr {lr:.3g}); the run stopped before applying it; "
                                           f"{_last_good(last_ckpt)}")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                runtime.synchronize(device)
                step += 1
                last_loss = step_loss
                dt = time.perf_counter() - t0
                record = {"step": step, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens": step * tokens_per_step, "tokens_per_s": tokens_per_step / dt,
                          "mfu": fpt * tokens_per_step / dt / peak, "time_s": dt}
                out_of_time = config.time_limit_s is not None and time.perf_counter() - started > config.time_limit_s
                final = step == config.steps or stop.signum is not None or out_of_time
                if has_val and ((config.eval_every and step % config.eval_every == 0) or final):
                    val_loss = evaluate(wrapped, val_tokens, seq_len, config.batch_size // world_size,
                                        config.eval_tokens, device, amp_dtype, rank, world_size, all_reduce)
                    record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 700.0)))
                    if best_val is None or val_loss < best_val:
                        best_val = val_loss
                    emit("eval", record)
                if step % config.log_every == 0 or final or "val_loss" in record:
                    metrics.append(record)
                    if metrics_file is not None:
                        metrics_file.write(json.dumps(record) + "\n")
                        metrics_file.flush()
                    if writer is not None:
                        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss", "val_ppl"):
                            if key in record:
                                writer.add_scalar(key, record[key], step)
                emit("step", record)
                if final or stop.signum is not None or (save_every and step % save_every == 0):
                    last_ckpt = save(record.get("val_loss")) or last_ckpt
                if stop.signum is not None or out_of_time:
                    stopped = "signal" if stop.signum is not None else "time"
                    break
    finally:
        layers.set_bf16_matmul(matmul_mode)
        if metrics_file is not None:
            metrics_file.close()
        if writer is not None:
            writer.close()
    result = TrainResult(run_dir, step, last_loss, val_loss, stopped, last_ckpt,
                         stop.signum if stopped == "signal" else None)
    emit("end", dataclasses.asdict(result))
    return result

