"""`logitlab demo`, the README's first command: the whole path on the default corpus, no flags.

It trains a tokenizer on part of the Python standard library, tokenizes more of it, trains a small
model for a time budget measured on the machine at hand, writes the run directory with its loss
plot, then samples a continuation of a prompt and shows the top next-token probabilities. The
pieces are the training commands' own (cli_train.py); this module only chooses the sizes and the
recipe: the speedrun recipe (train/recipes.py) by default, because at the demo's budget it ends at a
lower validation loss than the tiny preset's own training (docs/benchmarks.md, "the demo's budget");
`--recipe none` trains the tiny preset with AdamW and the cosine, a model `logitlab export` writes
for Hugging Face's Llama class.
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
# What a full demo's run is compared with at the end, per recipe: the steps it trains in its 240 s on an
# idle 2-core machine and the validation loss they reach. "none": measured so from a fresh clone
# (cli/train_budget.py). "speedrun": the time of those 1,016 steps in the recipe's own steps, which took
# 1.34x the plain ones with two threads on a quiet machine (docs/benchmarks.md, "the demo's budget"), and
# the loss `logitlab demo --steps 758` reached. `demo --steps N` does the reference's work on any machine.
SPEEDRUN_STEP_RATIO = 1.34
REFERENCES = {"none": REFERENCE,
              "speedrun": dict(REFERENCE, steps=round(REFERENCE["steps"] / SPEEDRUN_STEP_RATIO), val_loss=3.35)}
RECIPES = tuple(REFERENCES)
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
    (out / "demo.json").write_text(json.dumps({"quick": args.quick, "recipe": args.recipe, **spec}, indent=2) + "\n")
    t0 = time.perf_counter()
    tok = _train_tokenizer(None, spec["vocab"], spec["tok_bytes"], con)
    ns = argparse.Namespace(data=None, text_field="text", column="text", val_fraction=spec["val"], workers=args.workers,
                            max_bytes=spec["corpus"])
    _prepare(ns, tok, out / "data", con)
    model_kw, train_kw = _with_recipe(spec, args.recipe)
    model_cfg = get_preset("tiny", vocab_size=tok.vocab_size, **model_kw)
    torch.manual_seed(args.seed)
    model = Transformer(model_cfg)
    # The demo trains for a fixed time, so it keeps freed memory even though it does not compile
    # (its eager fp32 steps: 0.81-0.87x the time, peak +5-7%), set before the step is timed so the
    # step count fits the steps as they will run (train applies it again, a no-op).
    train_kw["keep_freed_memory"] = "on"
    if runtime.pick_device("auto").type == "cpu":                 # the device TrainConfig picks
        runtime.keep_freed_memory()
    threads, per_step = budget.time_training_step(model, train_kw["batch_size"], model_cfg.context_length,
                                                  threads=(torch.get_num_threads(), 1), repeats=3)
    if train_kw.get("optimizer") == "muon":       # its Newton-Schulz products, beyond the AdamW share timed above
        per_step += budget.muon_seconds(model, TrainConfig.muon_ns_steps, TrainConfig.muon_ns, repeats=2)
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
              f"T={model_cfg.context_length}); recipe: {_recipe_words(args.recipe)}")
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
    (out / "demo.json").write_text(json.dumps({"quick": args.quick, "recipe": args.recipe, **spec, "result": summary},
                                              indent=2) + "\n")
    val = f"{result.val_loss:.3f}" if result.val_loss is not None else "n/a"
    if start_val is not None:
        val = f"{start_val:.3f} -> {val}"
    con.print(f"\nvalidation loss {val} nats/token (uniform guess: ln V = {ln_v:.3f}); "
              f"total wall time {wall:.0f} s. Run directory: {out} (loss plot {png})", soft_wrap=True)
    if not args.quick:
        con.print(_against_reference(result.step, result.val_loss, args.steps is not None, args.recipe),
                  soft_wrap=True)
    for line in _next_commands(out, args.recipe):
        # soft_wrap: a command meant to be copied is never broken across lines by the console
        con.print(line, soft_wrap=True, markup=False)
    return 0


def _with_recipe(spec: dict, recipe: str) -> tuple[dict, dict]:
    """(ModelConfig fields over the tiny preset, TrainConfig fields) of the demo's sizes under `recipe`:
    "none" keeps the preset and its training (AdamW, the cosine to lr/10); "speedrun" lays the recipe's
    fields over them (its MLP width is its own: d_ff 4·D for ReLU²)."""
    if recipe == "none":
        return dict(spec["model"]), dict(spec["train"])
    from logitlab.train.recipes import get_recipe

    r = get_recipe(recipe)
    return {**spec["model"], **r.model}, {**r.train, **spec["train"]}


def _recipe_words(recipe: str) -> str:
    if recipe == "none":
        return "none (the tiny preset, AdamW, the cosine)"
    return f"{recipe} (Muon, WSD, ReLU², QK-norm, value embeddings, soft-capping)"


def _next_commands(out: Path, recipe: str) -> list[str]:
    """The commands the demo suggests last: generate, and export when the model has a Hugging Face class
    (the speedrun recipe's ReLU², value embeddings and soft-capping have none)."""
    lines = [f"next: logitlab generate {out} 'def '"]
    if recipe == "none":
        return [*lines, f"      logitlab export {out} --out {out}/hf"]
    return [*lines, f"      logitlab inspect {out} 'import os' --position 0 --lens",
            "      (logitlab demo --recipe none trains a model that logitlab export writes for transformers)"]


def _against_reference(steps: int, val_loss: float | None, fixed: bool, recipe: str = "speedrun") -> str:
    """The demo's result beside the reference run's of its recipe, and what to do about a short run."""
    ref = REFERENCES[recipe]
    reached = f" -> {val_loss:.2f}" if val_loss is not None else ""
    line = (f"reference: {ref['steps']:,} steps -> {ref['val_loss']:.2f} on {ref['machine']}; this run "
            f"{'took' if fixed else 'fitted'} {steps:,} steps{reached}")
    if not fixed and steps < FEW_STEPS:
        again = f"logitlab demo --steps {ref['steps']}" + (" --recipe none" if recipe == "none" else "")
        line += (f". Only {steps} steps fitted the time budget (a busy machine?): the loss is far from the "
                 f"reference; `{again}` does the reference's work however long it takes")
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
                   f"time budget: {REFERENCES['speedrun']['steps']} ({REFERENCE['steps']} with --recipe none) is the "
                   "reference run's work (docs/training.md)")
    p.add_argument("--recipe", choices=RECIPES, default="speedrun", help="speedrun (default: Muon, WSD, ReLU², "
                   "QK-norm, value embeddings, soft-capping; docs/training.md) or none (the tiny preset with AdamW "
                   "and the cosine: the Llama layout logitlab export writes for transformers)")
    p.add_argument("--prompt", default=DEMO_PROMPT, help="text the trained model continues at the end "
                   "(default: a Python function header)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the model, data order and sampling (default 1337)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: min(4, CPUs))")
    cli.add_progress_flag(p)
    p.set_defaults(func=cmd_demo)
