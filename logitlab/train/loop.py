"""The training loop, in parts that another trainer (SFT, LoRA) recomposes.

`train()` composes: `setup` (data and sampler, the model on its device, `load_resume` or a seed,
`build_optimizer`: the wrapped model, AdamW and the step's loss, `restore_optimizer`: a
checkpoint's optimizer and generator states, so a resumed run continues bit for bit),
`train_step` (the micro-steps, the finite checks, the optimizer step), `evaluate_run` (the fixed
validation pass), `save` (an atomic run checkpoint) and the metrics sink (metrics.MetricsSink:
RUN/metrics.jsonl and TensorBoard). TrainConfig (config.py), the loss (loss.py) and
ParallelHooks (hooks.py) are importable from here too.

Failure handling: a NaN/inf loss or gradient norm raises TrainingDiverged naming the step before
the optimizer applies it (the last good checkpoint stays); SIGINT/SIGTERM, and under torchrun
the death of its launcher, finish the current step, save a checkpoint and return. Progress
display is the caller's: `callback(event, record)`.

Several processes: ParallelHooks tells the loop this process's data-parallel rank (its slice of
each global batch and of the validation windows), how to wrap the model (DDP/FSDP, before the
optimizer is built), average a float over ranks, clip sharded gradients, gather full
model/optimizer states for saving and load them back. Only the main process writes files. N-D
layouts (tensor and pipeline parallel, ZeRO-1: train.layouts.sharded_hooks) run through
this same loop: their hooks also set the run up, run a micro-step's forward and backward,
evaluate and write sharded checkpoints (RUN/dcp-STEP). The defaults are one plain process.

Process-wide state: TrainConfig.keep_freed_memory calls kernels.allocator.keep_freed_memory,
which changes the process's malloc for good (it cannot be undone). The CPU bf16 matmul route
(kernels.cpu_bf16) is installed into the model for the run and removed when it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from logitlab.data import tokens as data_io
from logitlab.io import checkpoint as ckpt_io
from logitlab.io import files
from logitlab.kernels import allocator
from logitlab.model import accounting
from logitlab.train import progress as progress_view
from logitlab.train import runtime
from logitlab.train.build import RUN_FILE, Run, check_new_run_dir, setup, write_run_files
from logitlab.train.config import TrainConfig
from logitlab.train.hooks import ParallelHooks
from logitlab.train.layouts import parallel_hooks
from logitlab.train.loss import IGNORE_INDEX, cross_entropy, cross_entropy_reference, evaluate, loss_fn
from logitlab.train.metrics import MetricsSink
from logitlab.train.metrics import tensorboard_writer as _tensorboard_writer
from logitlab.train.optim import clip_grad_norm
from logitlab.train.timefit import Replanner, TimeFit

__all__ = ["IGNORE_INDEX", "RUN_FILE", "ParallelHooks", "Run", "TrainConfig", "TrainResult", "TrainingDiverged",
           "check_new_run_dir", "cross_entropy", "cross_entropy_reference", "evaluate", "evaluate_run",
           "flops_per_token", "loss_fn", "parallel_hooks", "save", "setup", "train", "train_step"]


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
    stopped: Literal["done", "signal", "time", "launcher"]   # launcher: torchrun's agent died
    checkpoint: Path | None
    signal: int | None = None      # the signal that stopped the run (SIGINT 2, SIGTERM 15)


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token at context seq_len: accounting.flops_per_token's count (3 x the
    forward: 2 per matmul weight, LM head included, plus causal attention scores and values)."""
    from logitlab.model.accounting import flops_per_token as counted

    return float(counted(model.config, seq_len)["training"])


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


