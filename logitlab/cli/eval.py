"""Subcommand `eval` (registered by main.py): `eval bpb` (bits per byte on text files), `eval mc`
(the multiple-choice tasks built from the standard library, centred accuracy), `eval long`
(perplexity against evaluation length under each RoPE scaling, eval.long) and `eval harness`
(lm-evaluation-harness's own command line, with the `logitlab` model type registered).

MODEL is any model a command can name (cli/models.py: a run, checkpoint, logitlab or Hugging Face
directory, or a hub id); `load_path` loads it (serve.py loads the same way)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    """Add `eval` with its sub-subcommands to `subparsers`."""
    from logitlab.cli.common import add_dtype_flag, add_examples

    parser = subparsers.add_parser("eval", help="bits per byte, multiple choice, length, lm-evaluation-harness",
                                   description="Evaluate a model: `eval bpb` on any text, `eval mc` on tasks "
                                   "made from the Python standard library, `eval long` perplexity against "
                                   "length, `eval harness` through lm-evaluation-harness.")
    add_examples(parser, "eval bpb runs/a --data notes.txt", "eval mc runs/a", "eval long runs/a --plot long.png",
                 "eval harness run --model logitlab --model_args path=runs/a --tasks hellaswag")
    sub = parser.add_subparsers(dest="eval_command", metavar="EVAL")
    sub.required = True

    b = sub.add_parser("bpb", help="bits per byte of a model on text files (tokenizer-independent loss)",
                       description="Score every file as one document (from <|endoftext|>, in rolling windows of "
                       "the model's context, special tokens masked) and report the summed nats over the "
                       "summed UTF-8 bytes in bits, so models with different tokenizers compare fairly.")
    _model_arg(b)
    add_examples(b, "eval bpb runs/a --data notes.txt docs/", "eval bpb gpt2 --data essay.txt --json")
    b.add_argument("--data", nargs="+", action="extend", required=True, metavar="FILE", help="text files (UTF-8), or "
                   "directories: every *.txt, *.md and *.py file under them")
    b.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    add_dtype_flag(b)
    b.set_defaults(func=_bpb)

    m = sub.add_parser("mc", help="multiple choice from the Python standard library (centred accuracy)",
                       description="Pick the real next line of a function among four, over tasks generated from "
                       "the standard library's source with a fixed seed; accuracy is centred so chance is 0 "
                       "and perfect is 1 (as in the CORE metric).")
    _model_arg(m)
    add_examples(m, "eval mc runs/a", "eval mc runs/a --examples 500 --seed 1 --json")
    m.add_argument("--examples", type=int, default=200, help="questions (default 200)")
    m.add_argument("--seed", type=int, default=0, help="which questions (default 0)")
    m.add_argument("--batch-size", type=int, default=16, help="pairs per forward pass (default 16)")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    add_dtype_flag(m)
    m.set_defaults(func=_mc)

    _register_long(sub)

    h = sub.add_parser("harness", help="run lm-evaluation-harness with the `logitlab` model type",
                       description="lm-evaluation-harness's own command line (every argument after `harness` "
                       "is its), with `--model logitlab --model_args path=RUN_OR_MODEL_DIR` available, e.g. "
                       "`logitlab eval harness run --model logitlab --model_args path=runs/demo --tasks "
                       "hellaswag`. Extra model_args: dtype, batch_size, max_length, max_gen_toks, seed.",
                       add_help=False, prefix_chars="\0")  # every argument, --options too, is lm_eval's
    add_examples(h, "eval harness run --model logitlab --model_args path=runs/a --tasks hellaswag --limit 50")
    h.add_argument("harness_args", nargs=argparse.REMAINDER, help="lm_eval's arguments")
    h.set_defaults(func=_harness)


def _model_arg(p) -> None:
    from logitlab.cli.models import add_model_argument

    add_model_argument(p, dtype=False)      # each subcommand adds --dtype where its flags read best
    p.add_argument("--debug", action="store_true", help="show tracebacks")


# -------------------- Loading

def load_path(path: str | Path, dtype: str | None = None, revision: str | None = None):
    """models.Loaded (model in eval mode, tokenizer, end ids) from any MODEL (cli/models.py)."""
    from logitlab.cli.models import load_model

    return load_model(str(path), revision, dtype)


def _harness_loader(path: str, dtype: str | None):
    loaded = load_path(path, dtype)
    return loaded.model, loaded.tokenizer


def register_harness_model() -> type:
    """Register `logitlab` (model_args path=...) in lm-evaluation-harness's model registry."""
    from logitlab.eval.harness import register as register_type

    return register_type(_harness_loader)


