"""Supervised fine-tuning: the pretraining loop's parts, on conversations with a masked loss.

sft.py owns what SFT adds to training. The data side (reading conversations, the loss mask,
packing) is data/sft.py's; the step, the optimizer, checkpoints, exact resume and the metrics
sink are the pretraining loop's own parts (train/loop.py, train/build.py), recomposed here:

* `forward_packed(model, inputs)`: a packed row holds several conversations; attention is kept
  inside each one by a block-diagonal causal mask (query t reads key s when s <= t and both
  belong to the same conversation) passed to each block's SDPA, and positions restart at 0 in
  each conversation. A row with one conversation gives exactly `model(ids)`'s logits (tested).
  Transformer.forward's own mask is a key-padding mask (B, S), which cannot say this, so the
  embeddings, blocks and head are run here the way Transformer._run runs them.
* `sft_loss` / `evaluate_sft`: next-token cross-entropy over the trained targets only, the
  validation pass over held-out conversations (mean over their trained tokens).
* `run_sft`: set up a Run whose sampler is data.sft.RowBatches, then step, evaluate (with an
  optional `on_eval(model, step)` for sample generations, which the caller writes: training does
  not import generation), record and save, as `train` does.

Shapes: B rows, T tokens per row, D d_model, V vocab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from logitlab.data import sft as sft_data
from logitlab.io import files
from logitlab.train import lora, runtime
from logitlab.train.build import Run, build_optimizer, load_resume, restore_optimizer, write_run_files
from logitlab.train.config import SFTConfig, TrainConfig  # noqa: F401  (SFTConfig: importable from here)
from logitlab.train.hooks import ParallelHooks
from logitlab.train.loop import TrainResult, save, train_step
from logitlab.train.loss import IGNORE_INDEX, cross_entropy
from logitlab.train.metrics import MetricsSink


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """segments (B, T) -> mask (B, 1, T, T) bool: causal and inside one conversation. A padding
    token (segment -1) reads only itself, so no softmax row is empty."""
    B, T = segments.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()      # (T, T)
    same = segments[:, :, None] == segments[:, None, :]                              # (B, T, T)
    own = torch.eye(T, dtype=torch.bool, device=segments.device)                     # (T, T)
    return ((same & causal) | own)[:, None]                                          # (B, 1, T, T)


def forward_packed(model, inputs: sft_data.PackedInputs) -> torch.Tensor:
    """PackedInputs (ids, segments, positions: (B, T)) -> logits (B, T, V), each conversation of
    a row attending only to itself, with its own positions."""
    ids, positions = inputs.ids, inputs.positions
    V = model.config.vocab_size
    if model.config.attention != "causal":
        raise ValueError(f"SFT trains a causal model, got attention={model.config.attention!r}: an encoder "
                         "reads the tokens it should predict")
    if ids.numel() and not torch.compiler.is_compiling() and not 0 <= int(ids.min()) <= int(ids.max()) < V:
        raise ValueError(f"token ids must lie in 0..{V - 1}, got {int(ids.min())}..{int(ids.max())}")
    x = model.tok_emb(ids)                                         # (B, T, D)
    if model.pos_emb is not None:
        x = x + model.pos_emb(positions)                           # (B, T, D)
    rope = None
    if model.rope is not None:
        cos, sin = model.rope(positions)                           # (B, T, 1, Dh)
        rope = (cos.to(x.dtype), sin.to(x.dtype))
    mask = document_mask(inputs.segments)                          # (B, 1, T, T)
    for i, block in enumerate(model.blocks):
        x, _ = block(x, rope, layer=i, mask=mask, is_causal=False, impl=model.attn_impl,
                     value_embed=model.value_embedding(i, ids))
    return model.unembed(x)                                        # (B, T, V)


def sft_loss(model) -> Callable:
    """-> loss(inputs, targets) = mean cross-entropy over the trained targets (IGNORE_INDEX elsewhere)."""
    def loss(inputs: sft_data.PackedInputs, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(forward_packed(model, inputs), targets)
    return loss


@torch.no_grad()
def evaluate_sft(model, rows: sft_data.Rows, batch_size: int, device, amp_dtype=None) -> float:
    """Mean cross-entropy (nats) over every trained target of `rows`, in order (draws no RNG)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        part = slice(start, start + batch_size)
        inputs = sft_data.PackedInputs(rows.ids[part], rows.segments[part], rows.positions[part]).to(device)
        targets = rows.targets[part].to(device)
        with runtime.autocast(device, amp_dtype):
            logits = forward_packed(model, inputs)
        total += float(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((targets != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / count if count else float("nan")


def split_conversations(conversations: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then the last round(N * val_fraction) (at least one when N > 1) held out."""
    order = torch.randperm(len(conversations), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(len(order) * val_fraction)) if val_fraction > 0 and len(order) > 1 else 0
    train = [conversations[i] for i in order[:len(order) - n_val]]
    return train, [conversations[i] for i in order[len(order) - n_val:]]


def build_sft_rows(tokenizer, sft: SFTConfig, seq_len: int, seed: int) -> tuple[sft_data.Rows, sft_data.Rows | None]:
    """The train and validation Rows of an SFT run (validation None when nothing is held out)."""
    conversations = sft_data.read_conversations(sft.data)
    if sft.val_data is not None:
        train, val = conversations, sft_data.read_conversations(sft.val_data)
    else:
        train, val = split_conversations(conversations, sft.val_fraction, seed)

    def rows(convs):
        examples = [sft_data.encode_conversation(tokenizer, m, sft.train_on) for m in convs]
        return sft_data.build_rows(examples, seq_len, sft.pack)
    return rows(train), (rows(val) if val else None)


def setup_sft(model, tokenizer, config: TrainConfig, sft: SFTConfig, run_dir: Path, resume: bool,
              device: torch.device, amp_dtype, base: str | None = None) -> tuple[Run, sft_data.Rows | None]:
    """The Run of an SFT job (the loop's parts, with RowBatches as its sampler) and its validation rows."""
    seq_len = config.seq_len or model.config.context_length
    if seq_len > model.config.context_length:
        raise ValueError(f"seq_len ({seq_len}) exceeds the model's context_length ({model.config.context_length})")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}; "
                         f"grow the model first (logitlab tokenizer add-special)")
    train_rows, val_rows = build_sft_rows(tokenizer, sft, seq_len, config.seed)
    manifest = {"sft": dataclasses.asdict(sft), "train_rows": len(train_rows), "val_rows": len(val_rows or ()),
                "train_trained_tokens": train_rows.trained_tokens, "truncated": train_rows.truncated,
                "dropped": train_rows.dropped}
    par = ParallelHooks()
    extra = {"sft": dataclasses.asdict(sft), "base": base}
    if lora.lora_modules(model):
        _lora_hooks(par, model, lambda: run.last_ckpt)
        extra["lora"] = dataclasses.asdict(model.lora_config)
    run = Run(config, run_dir, par, model, device, amp_dtype, seq_len, manifest,
              sft_data.RowBatches(train_rows, config.batch_size, config.seed), val_tokens=(),
              schedule=config.schedule(), tokenizer=tokenizer, extra_state=extra)
    model.to(device).train()
    loaded = load_resume(run, resume)
    build_optimizer(run)
    run.compute_loss = sft_loss(run.wrapped)
    restore_optimizer(run, loaded)
    return run, val_rows


ADAPTERS_FILE = "adapters.safetensors"


def _lora_hooks(par: ParallelHooks, model, last_ckpt: Callable) -> None:
    """A LoRA run's checkpoint: model.safetensors holds the merged weights (so every loader, from
    generation to an export, reads it as a plain model) and ADAPTERS_FILE the adapters alone. A
    resume rebuilds the frozen base from --base, wraps it again, and loads the adapters from
    there, so it continues bit for bit."""
    def load(wrapped, _merged_state, optimizer, optimizer_state) -> None:
        from safetensors.torch import load_file

        path = last_ckpt() / ADAPTERS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: this LoRA run's checkpoint holds no adapters")
        missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
        if unexpected or any(".lora_" in k for k in missing):
            raise ValueError(f"{path} does not match the model's adapters (unexpected {unexpected[:3]})")
        optimizer.load_state_dict(optimizer_state)
    par.model_state = lambda wrapped: lora.merged_model(model).state_dict()
    par.load_state = load


def _save(run: Run, val_loss) -> Path | None:
    """loop.save, and for a LoRA run the adapters beside the merged model (see _lora_hooks)."""
    path = save(run, val_loss)
    if path is not None and lora.lora_modules(run.model):
        from safetensors.torch import save as to_bytes

        adapters = {k: v.detach().cpu().contiguous() for k, v in lora.lora_state_dict(run.model).items()}
        files.atomic_write_bytes(path / ADAPTERS_FILE, to_bytes(adapters))
    return path


def _sft_loop(run: Run, val_rows, sink: MetricsSink, emit, on_eval) -> tuple[float | None, float | None]:
    config = run.config
    last_loss = val_loss = None
    started = time.perf_counter()

    def evaluate(record: dict) -> None:
        nonlocal val_loss
        val_loss = evaluate_sft(run.model, val_rows, config.batch_size, run.device, run.amp_dtype)
        record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 700.0)))
        if run.best_val is None or val_loss < run.best_val:
            run.best_val = val_loss
        if on_eval is not None:
            record["samples"] = on_eval(run.model, run.step)
        emit("eval", record)

    if run.step == 0 and val_rows is not None and config.eval_at_start:
        record0 = {"step": 0, "tokens": 0}
        evaluate(record0)
        sink.add(record0, scalars=False)
    while run.step < config.steps:
        t0 = time.perf_counter()
        last_loss, grad_norm, lr = train_step(run)
        record = {"step": run.step, "loss": last_loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens": run.step * run.tokens_per_step, "time_s": time.perf_counter() - t0}
        out_of_time = config.time_limit_s is not None and time.perf_counter() - started > config.time_limit_s
        final = run.step == config.steps or out_of_time
        if val_rows is not None and ((config.eval_every and run.step % config.eval_every == 0) or final):
            evaluate(record)
        sink.add(record)
        emit("step", record)
        save_every = config.eval_every if config.save_every is None else config.save_every
        if final or (save_every and run.step % save_every == 0):
            run.last_ckpt = _save(run, record.get("val_loss"))
            emit("checkpoint", {"step": run.step, "path": str(run.last_ckpt)})
        if out_of_time:
            break
    return last_loss, val_loss


def sft_lr(model, config: TrainConfig) -> TrainConfig:
    """`config` with lr filled in when it was left unset: pretraining's default for the model's size
    (TrainConfig.for_model) for LoRA, whose adapters start from zero, and a tenth of it for full
    fine-tuning, which moves weights that are already trained."""
    if getattr(config, "lr", None) is not None or not hasattr(config, "for_model"):
        return config
    lr = config.for_model(model).lr
    return dataclasses.replace(config, lr=lr if lora.lora_modules(model) else lr / 10)


def run_sft(model, tokenizer, config: TrainConfig, sft: SFTConfig, *, run_dir: str | os.PathLike | None = None,
            resume: bool = False, callback: Callable[[str, dict], None] | None = None,
            on_eval: Callable | None = None, base: str | None = None) -> TrainResult:
    """Fine-tune `model` (a Transformer, or one wrapped with LoRA adapters: only parameters that
    require grad are optimised) on `sft.data`. Checkpoints, resume and metrics as `train`;
    `on_eval(model, step)` -> JSON-ready samples stored in each evaluation's record. `base` (the
    directory the model came from) and a LoRA run's LoRAConfig are recorded in each checkpoint's
    state.json, so lora_peft.export_lora_checkpoint can rebuild the base and its adapters."""
    run_dir = Path(run_dir or config.out_dir)
    config = sft_lr(model, config)
    emit = callback or (lambda event, record: None)
    device = runtime.pick_device(config.device)
    amp_dtype = runtime.autocast_dtype(device, config.precision)
    with files.RunLock(run_dir):
        run, val_rows = setup_sft(model, tokenizer, config, sft, run_dir, resume, device, amp_dtype, base)
        write_run_files(run)
        emit("start", {"step": run.step, "steps": config.steps, "run_dir": str(run_dir), **run.manifest})
        sink = MetricsSink(run_dir, run.metrics, True)
        with contextlib.closing(sink):
            last_loss, val_loss = _sft_loop(run, val_rows, sink, emit, on_eval)
    stopped = "done" if run.step >= config.steps else "time"
    result = TrainResult(run_dir, run.step, last_loss, val_loss, stopped, run.last_ckpt)
    emit("end", dataclasses.asdict(result))
    return result
