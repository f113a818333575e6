"""Long context on the default corpus, with the commands a user would type: docs/long-context.md.

1. `logitlab train` the demo-size model (context 128, d_model 128, 4 layers, 4 heads, 2 KV heads,
   F 384, a 4096-token BPE vocabulary; the demo's shape) on the Python standard library, once per
   position scheme: rope, alibi, learned, none. Same seed, same data, same steps.
2. `logitlab eval long` each run at 1x..8x its training length (128 .. 1024), RoPE under every
   inference-time scaling (none, linear, ntk, dynamic, yarn; factor L / 128, nothing retrained).
3. `logitlab train --resume` copies of the RoPE run at context 1024 with --rope-scaling none,
   linear:8 (position interpolation) and yarn:8 for --finetune more steps at batch 2 (the same
   tokens per step as pretraining), then `eval long` them again.
4. Plots into docs/ (long-context-*.png) and the numbers into bench/results/long_context_demo.json;
   a markdown summary on stdout.

CPU-sized: with OMP_NUM_THREADS=1 and the defaults (--steps 400, --finetune 60) the whole
experiment is about 25 minutes on one core of a shared machine.

    OMP_NUM_THREADS=1 python3 -m bench.long_context_demo [--steps 400] [--finetune 60] [--out runs/long-context]
        [--eval-tokens 16384] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import time
from pathlib import Path

import torch

from bench.common import ROOT, machine_info, markdown_table, write_results
from logitlab import cli
from logitlab.eval.long import LongEvalResult

SCHEMES = ("rope", "alibi", "learned", "none")
SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn")
FINETUNES = (("none", "none"), ("PI", "linear:8"), ("YaRN", "yarn:8"))
MODEL = ["--context-length", "128", "--d-model", "128", "--n-layers", "4", "--n-heads", "4", "--n-kv-heads", "2",
         "--d-ff", "384"]
DOCS = ROOT / "docs"


def _cli(argv: list[str]) -> str:
    """Run one logitlab command in this process; its stdout (an error is an exception)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    if code != 0:
        raise RuntimeError(f"logitlab {' '.join(argv)} exited {code}")
    return out.getvalue()