def train(model, config: TrainConfig, *, run_dir: str | os.PathLike | None = None, tokenizer=None,
          resume: bool = False, callback: Callable[[str, dict], None] | None = None,
          parallel: ParallelHooks | None = None, extra_state: dict | None = None,
          lock: bool = True, progress=None, time_fit: TimeFit | None = None) -> TrainResult:
    """Train `model` (an unwrapped Transformer, already initialised) per `config`.

    With resume=True the latest checkpoint of the run directory is loaded (weights, optimizer,
    schedule step, sampler position, RNG states, metrics) and the run continues exactly.
    `callback(event, record)` receives "start", "step", "eval", "checkpoint", "plan" (time_fit)
    and "end". `progress`: what shows the run's progress, none by default (the library prints
    nothing unless asked): True for train.progress.TextProgress on stderr, "auto" for it only
    in a terminal or a notebook, or a callback of its own (the CLI's live view).
    `time_fit` (timefit.TimeFit, with config.time_limit_s): a new run re-plans its step count,
    warmup and evaluation interval from its own first steps so that the schedule ends inside
    the limit ("plan" events say what was planned; one process only).
    `extra_state` (JSON) is stored in every checkpoint's state.json. `parallel` (ParallelHooks)
    defaults to layouts.parallel_hooks(config, run_dir, resume): the layout of a torchrun job or
    an initialised process group, the N-D hooks for --tp / --pp / zero1 or a resume from a
    sharded checkpoint, else one plain process. The writing process holds the run directory's
    lock (files.RunLock) for the whole run, so a second training in the same directory is
    refused; lock=False when the caller already holds it."""
    run_dir = Path(run_dir or config.out_dir)
    config = config.for_model(model)  # lr: the size's default unless set
    par = parallel if parallel is not None else parallel_hooks(config, run_dir, resume)
    _check_inputs(model, config, tokenizer, par.world_size)  # every input error before anything is written
    if time_fit is not None and (config.time_limit_s is None or par.world_size > 1):
        raise ValueError("time_fit re-plans the steps to config.time_limit_s on one process: "
                         f"time_limit_s is {config.time_limit_s}, world size {par.world_size}")
    emit = progress_view.chain(callback, progress_view.resolve(progress))
    with files.RunLock(run_dir) if (lock and par.main) else contextlib.nullcontext():
        return _train(model, config, run_dir, tokenizer, resume, emit, par, extra_state, time_fit)


def _check_inputs(model, config: TrainConfig, tokenizer, world_size: int) -> None:
    """Errors in the data, the model's fit to it, or the batch split: raised before any write."""
    if config.data_dir is None:
        raise ValueError("TrainConfig.data_dir is not set: prepare a corpus first (logitlab prepare)")
    if model.config.attention != "causal":
        raise ValueError(f"the training loop trains next-token prediction, which needs attention='causal' "
                         f"(got {model.config.attention!r}: the model would read the token it predicts); "
                         "train an encoder with the masked-LM objective, logitlab.train.loss.mlm_loss")
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


def train_step(run: Run) -> tuple[float, float, float]:
    """One optimizer step: grad_accum micro-steps (gradients averaged over ranks on the last one
    only), the loss and gradient-norm checks (TrainingDiverged before anything is applied), the
    clipped AdamW step on the schedule's learning rate. -> (loss, pre-clip gradient norm, lr)."""
    config, par = run.config, run.par
    lr = run.schedule.apply(run.optimizer, run.step)
    loss_sum, has_loss = 0.0, False
    for micro in range(config.grad_accum):
        x, y = run.sampler.next()
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        loss = _micro_step(run, x, y, micro == config.grad_accum - 1)
        if run.routing is not None:
            run.routing.add(run.compute_loss.last)
        if loss is not None:   # None: a pipeline rank without the last stage
            loss_sum, has_loss = loss_sum + float(loss), True
    step_loss = loss_sum / config.grad_accum if has_loss else None
    if par.all_reduce is not None:
        step_loss = par.all_reduce(step_loss)
    if not math.isfinite(step_loss):
        run.optimizer.zero_grad(set_to_none=True)
        raise TrainingDiverged(f"loss is {step_loss} at step {run.step + 1} (lr {lr:.3g}); "
                               f"the run stopped before applying it; {_last_good(run.last_ckpt)}")
    grad_norm = (par.clip(run.wrapped, config.grad_clip) if par.clip is not None
                 else clip_grad_norm(run.model.parameters(), config.grad_clip))
    if not math.isfinite(grad_norm):  # the loss was finite, its gradient is not
        run.optimizer.zero_grad(set_to_none=True)
        raise TrainingDiverged(f"gradient norm is {grad_norm} at step {run.step + 1} (loss {step_loss:.4g}, "
                               f"lr {lr:.3g}); the run stopped before applying it; {_last_good(run.last_ckpt)}")
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    runtime.synchronize(run.device)
    run.step += 1
    return step_loss, grad_norm, lr


