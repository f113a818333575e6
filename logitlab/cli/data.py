"""Subcommands `prepare` (and `prepare merge`), `data stats` and `plot`: corpus and tokenizer
preparation with their progress displays, the data report, and the loss plot of a run.

`_add_data_flags` holds the flags `prepare` shares with `train` (readers, filters, dedup,
mixture, shards); `register` adds `prepare` with its scale-out flags and `prepare merge`, and
`data stats` (whose tables and plot are cli/data_stats.py's). `logitlab train` and `logitlab
demo` reuse `_train_tokenizer`, `_prepare` and `plot_run`; the work itself lives in
logitlab.data and logitlab.tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from pathlib import Path

from logitlab.cli import common as cli
from logitlab.cli.data_stats import cmd_data_stats

EOT = "<|endoftext|>"


# --------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------

def _add_data_flags(p: argparse.ArgumentParser) -> None:
    from logitlab.data.filters import FilterConfig

    p.add_argument("--data", nargs="+", action="extend", metavar="[NAME=]PATH",
                   help="text files, directories, globs, .jsonl(.gz/.zst) or .parquet, each optionally named "
                   "NAME=PATH (a source's name, for --mix and the report; default: the path itself; default "
                   "data: the Python stdlib source, named stdlib); repeatable")
    p.add_argument("--text-field", default="text", help=".jsonl field holding the text (default: text)")
    p.add_argument("--column", default="text", help=".parquet column holding the text (default: text)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents held out for validation; when that holds out no document (one "
                   "file), the tail of the token stream instead; 0: no validation set (default: 0.01)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: min(4, CPUs))")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="stop after about this many characters of text (default: all of it)")
    g = p.add_argument_group("sharded pipeline", "Any of these flags writes the sharded layout (train-NNNNN.bin, "
                             "val-NNNNN.bin and an index in manifest.json) through the clean/dedup/mix pipeline; "
                             "without them the single train.bin / val.bin layout is written.")
    g.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default: 134217728)")
    g.add_argument("--filter", action="store_true", help="apply the cleaning filters (default: off)")
    g.add_argument("--dedup", nargs="+", action="extend", choices=["exact", "near"], default=None,
                   help="remove exact duplicates (hash of the normalised text) and/or near duplicates (MinHash "
                   "LSH); the first occurrence in input order is kept (default: none)")
    g.add_argument("--dedup-bands", type=int, default=16, help="LSH bands (default: 16)")
    g.add_argument("--dedup-rows", type=int, default=8, help="MinHash rows per band (default: 8; 16 x 8 bands "
                   "imply a Jaccard threshold of about 0.71)")
    g.add_argument("--dedup-ngram", type=int, default=5, help="words per shingle (default: 5)")
    g.add_argument("--mix", metavar="NAME=W,...|FILE.toml", default=None,
                   help="weights per source by tokens, e.g. web=0.7,code=0.3, or a TOML file with a [mix] table "
                   "(default: the sources as read)")
    g.add_argument("--mix-seed", type=int, default=0, help="seed of the mixture's sampling (default: 0)")
    cli.add_config_flags(p, FilterConfig, prefix="filter_", skip=("enabled", "code_sources"),
                         description="Thresholds of --filter's rules (none: switch a rule off).")
    g.add_argument("--filter-code-sources", nargs="+", action="extend", default=argparse.SUPPRESS, metavar="NAME",
                   help="sources the code rules apply to (the prose rules to the others); repeatable")


def _sharded(args) -> bool:
    """Whether the flags ask for the sharded pipeline."""
    named = any("=" in str(s) and not Path(str(s)).exists() for s in (args.data or ()))
    return bool(getattr(args, "shard_tokens", None) or getattr(args, "filter", False) or getattr(args, "dedup", None)
                or getattr(args, "mix", None) or named or getattr(args, "num_shards", None))


def _configs(args):
    """PrepareConfig and MergeConfig from the flags."""
    import dataclasses

    from logitlab.data.dedup import DedupConfig
    from logitlab.data.filters import FilterConfig
    from logitlab.data.merge import DEFAULT_SHARD_TOKENS, MergeConfig
    from logitlab.data.mixture import parse_mix
    from logitlab.data.parts import PrepareConfig

    chosen = {f.name: getattr(args, "filter_" + f.name) for f in dataclasses.fields(FilterConfig)
              if hasattr(args, "filter_" + f.name)}
    # the default corpus (the stdlib's source, named stdlib) is code
    chosen["code_sources"] = tuple(chosen.get("code_sources", ())) + (() if args.data else ("stdlib",))
    filters = FilterConfig(enabled=bool(getattr(args, "filter", False)), **chosen)
    kinds = set(getattr(args, "dedup", None) or ())
    dedup = DedupConfig(exact="exact" in kinds, near="near" in kinds, bands=args.dedup_bands, rows=args.dedup_rows,
                        ngram=args.dedup_ngram)
    prep = PrepareConfig(args.text_field, args.column, filters, dedup, args.max_bytes)
    merge = MergeConfig(args.val_fraction, args.shard_tokens or DEFAULT_SHARD_TOKENS, parse_mix(args.mix),
                        args.mix_seed, _window_tokens(args))
    return prep, merge


@contextlib.contextmanager
def _progress_bar(con, label: str):
    """A transient bar of documents and tokens; yields the progress(documents, tokens) callback."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(label), BarColumn(bar_width=None), TextColumn("{task.fields[docs]}"),
                  TextColumn("{task.fields[tokens]}"), TimeElapsedColumn(), console=con,
                  transient=True) as bar:
        task = bar.add_task(label, total=None, docs=cli.plural(0, "doc"), tokens=cli.plural(0, "token"))
        yield lambda d, t: bar.update(task, docs=cli.plural(d, "doc"), tokens=cli.plural(t, "token"))


