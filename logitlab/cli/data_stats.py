"""Subcommand `data stats`: what a token directory holds, as tables and a plot.

Registered by cli/data.py; the numbers come from logitlab.data.stats.
"""

from __future__ import annotations

import io
from pathlib import Path

from logitlab.cli import common as cli
from logitlab.io.files import atomic_write_bytes


def cmd_data_stats(args) -> int:
    from logitlab.data.stats import data_stats

    con = cli.console()
    report = data_stats(args.dir, top=args.top, max_tokens=args.max_tokens)
    decode = _token_decoder(Path(args.dir) / (report["tokenizer_file"] or ""))
    rows = [[name, f"{v.get('documents', 0):,}", f"{v.get('tokens', 0):,}", f"{v.get('train_tokens', 0):,}",
             f"{v.get('duplicates', 0):,}"] for name, v in report["per_source"].items()]
    cli.print_table(con, f"{args.dir}: {report['layout']}", ["source", "documents", "tokens read", "train tokens",
                    "duplicates"], rows, right=(1, 2, 3, 4))
    rows = [[s, f"{v['documents']:,}", f"{v['tokens']:,}", str(v["files"])] for s, v in report["splits"].items()]
    cli.print_table(con, "splits", ["split", "documents", "tokens", "files"], rows, right=(1, 2, 3))
    for name, st in (report["filters"] or {}).items():
        rows = [[r, f"{n:,}"] for r, n in st["removed"].items()]
        rows.append(["boilerplate lines", f"{st['boilerplate_lines']:,}"])
        cli.print_table(con, f"filters [{name}]: kept {st['documents_kept']:,} of {st['documents_in']:,}",
                        ["removed by", "count"], rows, right=(1,))
    for key, label, fmt in (("duplicate_rate", "duplicate rate", ".2%"), ("bytes_per_token", "bytes per token", ".3f")):
        if report[key] is not None:
            con.print(f"{label}: {report[key]:{fmt}}")
    rows = [[str(i), decode([i]), f"{n:,}", f"{share:.2%}"] for i, n, share in report["top_tokens"]]
    cli.print_table(con, f"most frequent tokens (of {report['tokens_counted']:,} train tokens)",
                    ["id", "text", "count", "share"], rows, right=(0, 2, 3))
    for key, title in (("top_bigrams", "token pairs"), ("top_trigrams", "token triples")):
        rows = [[" ".join(map(str, g)), decode(list(g)), f"{n:,}"] for g, n in report[key]]
        cli.print_table(con, f"most frequent {title}", ["ids", "text", "count"], rows, right=(2,))
    if args.plot != "none":
        out = plot_stats(report, Path(args.plot) if args.plot else Path(args.dir) / "stats.png")
        con.print(f"wrote {out}")
    return 0


def _token_decoder(path: Path):
    """ids -> a printable string (repr, no quotes) through the directory's tokenizer, if readable."""
    try:
        from logitlab.tokenizer.core import Tokenizer

        tok = Tokenizer.load(path)
    except (OSError, ValueError):
        return lambda ids: "?"
    return lambda ids: repr(tok.decode(ids))[1:-1]


def plot_stats(report: dict, out: Path) -> Path:
    """PNG: tokens per source and the document-length histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(report["per_source"])
    axes[0].barh(names, [report["per_source"][n].get("train_tokens", report["per_source"][n].get("tokens", 0))
                         for n in names])
    axes[0].set_xlabel("training tokens")
    hist = report["doc_length_histogram"] or {"edges": [], "counts": []}
    if hist["edges"]:
        axes[1].bar(range(len(hist["counts"])), hist["counts"])
        axes[1].set_xticks(range(len(hist["edges"])), [f"{e:,}" for e in hist["edges"]], rotation=60)
    axes[1].set_xlabel("document length (tokens, bins [2^k, 2^(k+1)))")
    axes[1].set_ylabel("documents")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out
