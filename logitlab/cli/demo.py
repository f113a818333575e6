"""`logitlab demo`, the README's first command: the whole path on the default corpus, no flags.

It trains a tokenizer on part of the Python standard library, tokenizes more of it, trains a small
model for a time budget measured on the machine at hand, writes the run directory with its loss
plot, then samples a continuation of a prompt and shows the top next-token probabilities. The
pieces are the training commands' own (cli_train.py); this module only chooses the sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

from logitlab.cli import common as cli
from logitlab.cli.train import _prepare, _run_training, _train_tokenizer, exit_code, plot_run
from logitlab.cli.train_budget import REFERENCE

# The demo's sizes. The full demo tokenizes 12 MB spread over the default corpus and sets its step
# count from a short timing of the model, so that training takes about `train_seconds` on the machine at hand.
_DEMO = {
    "full": dict(vocab=4096, tok_bytes=3_000_000, corpus=12_000_000, val=0.02, train_seconds=240,
                 model=dict(context_length=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384),
                 train=dict(batch_size=16, lr=3e-3, eval_tokens=16384)),
    "quick": dict(vocab=512, tok_bytes=150_000, corpus=400_000, val=0.1, train_seconds=None,
                  model=dict(context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192),
                  train=dict(steps=60, warmup_steps=5, eval_every=20, batch_size=8, lr=3e-3, eval_tokens=4096)),
}
DEMO_PROMPT = "def main(argv=None):\n    "
# The full demo measured on an idle 2-core machine from a fresh clone (docs/training.md): the number a
# run is compared with at the end (cli/train_budget.py). `demo --steps 1016` does the same work on any machine.
FEW_STEPS = 300   # below this the demo's model is far from the reference: the end of the run says so


# What a demo run directory holds that the demo itself wrote; a rerun removes these and nothing
# else (a Hugging Face export or a note a user put beside them stays).
_DEMO_OUTPUTS = ("demo.json", "run.json", "metrics.jsonl", "loss.png", "tokenizer.logitlab.json",
                 "tokenizer.logitlab.vocab", "data",
                 "tensorboard")


def _clear_demo_run(out: Path) -> None:
    """Remove an earlier demo's outputs from `out` (which must be a demo run: demo.json)."""
    from logitlab.io import checkpoint

    if not (out / "demo.json").is_file():
        raise ValueError(f"{out} exists and is not a demo run directory; choose another --out")
    checkpoint.remove_stale_temporaries(out)
    for ckpt in checkpoint.list_checkpoints(out):
        checkpoint.delete_checkpoint(ckpt)
    for name in _DEMO_OUTPUTS:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def cmd_demo(args) -> int:
    from logitlab.io.files import RunLock

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (out / "demo.json").is_file():
        raise ValueError(f"{out} exists and is not a demo run directory; choose another --out")
    with RunLock(out):
        return _demo(args, out)