def _prepare(args, tokenizer, out_dir: Path, con) -> dict:
    from logitlab.data import tokens as data

    if _sharded(args):
        return _prepare_sharded(args, tokenizer, out_dir, con)
    with _progress_bar(con, "tokenizing") as progress:
        manifest = data.prepare_corpus(args.data, tokenizer, out_dir, val_fraction=args.val_fraction,
                                       workers=args.workers, text_field=args.text_field, column=args.column,
                                       max_bytes=args.max_bytes, min_val_tokens=_window_tokens(args), progress=progress)
    return _print_prepared(con, out_dir, manifest)


def _print_prepared(con, out_dir: Path, manifest: dict) -> dict:
    s = manifest["splits"]
    shards = f", {len(s['train']['shards'])} train shard(s)" if "shards" in s["train"] else ""
    train, val = s["train"], s["val"]
    con.print(f"prepared {out_dir}: train {cli.plural(train['tokens'], 'token')} / "
              f"{cli.plural(train['documents'], 'doc')}, val {cli.plural(val['tokens'], 'token')} / "
              f"{cli.plural(val['documents'], 'doc')} ({manifest['dtype']}{shards})")
    if (dedup := manifest.get("dedup")) and (dedup["exact"] or dedup["near"]):
        near = (f"; near: {dedup['bands']} bands x {dedup['rows']} rows over {dedup['ngram']}-grams imply a "
                f"Jaccard threshold of about {dedup['threshold']:.2f}") if dedup["near"] else ""
        con.print(f"dedup: removed {dedup['removed']['exact']} exact and {dedup['removed']['near']} near duplicates "
                  f"of {dedup['documents']} documents ({dedup['duplicate_rate']:.1%}){near}", soft_wrap=True)
    for name, st in (manifest.get("filters") or {}).items():
        if st["removed"] or st["boilerplate_lines"]:
            why = ", ".join(f"{r} {n}" for r, n in st["removed"].items())
            con.print(f"filters [{name}]: kept {st['documents_kept']} of {st['documents_in']} documents "
                      f"(removed: {why or 'none'}; {st['boilerplate_lines']} boilerplate lines)", markup=False)
    if mix := manifest.get("mixture"):
        shares = ", ".join(f"{n} {v['share']:.3f} (asked {v['weight']:.3f})" for n, v in mix["realised"].items())
        con.print(f"mixture, realised shares of training tokens: {shares}", markup=False)
    con.print(manifest["val_note"], markup=False, highlight=False, soft_wrap=True)
    return manifest