# -------------------- bpb

TEXT_SUFFIXES = (".txt", ".md", ".py")


def data_files(paths: list[str]) -> list[Path]:
    """The files named, with directories expanded to their TEXT_SUFFIXES files (sorted)."""
    out: list[Path] = []
    for name in paths:
        p = Path(name)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{p}: no {', '.join(TEXT_SUFFIXES)} files under this directory")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"--data: no such file or directory: {p}")
    return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _bpb(args) -> int:
    from logitlab.cli.common import console, print_table
    from logitlab.eval.bpb import evaluate_bpb

    m = load_path(args.model, args.dtype, args.revision)
    files = data_files(args.data)
    result = evaluate_bpb(m.model, m.tokenizer, (_read_text(f) for f in files), batch_size=args.batch_size)
    report = dict(model=str(args.model), files=len(files), documents=result.documents, tokens=result.tokens,
                  bytes=result.bytes, nats=result.nats, bits_per_byte=result.bits_per_byte,
                  nats_per_token=result.nats_per_token, bytes_per_token=result.bytes_per_token)
    if args.json:
        print(json.dumps(report))
        return 0
    rows = [[k.replace("_", " "), f"{v:.4f}" if isinstance(v, float) else str(v)] for k, v in report.items()]
    print_table(console(), "bits per byte", ["", "value"], rows, right=(1,))
    return 0


# -------------------- mc

def _mc(args) -> int:
    from logitlab.cli.common import console
    from logitlab.eval.stdlib_mc import evaluate_mc, stdlib_next_line_tasks

    m = load_path(args.model, args.dtype, args.revision)
    tasks = stdlib_next_line_tasks(args.examples, seed=args.seed)
    r = evaluate_mc(m.model, m.tokenizer, tasks, batch_size=args.batch_size)
    report = dict(model=str(args.model), examples=r.examples, choices=r.choices, accuracy=r.accuracy,
                  centred_accuracy=r.centred_accuracy, accuracy_norm=r.accuracy_norm)
    if args.json:
        print(json.dumps(report))
    else:
        console().print(f"{r.examples} questions, {r.choices} choices each: accuracy {r.accuracy:.3f} (chance "
                        f"{1 / r.choices:.3f}), centred {r.centred_accuracy:+.3f}, length-normalised accuracy "
                        f"{r.accuracy_norm:.3f}", markup=False)
    return 0


# -------------------- long

# eval.long.DEFAULT_SCALINGS and model.positions.EXTENSIONS, written here so that building the parser
# imports no torch (tests/test_cli_doctor.py checks they agree)
DEFAULT_SCALINGS = ("none", "linear", "ntk", "yarn")
EXTENSIONS = ("none", "linear", "ntk", "dynamic", "yarn")


