"""Subcommands `prepare` and `plot` (their flags are registered with `train`'s, in train.py): corpus
and tokenizer preparation with their progress displays, and the loss plot of a run.

`logitlab train` and `logitlab demo` reuse `_train_tokenizer`, `_prepare` and `plot_run`; the
work itself lives in logitlab.data and logitlab.tokenizer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from logitlab.cli import common as cli

EOT = "<|endoftext|>"


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------

def _add_data_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="text files, directories, globs, .jsonl or .parquet (default: the Python stdlib source)")
    p.add_argument("--text-field", default="text", help=".jsonl field holding the text (default: text)")
    p.add_argument("--column", default="text", help=".parquet column holding the text (default: text)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents held out for validation; when that holds out no document (one "
                   "file), the tail of the token stream instead; 0: no validation set (default: 0.01)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: min(4, CPUs))")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="stop after about this many characters of text (default: all of it)")


def _prepare(args, tokenizer, out_dir: Path, con) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from logitlab.data import tokens as data

    with Progress(TextColumn("tokenizing"), BarColumn(bar_width=None), TextColumn("{task.fields[docs]} docs"),
                  TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn(), console=con,
                  transient=True) as bar:
        task = bar.add_task("tok", total=None, docs=0, tokens=0)
        manifest = data.prepare_corpus(args.data, tokenizer, out_dir, val_fraction=args.val_fraction,
                                       workers=args.workers, text_field=args.text_field, column=args.column,
                                       max_bytes=args.max_bytes, min_val_tokens=_window_tokens(args),
                                       progress=lambda d, t: bar.update(task, docs=d, tokens=t))
    s = manifest["splits"]
    con.print(f"prepared {out_dir}: train {s['train']['tokens']:,} tokens / {s['train']['documents']} docs, "
              f"val {s['val']['tokens']:,} tokens / {s['val']['documents']} docs ({manifest['dtype']})")
    con.print(manifest["val_note"], markup=False, highlight=False, soft_wrap=True)
    return manifest


def _window_tokens(args) -> int:
    """One evaluation window (seq_len + 1 tokens) of the run the data is for: --seq-len, else
    --context-length, else the TOML's [train] seq_len / [model] context_length / preset, else the
    tiny preset's context length. `prepare` alone (no model flags) also uses tiny's."""
    from logitlab.model.families import get_preset

    table = cli.read_toml(args.config) if getattr(args, "config", None) else {}
    seq = (getattr(args, "seq_len", None) or table.get("train", {}).get("seq_len")
           or getattr(args, "context_length", None) or table.get("model", {}).get("context_length"))
    if not seq:
        seq = get_preset(getattr(args, "preset", None) or table.get("preset") or "tiny").context_length
    return int(seq) + 1


def _train_tokenizer(sources, vocab_size: int, max_bytes: int, con, text_field="text", column="text"):
    """A BPE tokenizer trained on about `max_bytes` of `sources` (default: spread over the stdlib);
    .jsonl / .parquet documents are extracted to a temporary text file first."""
    import tempfile

    from logitlab.data import tokens as data
    from logitlab.tokenizer import bpe

    files = data.resolve_sources(sources) if sources else data.default_corpus_files()
    # files spread over the corpus; offset 1 so the default tokenizer sample differs from the
    # files a max_bytes prepare of the same corpus takes
    picked = data.spread_files(files, max_bytes, offset=1)
    total = sum(p.stat().st_size for p in picked)
    t0 = time.perf_counter()
    title = f"training a {vocab_size}-token BPE tokenizer on {total / 1e6:.1f} MB"
    with tempfile.TemporaryDirectory() as tmp, con.status(title) as status:
        inputs = [str(p) for p in picked]
        if any(p.suffix in (".jsonl", ".parquet") for p in picked):
            docs = data.iter_documents(picked, text_field, column, skip_undecodable=True)
            sample = Path(tmp) / "sample.txt"
            sample.write_text("\n".join(data.limit_chars(docs, max_bytes)), encoding="utf-8")
            inputs = [str(sample)]
        tok = bpe.train_tokenizer(inputs, vocab_size, [EOT], progress=lambda phase, done, n: status.update(
            f"{title}: {'pre-tokenizing' if phase == 'pretokenize' else 'merging'} {done:,}/{n:,}"))
    con.print(f"tokenizer: {tok.vocab_size} tokens trained on {len(picked)} files "
              f"({total / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return tok


def cmd_prepare(args) -> int:
    from logitlab.tokenizer.core import Tokenizer

    _prepare(args, Tokenizer.load(args.tokenizer), Path(args.out), cli.console())
    return 0


# --------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------

def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """PNG of train/val loss, learning rate and gradient norm from RUN/metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}, line {n}: not a JSON record ({exc}); the file may be truncated") from None
    if not rows:
        raise ValueError(f"{path} holds no records yet")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    rows = [r for r in rows if "loss" in r]  # the step-0 record holds only the validation loss
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(steps, [r["loss"] for r in rows], label="train", lw=1)
    if val:
        axes[0].plot(*zip(*val), "o-", label="validation")
    axes[0].set_ylabel("loss (nats/token)")
    axes[0].legend()
    axes[1].plot(steps, [r["lr"] for r in rows])
    axes[1].set_ylabel("learning rate")
    axes[2].plot(steps, [r["grad_norm"] for r in rows], lw=1)
    axes[2].set_ylabel("grad norm (pre-clip)")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).resolve().name)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def cmd_plot(args) -> int:
    out = plot_run(args.run_dir, args.out)
    cli.console().print(f"wrote {out}")
    return 0
