"""Subcommand `eval` (registered by main.py): `eval bpb` (bits per byte on text files), `eval mc`
(the multiple-choice tasks built from the standard library, centred accuracy) and `eval harness`
(lm-evaluation-harness's own command line, with the `logitlab` model type registered).

MODEL is a run directory, a checkpoint directory, a logitlab model directory or a Hugging Face
directory; `load_path` tells them apart (serve.py loads the same way)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    """Add `eval` with its sub-subcommands to `subparsers`."""
    from logitlab.cli.common import add_dtype_flag

    parser = subparsers.add_parser("eval", help="bits per byte, multiple choice, lm-evaluation-harness",
                                   description="Evaluate a model: `eval bpb` on any text, `eval mc` on tasks "
                                   "made from the Python standard library, `eval harness` through "
                                   "lm-evaluation-harness.")
    sub = parser.add_subparsers(dest="eval_command", metavar="EVAL")
    sub.required = True

    b = sub.add_parser("bpb", help="bits per byte of a model on text files (tokenizer-independent loss)",
                       description="Score every file as one document (from <|endoftext|>, in rolling windows of "
                       "the model's context, special tokens masked) and report the summed nats over the "
                       "summed UTF-8 bytes in bits, so models with different tokenizers compare fairly.")
    _model_arg(b)
    b.add_argument("--data", nargs="+", required=True, metavar="FILE", help="text files (UTF-8), or "
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
    m.add_argument("--examples", type=int, default=200, help="questions (default 200)")
    m.add_argument("--seed", type=int, default=0, help="which questions (default 0)")
    m.add_argument("--batch-size", type=int, default=16, help="pairs per forward pass (default 16)")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    add_dtype_flag(m)
    m.set_defaults(func=_mc)

    h = sub.add_parser("harness", help="run lm-evaluation-harness with the `logitlab` model type",
                       description="lm-evaluation-harness's own command line (every argument after `harness` "
                       "is its), with `--model logitlab --model_args path=RUN_OR_MODEL_DIR` available, e.g. "
                       "`logitlab eval harness run --model logitlab --model_args path=runs/demo --tasks "
                       "hellaswag`. Extra model_args: dtype, batch_size, max_length, max_gen_toks, seed.",
                       add_help=False, prefix_chars="\0")  # every argument, --options too, is lm_eval's
    h.add_argument("harness_args", nargs=argparse.REMAINDER, help="lm_eval's arguments")
    h.set_defaults(func=_harness)


def _model_arg(p) -> None:
    p.add_argument("model", metavar="MODEL", help="run directory, checkpoint directory, logitlab model "
                   "directory or Hugging Face directory")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


# -------------------- Loading

def load_path(path: str | Path, dtype: str | None = None):
    """generate.Loaded (model in eval mode, tokenizer, end ids) from any model directory: a Hugging
    Face one (config.json that is not logitlab's) through --hf's loader, else --checkpoint's."""
    from logitlab.cli.generate import load
    from logitlab.io import checkpoint

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such run or model directory: {p}")
    hf = p.is_dir() and (p / "config.json").is_file() and not checkpoint.is_logitlab_dir(p)
    return load(argparse.Namespace(checkpoint=None if hf else str(p), hf=str(p) if hf else None, dtype=dtype))


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

    m = load_path(args.model, args.dtype)
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

    m = load_path(args.model, args.dtype)
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