def _register_long(sub) -> None:
    from logitlab.cli.common import add_dtype_flag, add_examples

    e = sub.add_parser("long", help="perplexity against evaluation length, with each RoPE scaling",
                       description="Score the same held-out tokens in consecutive windows of each length and "
                       "report perplexity, past the training length with every inference-time RoPE scaling "
                       "(none, linear, ntk, dynamic, yarn; factor L / T, no retraining). Held-out text: --data "
                       "when given, else the run's validation split. Learned positions past their table are "
                       "reported as not evaluable; schemes without RoPE are measured with 'none' only.")
    _model_arg(e)
    add_examples(e, "eval long runs/a --plot long.png", "eval long runs/a --lengths 128,256,512 --scaling none,yarn")
    e.add_argument("--lengths", default=None, help="comma-separated window lengths (default: 1, 2, 4 and 8 "
                   "times the training length)")
    e.add_argument("--scaling", default=",".join(DEFAULT_SCALINGS), help="comma-separated scalings: "
                   f"{', '.join(EXTENSIONS)} (default {','.join(DEFAULT_SCALINGS)})")
    e.add_argument("--data", nargs="+", action="extend", metavar="FILE", help="held-out text files or directories "
                   "(repeatable; default: "
                   "the run's validation data)")
    e.add_argument("--tokens", type=int, default=32768, help="held-out targets scored at every length "
                   "(default 32768, rounded down to a multiple of the longest length)")
    e.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward pass (default 16384)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--plot", metavar="PNG", help="also draw perplexity against length, one line per scaling")
    add_dtype_flag(e)
    e.set_defaults(func=_long)


def _parse_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise ValueError(f"--lengths: {part.strip()!r} is not an integer (expected e.g. 128,256,512)") from None
        if value <= 0:
            raise ValueError(f"--lengths: {value} is not a positive length")
        out.append(value)
    return out


def _parse_scalings(text: str) -> list[str]:
    from logitlab.model.positions import EXTENSIONS

    names = [part.strip() for part in text.split(",")]
    unknown = [n for n in names if n not in EXTENSIONS]
    if unknown:
        raise ValueError(f"--scaling: unknown {', '.join(map(repr, unknown))}; known: {', '.join(EXTENSIONS)}")
    return names


def _run_file(model_path: Path) -> tuple[Path, dict] | None:
    """(run directory, its run.json) when MODEL is a run directory or a checkpoint inside one."""
    from logitlab.io.files import read_json

    for d in (model_path, model_path.parent):
        if (d / "run.json").is_file():
            run = read_json(d / "run.json", "run file")
            if isinstance(run, dict) and isinstance(run.get("train"), dict):
                return d, run
    return None


def _run_val_tokens(model_path: Path):
    """(validation token ids of the run, a description) or None when MODEL has no run with them."""
    from logitlab.data.tokens import load_tokens

    found = _run_file(model_path)
    if found is None or not found[1]["train"].get("data_dir"):
        return None
    run_dir, data_dir = found[0], Path(found[1]["train"]["data_dir"])
    for d in (data_dir, run_dir / data_dir, run_dir / "data"):
        if (d / "manifest.json").is_file():
            tokens = load_tokens(d, "val")
            return (tokens, f"{d} (validation split)") if len(tokens) > 1 else None
    return None


def _held_out_tokens(args, loaded, limit: int):
    """The held-out ids: --data's files (each document from <|endoftext|>), else the run's
    validation split; neither is a ValueError saying what to give."""
    import numpy as np

    if args.data:
        files = data_files(args.data)
        eot = loaded.tokenizer.eot_id
        ids: list[int] = []
        for f in files:
            first = [] if eot is None or loaded.tokenizer.bos_id is not None else [eot]  # <s> by add_bos
            ids += first + loaded.tokenizer.encode(_read_text(f), add_bos=True)
            if len(ids) > limit:
                break
        return np.asarray(ids[:limit + 1], dtype=np.int64), f"{len(files)} file(s) from --data"
    found = _run_val_tokens(Path(args.model))
    if found is None:
        raise ValueError(f"{args.model}: no validation data to evaluate on (not a run directory with a "
                         "validation split); give held-out text with --data FILE ...")
    tokens, source = found
    return np.asarray(tokens[:limit + 1], dtype=np.int64), source