def _micro_step(run: Run, x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor | None:
    """Forward and backward of one micro-batch x, y (b, T), the gradients scaled by 1 / grad_accum
    and synchronised over ranks on the `last` micro-step only -> its mean loss (detached)."""
    par, accum = run.par, run.config.grad_accum
    if par.forward_backward is not None:   # N-D layouts: the layout's own step (a pipeline schedule)
        with runtime.autocast(run.device, run.amp_dtype):
            return par.forward_backward(run.wrapped, x, y, last, 1.0 / accum)
    with par.sync(run.wrapped, last) if par.sync is not None else contextlib.nullcontext():
        with runtime.autocast(run.device, run.amp_dtype):
            loss = run.compute_loss(x, y)
        (loss / accum).backward()
    return loss.detach()


def evaluate_run(run: Run) -> float:
    """The fixed validation pass over this rank's windows, averaged over ranks (draws no RNG)."""
    c, par = run.config, run.par
    if par.evaluate is not None:
        return par.evaluate(run)
    return evaluate(run.wrapped, run.val_tokens, run.seq_len, c.batch_size // par.world_size, c.eval_tokens,
                    run.device, run.amp_dtype, par.rank, par.world_size, par.all_reduce)


def save(run: Run, val_loss: float | None) -> Path | None:
    """An atomic run checkpoint of the current step (collective: every rank calls it; rank 0
    writes) -> its path on rank 0, None elsewhere. A full disk or non-finite weights name the
    last good checkpoint."""
    par = run.par
    if par.save is not None:   # sharded: every rank writes its own shards
        return _saving(run, lambda: par.save(run, _checkpoint_state(run, val_loss)))
    model_state = par.model_state(run.wrapped) if par.model_state is not None else None  # collective
    opt_state = par.optimizer_state(run.wrapped, run.optimizer) if par.optimizer_state is not None else None
    if not par.main:
        if par.barrier is not None:
            par.barrier()
        return None
    path = _saving(run, lambda: ckpt_io.save_checkpoint(
        run.run_dir, run.step, run.model, run.optimizer, state=_checkpoint_state(run, val_loss),
        rng=runtime.capture_rng_state(), tokenizer=run.tokenizer, metrics=run.metrics,
        keep_last=run.config.keep_last, model_state=model_state, optimizer_state=opt_state))
    if par.barrier is not None:
        par.barrier()
    return path


def _checkpoint_state(run: Run, val_loss: float | None) -> dict:
    """What a checkpoint's state.json holds besides the step: the sampler position, schedule,
    configs, validation losses and tokens seen (and the caller's extra state); "kept" (never
    pruned, io.checkpoint.prune_checkpoints) at the last step of a WSD schedule's stable phase."""
    kept = ({"kept": "the end of the stable phase: a run resumed from here with more --steps continues as "
                     "one planned that long"} if run.step == _stable_end(run) else {})
    return {"sampler": run.sampler.state_dict(), "schedule": dataclasses.asdict(run.schedule),
            "train_config": run.config.to_dict(), "val_loss": val_loss, "best_val_loss": run.best_val,
            "tokens_seen": run.tokens_seen, **kept, **(run.extra_state or {})}


def _stable_end(run: Run) -> int | None:
    """The steps done when a warmup-stable-decay schedule's decay begins (None for the cosine)."""
    return getattr(run.schedule, "decay_start", None)


def _saving(run: Run, write: Callable[[], Path | None]) -> Path | None:
    """write(), with a full disk and non-finite weights naming the last good checkpoint."""
    try:
        return write()
    except files.DiskFullError as exc:
        raise files.DiskFullError(exc.errno, f"{exc.strerror}; {_last_good(run.last_ckpt)}") from exc
    except ckpt_io.NonFiniteError as exc:
        raise TrainingDiverged(f"{exc} at step {run.step}; {_last_good(run.last_ckpt)}") from exc


def _evaluate_at_start(run: Run, sink: MetricsSink, emit) -> None:
    """The untrained model's validation loss as a step-0 record (no RNG is drawn: resume stays exact)."""
    if run.step == 0 and run.has_val and run.config.eval_at_start:
        val0 = evaluate_run(run)
        record0 = {"step": 0, "tokens": 0, "val_loss": val0, "val_ppl": math.exp(min(val0, 700.0))}
        sink.add(record0, scalars=False)
        emit("eval", record0)


def _loop(run: Run, sink: MetricsSink, stop: _StopFlag, emit,
          time_fit: TimeFit | None = None) -> tuple[str, float | None, float | None]:
    """Steps until config.steps (re-planned by a time_fit), a signal or the time limit: step,
    evaluate, record, save. -> (stopped, last loss, last validation loss)."""
    fpt = flops_per_token(run.model, run.seq_len)
    peak = accounting.matmul_peak_flops(run.device, run.amp_dtype) * (run.par.devices or run.par.world_size)
    last_loss = val_loss = None
    clock = time_fit.clock if time_fit is not None else time.perf_counter
    started = clock()
    planner = Replanner(time_fit, run, started) if time_fit is not None and run.step == 0 else None
    while run.step < run.config.steps:
        t0 = clock()
        last_loss, grad_norm, lr = train_step(run)
        step, now, tps = run.step, clock(), run.tokens_per_step
        dt = max(now - t0, 1e-9)
        record = {"step": step, "loss": last_loss, "lr": lr, "grad_norm": grad_norm, "tokens": run.tokens_seen,
                  "tokens_per_s": tps / dt, "mfu": fpt * tps / dt / peak, "time_s": dt}
        measured = _measurements(run, record, emit, planner.after_step(run, dt, now) if planner else None)
        config = run.config                    # re-planned by the time fit in its first steps
        save_every = config.eval_every if config.save_every is None else config.save_every
        reason = _stop_reason(run, stop, now - started)
        final = step == config.steps or reason is not None
        if run.has_val and ((config.eval_every and step % config.eval_every == 0) or final):
            val_loss = evaluate_run(run)
            record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 700.0)))
            if run.best_val is None or val_loss < run.best_val:
                run.best_val = val_loss
            emit("eval", record)
        if step % config.log_every == 0 or final or "val_loss" in record or measured:
            sink.add(record)
        emit("step", record)
        if run.par.agree is None and stop.signum is not None:   # one process: a signal during this step's
            reason = reason or "signal"                           # evaluation or callback stops it here too
        if final or reason is not None or (save_every and step % save_every == 0) or step == _stable_end(run):
            path = save(run, record.get("val_loss"))
            if path is not None:
                emit("checkpoint", {"step": step, "path": str(path)})
                run.last_ckpt = path
        if reason is not None:
            return reason, last_loss, val_loss
    return "done", last_loss, val_loss


