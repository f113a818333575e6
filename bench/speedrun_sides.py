"""The sides of bench.speedrun: the data prepared once, a logitlab run in a child process, a
nanoGPT run through its own train.py, and the one validation pass both are scored by.

Data (prepare): the demo's corpus, the standard library's source: a 4096-token BPE tokenizer
trained on 3 MB of it, 12 MB tokenized with 2% held out (logitlab's token directory), and the same
tokens as nanoGPT's data/<dataset>/{train,val}.bin (uint16) with its meta.pkl (vocab_size).

Validation: the first `eval_tokens` targets of the held-out split in sequential windows of T
(data.eval_windows, what logitlab's loop evaluates), for every side; bits per byte = their summed
nats / (ln 2 x their UTF-8 bytes) (the end-of-text targets count their nats and have no bytes).

nanoGPT: `train.py` with its small-model configuration (config/train_shakespeare_char.py:
lr 1e-3, beta2 0.99, warmup 100, cosine to lr/10) and our shape, data and step count, on the CPU,
fp32, not compiled, dropout 0 (as every logitlab recipe here); its own per-iteration times are the
clock. It evaluates on its own random validation batches (the curve's points); its final
checkpoint (ckpt.pt, loaded weights-only) is scored on the fixed windows above (the target).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DATASET = "speedrun"
VOCAB, TOKENIZER_BYTES, CORPUS_BYTES, VAL_FRACTION = 4096, 3_000_000, 12_000_000, 0.02


# --------------------------------------------------------------------------------------------
# Data, once
# --------------------------------------------------------------------------------------------

def prepare(workdir: Path) -> dict:
    """The tokenizer, logitlab's token directory and nanoGPT's bin files under `workdir` (kept:
    a second run reuses them) -> {"data": dir, "nanogpt_data": dir, "tokenizer": file}."""
    from logitlab.data import corpus, tokens
    from logitlab.tokenizer import bpe
    from logitlab.tokenizer.core import Tokenizer

    data, nano, tok_file = workdir / "data", workdir / "nanogpt_data", workdir / "tokenizer.logitlab.json"
    if not tok_file.is_file():
        files = corpus.spread_files(corpus.default_corpus_files(), TOKENIZER_BYTES, offset=1)
        bpe.train_tokenizer([str(p) for p in files], VOCAB, ["<|endoftext|>"]).save(tok_file)
    tok = Tokenizer.load(tok_file)
    if not (data / "manifest.json").is_file():
        tokens.prepare_corpus(None, tok, data, val_fraction=VAL_FRACTION, max_bytes=CORPUS_BYTES,
                              min_val_tokens=1 << 16)
    if not (nano / "meta.pkl").is_file():
        nano.mkdir(parents=True, exist_ok=True)
        for split in ("train", "val"):
            np.asarray(tokens.load_tokens(data, split), dtype=np.uint16).tofile(nano / f"{split}.bin")
        with open(nano / "meta.pkl", "wb") as f:       # nanoGPT's own format for its vocab size
            pickle.dump({"vocab_size": tok.vocab_size}, f)
    return {"data": str(data), "nanogpt_data": str(nano), "tokenizer": str(tok_file)}


def validation_bytes(paths: dict, seq_len: int, batch_size: int, eval_tokens: int) -> tuple[int, int]:
    """(targets, their UTF-8 bytes) of the fixed validation windows."""
    from logitlab.data import tokens
    from logitlab.data.batches import eval_windows
    from logitlab.eval.bpb import token_byte_lengths
    from logitlab.tokenizer.core import Tokenizer

    lengths = token_byte_lengths(Tokenizer.load(paths["tokenizer"]))
    n, nbytes = 0, 0
    for _x, y in eval_windows(tokens.load_tokens(paths["data"], "val"), seq_len, batch_size, eval_tokens):
        n, nbytes = n + y.numel(), nbytes + int(lengths[y].sum())
    return n, nbytes


def bits_per_byte(nats_per_token: float, targets: int, nbytes: int) -> float:
    return nats_per_token * targets / (math.log(2) * nbytes)


# --------------------------------------------------------------------------------------------
# A logitlab run, in a child process
# --------------------------------------------------------------------------------------------

def run_logitlab(spec: dict, workdir: Path) -> dict:
    """Train spec's model with spec's TrainConfig fields in a fresh interpreter -> its result
    (see logitlab_child)."""
    spec_file = workdir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(spec["threads"])} if spec.get("threads") else {}))
    proc = subprocess.run([sys.executable, "-m", "bench.speedrun", "--child", str(spec_file)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"logitlab run {spec['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads((Path(spec["train"]["out_dir"]) / "speedrun.json").read_text())


def logitlab_child(spec_file: str) -> None:
    """The child: train, then write OUT/speedrun.json = {"steps", "step_s": [each step's seconds],
    "curve": [[train seconds, tokens, val nats/token], ...], "params"}."""
    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.train.loop import TrainConfig, train

    spec = json.loads(Path(spec_file).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    out = Path(spec["train"]["out_dir"])
    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(spec["train"]["seed"])
    model = Transformer(ModelConfig.from_dict(spec["model"]))
    train(model, TrainConfig(**spec["train"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed, curve, step_s = 0.0, [], []
    for r in rows:
        if "time_s" in r:
            elapsed += r["time_s"]
            step_s.append(r["time_s"])
        if "val_loss" in r:
            curve.append([elapsed, r["tokens"], r["val_loss"]])
    (out / "speedrun.json").write_text(json.dumps({"steps": len(step_s), "step_s": step_s, "curve": curve,
                                                   "params": sum(p.numel() for p in model.parameters())}))
    for ckpt in out.glob("ckpt-*"):                # the weights are not needed: keep the disk free
        shutil.rmtree(ckpt)


# --------------------------------------------------------------------------------------------
# nanoGPT, through its own train.py
# --------------------------------------------------------------------------------------------

ITER = re.compile(r"^iter (\d+): loss ([-\d.e+]+), time ([\d.]+)ms")
EVAL = re.compile(r"^step (\d+): train loss ([-\d.e+]+), val loss ([-\d.e+]+)")


def nanogpt_args(folder: Path, shape: dict, steps: int, batch_size: int, eval_every: int, eval_iters: int) -> list[str]:
    """train.py's command line: its small-model configuration, then our shape, data and budget."""
    warmup = min(100, max(1, steps // 10))
    args = {"dataset": DATASET, "out_dir": "out", "device": "cpu", "dtype": "float32", "compile": False,
            "batch_size": batch_size, "block_size": shape["context_length"], "gradient_accumulation_steps": 1,
            "n_layer": shape["n_layers"], "n_head": shape["n_heads"], "n_embd": shape["d_model"], "dropout": 0.0,
            "max_iters": steps, "lr_decay_iters": steps, "warmup_iters": warmup, "eval_interval": eval_every,
            "eval_iters": eval_iters, "always_save_checkpoint": True, "log_interval": 1, "wandb_log": False}
    shown = [f"--{k}={v}" for k, v in args.items()]
    return [sys.executable, str(folder / "train.py"), str(folder / "config" / "train_shakespeare_char.py"), *shown]


def run_nanogpt(folder: Path, paths: dict, shape: dict, steps: int, batch_size: int, rundir: Path,
                eval_every: int, eval_iters: int, threads: int | None) -> dict:
    """train.py for `steps` iterations in `rundir` -> {"steps", "step_s", "curve": [[train seconds,
    tokens, its own val nats/token], ...], "ckpt"}. An evaluating iteration's time is replaced by
    the median iteration's (its evaluation is not training)."""
    if rundir.exists():
        shutil.rmtree(rundir)
    (rundir / "data").mkdir(parents=True)
    (rundir / "configurator.py").symlink_to(folder / "configurator.py")    # train.py reads it from its cwd
    (rundir / "data" / DATASET).symlink_to(Path(paths["nanogpt_data"]).resolve())
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    proc = subprocess.run(nanogpt_args(folder, shape, steps, batch_size, eval_every, eval_iters), cwd=rundir,
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nanoGPT's train.py failed in {rundir}:\n{proc.stderr[-3000:]}")
    times, evals = {}, {}
    for line in proc.stdout.splitlines():
        if m := ITER.match(line):
            times[int(m[1])] = float(m[3]) / 1000
        elif m := EVAL.match(line):
            evals[int(m[1])] = float(m[3])
    typical = statistics.median(times[i] for i in range(steps))
    step_s = [typical if i in evals or i == 0 else times[i] for i in range(steps)]
    tokens = batch_size * shape["context_length"]
    curve = [[sum(step_s[:i]), i * tokens, v] for i, v in sorted(evals.items()) if i > 0]
    return {"steps": steps, "step_s": step_s, "curve": curve, "ckpt": str(rundir / "out" / "ckpt.pt")}


def nanogpt_model(folder: Path, ckpt: str):
    """nanoGPT's GPT holding the weights of its checkpoint (torch.load weights_only: its dicts of
    numbers and strings, no code)."""
    sys.path.insert(0, str(folder))
    try:
        from model import GPT, GPTConfig  # nanoGPT's model.py
    finally:
        sys.path.remove(str(folder))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    return model


class FullLogits(torch.nn.Module):
    """nanoGPT's GPT called with targets, which makes it return the logits of every position
    (B, T, V) (without, only the last one's): what logitlab's evaluation expects of a model."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits, _ = self.gpt(ids, ids)
        return logits


def score_nanogpt(folder: Path, ckpt: str, paths: dict, seq_len: int, batch_size: int, eval_tokens: int) -> float:
    """Val nats/token of nanoGPT's checkpoint on the fixed windows (logitlab's evaluation pass)."""
    import contextlib
    import io

    from logitlab.data import tokens
    from logitlab.train.loss import evaluate

    with contextlib.redirect_stdout(io.StringIO()):            # nanoGPT prints its parameter count
        model = FullLogits(nanogpt_model(folder, ckpt))
    return evaluate(model, tokens.load_tokens(paths["data"], "val"), seq_len, batch_size, eval_tokens,
                    torch.device("cpu"))


def nanogpt_train_flops_per_token(shape: dict, vocab_size: int) -> float:
    """Training FLOPs per token of nanoGPT's model at this shape (GPT-2's layout: MHA, GELU MLP of
    4·D, learned positions, tied head), counted by logitlab's accounting."""
    from logitlab.model.accounting import flops_per_token
    from logitlab.model.transformer import ModelConfig

    c = ModelConfig(vocab_size=vocab_size, context_length=shape["context_length"], d_model=shape["d_model"],
                    n_layers=shape["n_layers"], n_heads=shape["n_heads"], norm="layernorm", mlp="gelu",
                    positions="learned", bias=False, tie_embeddings=True)
    return float(flops_per_token(c)["training"])


def muon_flops_per_step(model_config: dict, train: dict) -> float:
    """The Newton-Schulz products of one Muon step (not in the model's FLOPs): per block of rows,
    `muon_ns_steps` iterations of X X^T, A A and B X on the wide (m <= n) form, 4·m²·n + 2·m³."""
    if train.get("optimizer") != "muon":
        return 0.0
    from logitlab.model.accounting import meta_model
    from logitlab.model.transformer import ModelConfig
    from logitlab.train.muon import row_blocks

    model = meta_model(ModelConfig.from_dict(model_config))
    blocks, total = row_blocks(model), 0.0
    for name, p in model.named_parameters():
        if p.ndim != 2 or name.startswith(("tok_emb", "pos_emb", "lm_head", "value_embeds")):
            continue
        for rows in blocks.get(name, (p.shape[0],)):
            m, n = sorted((rows, p.shape[1]))
            total += train.get("muon_ns_steps", 5) * (4 * m * m * n + 2 * m ** 3)
    return total