def _trained_length(model_path: Path, config) -> int:
    found = _run_file(model_path)
    seq_len = found[1]["train"].get("seq_len") if found is not None else None
    return int(seq_len) if seq_len else config.context_length


def _long(args) -> int:
    from logitlab.cli.common import console
    from logitlab.eval.long import check_lengths, sweep_lengths

    scalings = _parse_scalings(args.scaling)
    lengths = _parse_lengths(args.lengths) if args.lengths else None
    if args.tokens <= 0 or args.batch_tokens <= 0:
        raise ValueError(f"--tokens ({args.tokens}) and --batch-tokens ({args.batch_tokens}) must be positive")
    if args.plot:
        _check_plotting()
    m = load_path(args.model, args.dtype, args.revision)
    trained = _trained_length(Path(args.model), m.model.config)
    lengths = check_lengths(lengths or [trained * k for k in (1, 2, 4, 8)])
    tokens, source = _held_out_tokens(args, m, args.tokens)
    result = sweep_lengths(m.model, tokens, lengths, scalings, trained_length=trained, max_tokens=args.tokens,
                           batch_tokens=args.batch_tokens)
    if args.plot:
        plot_long({str(args.model): result}, args.plot)
    if args.json:
        print(json.dumps({"model": str(args.model), "data": source, **result.to_dict(),
                          **({"plot": str(args.plot)} if args.plot else {})}))
        return 0
    con = console()
    _print_long(con, result, f"perplexity against evaluation length: {args.model} ({result.positions} positions, "
                f"trained at {trained}); held-out: {source}")
    if args.plot:
        con.print(f"wrote {args.plot}", markup=False)
    return 0


def _print_long(con, result, title: str) -> None:
    """The sweep as a table: a row per scaling, a column per length (the training length marked)."""
    from logitlab.cli.common import print_table

    heads = ["scaling"] + [f"{L} (train)" if L == result.trained_length else str(L) for L in result.lengths]
    rows, notes = [], {}
    for scaling in result.scalings:
        row = [scaling]
        for L in result.lengths:
            s = result.score(L, scaling)
            row.append(f"{s.perplexity:.3f}" if s.evaluable else "-")
            if not s.evaluable:
                notes.setdefault(s.note, []).append(f"{scaling}@{L}")
        rows.append(row)
    print_table(con, title, heads, rows, right=tuple(range(1, len(heads))))
    tokens = max((s.tokens for s in result.scores), default=0)
    con.print(f"{tokens} targets scored at every length", markup=False)
    for note, cells in notes.items():
        con.print(f"- not evaluable ({', '.join(cells)}): {note}", markup=False)


def _check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib); drop --plot for the table") from None


def plot_long(results: dict, path: str | Path, title: str | None = None) -> Path:
    """PNG of perplexity against evaluation length (log2 axis): one line per (model, scaling) of
    `results` ({label: LongEvalResult}), the training length a dotted line; written atomically."""
    import io

    _check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from logitlab.io.files import atomic_write_bytes

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, result in results.items():
        for scaling in result.scalings:
            points = [(s.length, s.perplexity) for s in result.scores if s.scaling == scaling and s.evaluable]
            if points:
                name = scaling if len(results) == 1 else label if len(result.scalings) == 1 else f"{label}: {scaling}"
                ax.plot(*zip(*points), "o-", label=name, lw=1.5, ms=4)
        ax.axvline(result.trained_length, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens; dotted: training length)")
    ax.set_ylabel("perplexity")
    ax.set_title(title or "perplexity against evaluation length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())


# -------------------- harness

def _harness(args) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        raise RuntimeError(f"`eval harness` needs lm-evaluation-harness (pip install lm-eval): {exc}") from None
    register_harness_model()
    argv = sys.argv
    sys.argv = ["lm_eval"] + list(args.harness_args)
    try:
        cli_evaluate()
    except SystemExit as exc:  # the harness's parser and command exit with a code
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        sys.argv = argv
    return 0