def train_schemes(out: Path, steps: int, corpus_bytes: int, tokenizer_bytes: int) -> dict:
    """One run per scheme (the first prepares the corpus and the tokenizer the others reuse)."""
    seconds = {}
    data = out / "rope" / "data"
    for scheme in SCHEMES:
        run = out / scheme
        if (run / "run.json").is_file():
            continue
        source = (["--data-dir", str(data)] if data.is_dir() else
                  ["--tokenizer-vocab", "4096", "--tokenizer-bytes", str(tokenizer_bytes), "--max-bytes", str(corpus_bytes),
                   "--val-fraction", "0.05", "--workers", "1"])
        start = time.perf_counter()
        _cli(["train", *source, *MODEL, "--positions", scheme, "--steps", str(steps), "--batch-size", "16",
              "--lr", "3e-3", "--eval-every", str(max(1, steps // 4)), "--eval-tokens", "16384", "--seed", "1337",
              "--device", "cpu", "--progress", "false", "--out", str(run)])
        seconds[scheme] = round(time.perf_counter() - start, 1)
    return seconds


def evaluate(run: Path, scalings, lengths: str, tokens: int) -> dict:
    return json.loads(_cli(["eval", "long", str(run), "--lengths", lengths, "--scaling", ",".join(scalings),
                            "--tokens", str(tokens), "--json"]))


def finetune(out: Path, steps: int, extra: int) -> dict:
    """Copies of the RoPE run resumed at context 1024 under each scaling for `extra` more steps."""
    seconds = {}
    for name, spec in FINETUNES:
        run = out / f"rope-ft-{name.lower()}"
        if not (run / "run.json").is_file() or json.loads((run / "run.json").read_text())["model"][
                "context_length"] != 1024:
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(out / "rope", run, ignore=shutil.ignore_patterns("tensorboard", "data"))
            start = time.perf_counter()
            _cli(["train", "--resume", str(run), "--context-length", "1024", "--rope-scaling", spec,
                  "--steps", str(steps + extra), "--batch-size", "2", "--eval-every", str(max(1, extra // 3)),
                  "--progress", "false"])
            seconds[name] = round(time.perf_counter() - start, 1)
    return seconds


def plots(results: dict, out_dir: Path) -> list[Path]:
    """Three PNGs: RoPE under every scaling; every scheme at its best zero-shot; the fine-tunes."""
    from logitlab.cli.eval import plot_long

    r = {k: LongEvalResult.from_dict(v) for k, v in results.items()}
    paths = [plot_long({"rope": r["rope"]}, out_dir / "long-context-rope.png",
                       "RoPE trained at 128, scaled at inference (no retraining)")]
    schemes = {"rope": r["rope"].only(["none", "yarn"]), **{"NoPE" if s == "none" else s: r[s] for s in SCHEMES[1:]}}
    paths.append(plot_long(schemes, out_dir / "long-context-schemes.png",
                           "every position scheme trained at 128, evaluated to 8x"))
    tuned = {"zero-shot": r["rope"].only(["linear", "yarn"]),
             **{f"fine-tuned {name}": r[f"rope-ft-{name.lower()}"] for name, _ in FINETUNES}}
    paths.append(plot_long(tuned, out_dir / "long-context-finetune.png",
                           "RoPE extended to 1024: zero-shot against a short fine-tune at 1024"))
    return paths


def curves(out: Path, png: Path) -> Path:
    """Validation loss against step for the fine-tuned copies, from the last quarter of pretraining
    (the first point at 1024 is the extension record: the extended model before any step there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, _ in FINETUNES:
        records = [json.loads(x) for x in (out / f"rope-ft-{name.lower()}" / "metrics.jsonl").read_text().splitlines()]
        ext = next(r for r in records if "extended" in r)
        after = [ext] + [r for r in records if "val_loss" in r and r["step"] > ext["step"]]
        ax.plot([r["step"] for r in after], [r["val_loss"] for r in after], "o-", label=f"{name} at 1024", ms=4)
    before = [(r["step"], r["val_loss"]) for r in records
              if "val_loss" in r and 0.7 * ext["step"] <= r["step"] <= ext["step"] and "extended" not in r]
    ax.plot(*zip(*before), "ko-", label="pretraining at 128", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token) at the run's length")
    ax.set_title("fine-tuning at 1024: the step before is the extended model untrained")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def render(result: dict) -> str:
    lengths = result["results"]["rope"]["lengths"]
    heads = ["model", "scaling"] + [f"{L} (train)" if L == 128 else str(L) for L in lengths]
    rows = []
    for key, r in result["results"].items():
        for scaling in r["scalings"]:
            cells = {s["length"]: s["perplexity"] for s in r["scores"] if s["scaling"] == scaling}
            rows.append([key, scaling] + ["-" if cells.get(L) is None else f"{cells[L]:.2f}" for L in lengths])
    return markdown_table(heads, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="pretraining steps at 128 (batch 16)")
    parser.add_argument("--finetune", type=int, default=60, help="extra steps at 1024 (batch 2)")
    parser.add_argument("--eval-tokens", type=int, default=16384, help="held-out targets per length")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "long-context", help="run directories")
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000, help="stdlib text tokenized")
    parser.add_argument("--tokenizer-bytes", type=int, default=3_000_000, help="text the BPE is learned on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 steps, 6 to fine-tune, 4096 tokens")
    parser.add_argument("--docs", action="store_true", help="write the PNGs into docs/ (else into --out)")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNGs from the saved results "
                        "and the run directories under --out")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads((ROOT / "bench" / "results" / "long_context_demo.json").read_text())
        png_dir = DOCS if args.docs else args.out
        print(plots(saved["results"], png_dir), curves(args.out, png_dir / "long-context-curves.png"))
        return
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.finetune, args.eval_tokens, args.corpus_bytes = 20, 6, 4096, 1_000_000
        args.tokenizer_bytes = 300_000
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    train_s = train_schemes(args.out, args.steps, args.corpus_bytes, args.tokenizer_bytes)
    lengths = "128,256,512,1024"
    results = {s: evaluate(args.out / s, SCALINGS, lengths, args.eval_tokens) for s in SCHEMES}
    tune_s = finetune(args.out, args.steps, args.finetune)
    for name, _ in FINETUNES:
        results[f"rope-ft-{name.lower()}"] = evaluate(args.out / f"rope-ft-{name.lower()}", ("none",), lengths,
                                                      args.eval_tokens)
    png_dir = DOCS if args.docs else args.out
    pngs = plots(results, png_dir) + [curves(args.out, png_dir / "long-context-curves.png")]
    result = {"steps": args.steps, "finetune_steps": args.finetune, "eval_tokens": args.eval_tokens,
              "corpus_bytes": args.corpus_bytes, "train_seconds": train_s, "finetune_seconds": tune_s,
              "wall_s": round(time.perf_counter() - started, 1), "results": results,
              "plots": [str(p) for p in pngs], "machine": machine_info()}
    write_results("long_context_demo" + ("-quick" if args.quick else ""), result)
    print(render(result))
    print(f"\nwall {result['wall_s']} s; plots: {', '.join(result['plots'])}")


if __name__ == "__main__":
    main()