def _prepare_sharded(args, tokenizer, out_dir: Path, con) -> dict:
    from logitlab.data import merge, parts

    prep, merge_cfg = _configs(args)
    notice = functools.partial(con.print, markup=False, highlight=False, soft_wrap=True)  # "resuming ..."
    if getattr(args, "num_shards", None):  # one worker of N: its part only; `prepare merge` joins them
        with _progress_bar(con, f"part {args.shard_index} of {args.num_shards}") as progress:
            info = parts.prepare_part(args.data, tokenizer, out_dir, prep, shard_index=args.shard_index,
                                      num_shards=args.num_shards, workers=args.workers, progress=progress,
                                      notice=notice)
        con.print(f"part {info['shard_index']} of {info['num_shards']} in {out_dir}: {info['files']} files, "
                  f"{cli.plural(info['documents'], 'doc')}, {cli.plural(info['tokens'], 'token')}; when every part "
                  f"is done: "
                  f"logitlab prepare merge PART_DIRS... --out DIR", markup=False, soft_wrap=True)
        return info
    with _progress_bar(con, "cleaning, hashing, tokenizing") as progress:
        manifest = merge.prepare_sharded(args.data, tokenizer, out_dir, prep, merge_cfg, workers=args.workers,
                                         progress=progress, notice=notice)
    return _print_prepared(con, out_dir, manifest)


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
    JSON-lines / parquet documents are extracted to a temporary text file first."""
    import tempfile

    from logitlab.data import corpus as data
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
        if any(data.file_kind(p) != "text" for p in picked):  # JSON lines (maybe compressed) or parquet
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

    if (getattr(args, "num_shards", None) is None) != (getattr(args, "shard_index", None) is None):
        raise ValueError("--num-shards needs --shard-index (this worker's number, 0 .. N-1) and vice versa")
    if not args.tokenizer or not args.out:
        raise ValueError("prepare needs --tokenizer FILE and --out DIR")
    _prepare(args, Tokenizer.load(args.tokenizer), Path(args.out), cli.console())
    return 0


def cmd_prepare_merge(args) -> int:
    from logitlab.data.merge import DEFAULT_SHARD_TOKENS, MergeConfig, merge_parts
    from logitlab.data.mixture import parse_mix

    con = cli.console()
    cfg = MergeConfig(args.val_fraction, args.shard_tokens or DEFAULT_SHARD_TOKENS, parse_mix(args.mix),
                      args.mix_seed, _window_tokens(args))
    with _progress_bar(con, "merging") as progress:
        _print_prepared(con, Path(args.merge_out), merge_parts(args.parts, Path(args.merge_out), cfg, progress))
    return 0


# --------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------

def register(subparsers) -> None:
    """Add `prepare` (with `prepare merge`) and `data` (with `data stats`) to `subparsers`."""
    p = subparsers.add_parser(
        "prepare", help="tokenize a corpus into token files + manifest.json",
        description="Tokenize text files, directories, globs, .jsonl(.gz/.zst) or .parquet into train/val token "
        "files and manifest.json (the input of `logitlab train --data-dir`). Cleaning, dedup, mixture or shard "
        "flags write the sharded layout; --shard-index/--num-shards prepare one worker's part, and `prepare "
        "merge` joins the parts.", formatter_class=cli.ExamplesFormatter,
        epilog="examples:\n  logitlab prepare --data corpus/ notes.jsonl --tokenizer tok.json --out data/\n"
        "  logitlab prepare --data web=crawl/ code=src/ --filter --filter-code-sources code --dedup exact near "
        "--mix web=0.7,code=0.3 --tokenizer tok.json --out data/\n"
        "  logitlab prepare --data web=crawl/ --dedup near --shard-index 3 --num-shards 8 --tokenizer tok.json "
        "--out parts/3\n  logitlab prepare merge parts/* --out data/")
    _add_data_flags(p)
    p.add_argument("--tokenizer", help="tokenizer file (logitlab JSON; required)")
    p.add_argument("--out", help="output directory (required; with --num-shards: this worker's part directory)")
    p.add_argument("--shard-index", type=int, default=None, help="this worker's number i in 0..N-1 (default: "
                   "one process does it all)")
    p.add_argument("--num-shards", type=int, default=None, help="number N of workers the inputs are sliced "
                   "among (contiguous runs of files, balanced by bytes)")
    p.set_defaults(func=cmd_prepare)
    sub = p.add_subparsers(dest="prepare_command", metavar="merge")
    m = sub.add_parser("merge", help="join the parts of N workers into one sharded token directory",
                       description="Deduplicate across all parts (first occurrence in input order kept), split "
                       "validation by the document rule, apply the mixture and write train-/val-NNNNN.bin and the "
                       "global manifest.json. The result does not depend on how many workers made the parts.")
    cli.add_examples(m, "prepare merge parts/0 parts/1 parts/2 --out data/", "prepare merge parts/* --out data/ "
                     "--mix web=0.7,code=0.3")
    m.add_argument("parts", nargs="+", metavar="PART_DIR", help="the part directories (any order)")
    m.add_argument("--out", dest="merge_out", metavar="DIR", required=True, help="output token directory (required)")
    m.add_argument("--val-fraction", type=float, default=0.01, help="as for prepare (default: 0.01)")
    m.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default: 134217728)")
    m.add_argument("--mix", default=None, help="as for prepare (default: the sources as read)")
    m.add_argument("--mix-seed", type=int, default=0, help="seed of the mixture's sampling (default: 0)")
    m.set_defaults(func=cmd_prepare_merge)

    p = subparsers.add_parser("data", help="reports on token directories", description="Reports on token directories.")
    cli.add_examples(p, "data stats data/", "data stats data/ --top 40 --plot none")
    sub = p.add_subparsers(dest="data_command", metavar="stats", required=True)
    s = sub.add_parser("stats", help="documents and tokens per source, lengths, filters, duplicates, top tokens",
                       description="Print (and plot) what a token directory holds: documents and tokens per "
                       "source, the document-length histogram, removed-by-filter counts, the duplicate rate, "
                       "bytes per token and the most frequent tokens and token n-grams.")
    cli.add_examples(s, "data stats data/", "data stats runs/demo/data --top 40 --plot stats.png")
    s.add_argument("dir", help="token directory (holds manifest.json)")
    s.add_argument("--top", type=int, default=20, help="how many frequent tokens and n-grams (default: 20)")
    s.add_argument("--max-tokens", type=int, default=2_000_000, help="training tokens counted (default: 2000000)")
    s.add_argument("--plot", default=None, help="PNG path, or none (default: DIR/stats.png)")
    s.set_defaults(func=cmd_data_stats)


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