def _demo(args, out: Path) -> int:
    import torch

    from logitlab.model.families import get_preset
    from logitlab.model.transformer import Transformer
    from logitlab.train import budget, runtime
    from logitlab.train.loop import TrainConfig

    con = cli.console()
    spec = _DEMO["quick" if args.quick else "full"]
    if (out / "demo.json").is_file():
        _clear_demo_run(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({"quick": args.quick, **spec}, indent=2) + "\n")
    t0 = time.perf_counter()
    tok = _train_tokenizer(None, spec["vocab"], spec["tok_bytes"], con)
    ns = argparse.Namespace(data=None, text_field="text", column="text", val_fraction=spec["val"], workers=args.workers,
                            max_bytes=spec["corpus"])
    _prepare(ns, tok, out / "data", con)
    model_cfg = get_preset("tiny", vocab_size=tok.vocab_size, **spec["model"])
    torch.manual_seed(args.seed)
    model = Transformer(model_cfg)
    # The demo trains for a fixed time, so it keeps freed memory even though it does not compile
    # (its eager fp32 steps: 0.81-0.87x the time, peak +5-7%), set before the step is timed so the
    # step count fits the steps as they will run (train applies it again, a no-op).
    train_kw = dict(spec["train"], keep_freed_memory="on")
    if runtime.pick_device("auto").type == "cpu":                 # the device TrainConfig picks
        runtime.keep_freed_memory()
    threads, per_step = budget.time_training_step(model, train_kw["batch_size"], model_cfg.context_length,
                                                  threads=(torch.get_num_threads(), 1), repeats=3)
    con.print(f"a training step takes {per_step:.2f} s here with {threads} thread(s)")
    if args.steps is not None:                                  # fixed work: the reference's number of steps
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        train_kw.update(steps=args.steps, warmup_steps=max(1, args.steps // 20),
                        eval_every=max(1, args.steps // 6))
        con.print(f"{args.steps} steps (fixed: --steps), however long they take here")
    elif "steps" not in train_kw:
        seconds = args.train_seconds or spec["train_seconds"]
        eval_s = budget.eval_seconds(per_step, 1, train_kw["batch_size"], model_cfg.context_length,
                                     train_kw["eval_tokens"])
        fit = budget.fit_steps_to_budget(seconds, per_step, eval_s, evals=6, min_steps=60, max_steps=3000)
        train_kw.update(steps=fit.steps, warmup_steps=max(1, fit.steps // 20), eval_every=fit.eval_every,
                        time_limit_s=1.5 * seconds)  # if the machine gets busier than when timed
        con.print(f"{fit.steps} steps fit about {seconds:.0f} s")
    train_cfg = TrainConfig(data_dir=str(out / "data"), out_dir=str(out), seed=args.seed, **train_kw)
    con.print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters "
              f"(L={model_cfg.n_layers}, D={model_cfg.d_model}, V={model_cfg.vocab_size}, "
              f"T={model_cfg.context_length})")
    result = _run_training(model, train_cfg, tok, con, args.progress, False, lock=False)
    if result.stopped == "signal":
        return exit_code(result)
    png = plot_run(out)
    model.eval()
    _show_sample(model, tok, args.prompt, con, seed=args.seed)
    wall = time.perf_counter() - t0
    ln_v = math.log(tok.vocab_size)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    start_val = first.get("val_loss") if first.get("step") == 0 else None
    summary = {"val_loss": result.val_loss, "val_loss_start": start_val, "ln_V": ln_v, "wall_s": wall,
               "threads": threads, "steps": result.step,
               "tokens": result.step * train_cfg.batch_size * model_cfg.context_length}
    (out / "demo.json").write_text(json.dumps({"quick": args.quick, **spec, "result": summary}, indent=2) + "\n")
    val = f"{result.val_loss:.3f}" if result.val_loss is not None else "n/a"
    if start_val is not None:
        val = f"{start_val:.3f} -> {val}"
    con.print(f"\nvalidation loss {val} nats/token (uniform guess: ln V = {ln_v:.3f}); "
              f"total wall time {wall:.0f} s. Run directory: {out} (loss plot {png})", soft_wrap=True)
    if not args.quick:
        con.print(_against_reference(result.step, result.val_loss, args.steps is not None), soft_wrap=True)
    # soft_wrap: a command meant to be copied is never broken across lines by the console
    con.print(f"next: logitlab generate {out} 'def '", soft_wrap=True, markup=False)
    con.print(f"      logitlab export {out} --out {out}/hf", soft_wrap=True, markup=False)
    return 0


def _against_reference(steps: int, val_loss: float | None, fixed: bool) -> str:
    """The demo's result beside the reference run's, and what to do about a short run."""
    ref = REFERENCE
    reached = f" -> {val_loss:.2f}" if val_loss is not None else ""
    line = (f"reference: {ref['steps']:,} steps -> {ref['val_loss']:.2f} on {ref['machine']}; this run "
            f"{'took' if fixed else 'fitted'} {steps:,} steps{reached}")
    if not fixed and steps < FEW_STEPS:
        line += (f". Only {steps} steps fitted the time budget (a busy machine?): the loss is far from the "
                 f"reference; `logitlab demo --steps {ref['steps']}` does the reference's work however long it takes")
    return line


def _show_sample(model, tok, prompt: str, con, seed: int) -> None:
    """A sampled continuation of `prompt` and the top next-token probabilities after it."""
    from rich.markup import escape

    from logitlab.cli.common import print_table, quote_token
    from logitlab.generate.loop import SampleConfig, generate
    from logitlab.inspect.core import next_token_table

    ids = tok.encode_ordinary(prompt)
    result = generate(model, ids, SampleConfig(max_new_tokens=60, temperature=0.8, top_k=50, seed=seed),
                      eot_id=tok.eot_id)
    con.print("\n[bold]sample[/bold] (temperature 0.8, top-k 50):")
    con.print(prompt + tok.decode([i for i in result.tokens[0] if i != tok.eot_id]), markup=False)
    top = next_token_table(model, ids, k=10, token_text=lambda i: tok.decode([i])).before
    rows = [[str(c.id), escape(quote_token(tok.token_bytes(c.id))), f"{c.probability:.3f}"] for c in top]
    print_table(con, "next-token probabilities after the prompt", ["id", "token", "p"], rows, right=(0, 2))


def register(subparsers) -> None:
    """Add demo to `subparsers`."""
    p = subparsers.add_parser("demo", help="train a tokenizer and a small model on the stdlib, then sample")
    cli.add_examples(p, "demo", "demo --quick                 # about 30 s", "demo --out runs/demo2 --seed 1")
    p.add_argument("--out", default="runs/demo", help="run directory (default runs/demo; replaced if a demo)")
    p.add_argument("--quick", action="store_true", help="a ~30 s version")
    p.add_argument("--train-seconds", type=float, default=None,
                   help="about how long training may take (default 240; sets the step count)")
    p.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead of fitting a "
                   f"time budget: {REFERENCE['steps']} is the reference run's work (docs/training.md)")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="text the trained model continues at the end "
                   "(default: a Python function header)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the model, data order and sampling (default 1337)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: min(4, CPUs))")
    cli.add_progress_flag(p)
    p.set_defaults(func=cmd_demo)