def _measurements(run: Run, record: dict, emit, plan) -> bool:
    """A step record's measurements beside the loss: an MoE's routing (train.moe), this process's
    bf16 routes (on its first step's record), the freed-memory decision (allocator.FaultWatch)
    and the steps re-planned to the time limit (`plan`, timefit.Plan, also a "plan" event).
    -> whether the record holds a one-time measurement (so it is written whatever log_every says)."""
    if run.routing is not None:
        record.update(run.routing.step(run.model))
    measured = run.route_record is not None
    if measured:
        record.update(run.route_record)
        run.route_record = None
    decided = run.fault_watch.after_step() if run.fault_watch is not None else None
    if decided is not None:
        record.update(decided)
        emit("allocator", decided)
    if plan is not None:
        record.update(planned_steps=plan.steps, planned_step_s=plan.step_s)
        emit("plan", dataclasses.asdict(plan))
    return measured or decided is not None or plan is not None


def _stop_reason(run: Run, stop: _StopFlag, elapsed_s: float) -> str | None:
    """Whether the run stops after this step: "signal" (SIGINT/SIGTERM), "launcher" (torchrun's
    agent died: ParallelHooks.launcher_gone), "time" (the time limit), or None. The ranks agree
    (each flag OR'd over them): a signal, a dead launcher or the time limit may reach them at
    different steps, and they must stop after the same one."""
    limit = run.config.time_limit_s
    flags = (stop.signum is not None, run.par.launcher_gone is not None and run.par.launcher_gone(),
             limit is not None and elapsed_s > limit)
    if run.par.agree is not None:
        flags = run.par.agree(*flags)
    return next((name for name, on in zip(("signal", "launcher", "time"), flags) if on), None)


def _train(model, config: TrainConfig, run_dir: Path, tokenizer, resume: bool, emit, par: ParallelHooks,
           extra_state: dict | None, time_fit: TimeFit | None = None) -> TrainResult:
    device = runtime.pick_device(config.device)
    amp_dtype = runtime.autocast_dtype(device, config.precision)
    model.to(device)
    route = writer = sink = None
    try:  # the bf16 route, the metrics file and the TensorBoard writer end however the run ends
        route = runtime.install_bf16_route(model, config, device, amp_dtype)   # before wrapping
        run = (par.setup or setup)(model, config, run_dir, par, resume, device, amp_dtype, tokenizer, extra_state)
        writer = _tensorboard_writer(run_dir) if (par.main and config.tensorboard) else None
        write_run_files(run)
        sink = MetricsSink(run_dir, run.metrics, par.main, writer)
        policy = runtime.freed_memory_policy(config, device, amp_dtype)
        if policy == "keep":
            allocator.keep_freed_memory()                          # process-wide, cannot be undone
        run.fault_watch = allocator.FaultWatch() if policy == "watch" else None
        run.route_record = route.record() if route is not None else None
        emit("start", {"step": run.step, "steps": config.steps, "tokens_per_step": run.tokens_per_step,
                       "device": str(device), "amp": str(amp_dtype), "run_dir": str(run_dir), "layout": par.layout,
                       **(run.route_record or {"bf16_route": None, "bf16_route_timings_s": None})})
        _evaluate_at_start(run, sink, emit)
        with _StopFlag() as stop:
            stopped, last_loss, val_loss = _loop(run, sink, stop, emit, time_fit)
    finally:
        if route is not None:
            route.remove()
        if sink is not None:
            sink.close()
        elif writer is not None:
            writer.close()
    result = TrainResult(run_dir, run.step, last_loss, val_loss, stopped, run.last_ckpt,
                         stop.signum if stopped == "signal" else None)
    emit("end", dataclasses.asdict(result))
    return result
