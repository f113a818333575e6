"""Subcommand `export` (registered with the training commands by cli/train.py): a run or a
checkpoint -> a Hugging Face directory that AutoModelForCausalLM / AutoTokenizer load.

Flag convention of every command: `--hf DIR` names a Hugging Face directory to read, `--out DIR`
the directory (or file) a command writes. `export --hf DIR`, the old spelling of `--out`, still
works and says so on stderr.
"""

from __future__ import annotations

import argparse

from logitlab.cli import common as cli

EXAMPLE = ("example:\n  logitlab export runs/a --out hf/a\n  logitlab export runs/a --out hf/a-best --which best\n"
           "convention: --hf DIR is always a Hugging Face directory to read, --out DIR what a command writes")
DEPRECATED_HF = "warning: `export --hf DIR` is deprecated (--hf names an input everywhere else); use `--out DIR`"


def cmd_export(args) -> int:
    from logitlab.io.hf import export_hf

    out_dir = _out_dir(args)
    if args.hf_out:
        cli.error_console().print(DEPRECATED_HF, markup=False, highlight=False, soft_wrap=True)
    from pathlib import Path

    from logitlab.parallel.sharded import META_FILE

    if (Path(args.run_dir) / META_FILE).is_file():  # a sharded (DCP) checkpoint of a TP / PP / ZeRO run
        from logitlab.train.parallel_run import export_sharded_to_hf

        out = export_sharded_to_hf(args.run_dir, out_dir, overwrite=args.overwrite)
    else:
        out = export_hf(args.run_dir, out_dir, args.which, overwrite=args.overwrite)
    cli.console().print(f"wrote {out} (AutoModelForCausalLM / AutoTokenizer)")
    return 0


def _out_dir(args) -> str:
    """--out, or its deprecated spelling --hf; exactly one of them."""
    if args.out and args.hf_out:
        raise ValueError("give the output directory once: --out DIR (--hf DIR is its deprecated spelling)")
    if not (args.out or args.hf_out):
        raise ValueError("export needs --out DIR, the Hugging Face directory to write")
    return args.out or args.hf_out


def register(subparsers) -> None:
    """Add export to `subparsers`."""
    p = subparsers.add_parser("export", help="write a Hugging Face directory (model + tokenizer)",
                              description="Write a Hugging Face directory (config.json, model.safetensors, "
                              "tokenizer.json) that AutoModelForCausalLM / AutoTokenizer load.",
                              epilog=EXAMPLE, formatter_class=cli.ExamplesFormatter)
    p.add_argument("run_dir", help="run directory or checkpoint directory")
    p.add_argument("--out", metavar="OUT_DIR", help="the Hugging Face directory to write (required)")
    p.add_argument("--hf", dest="hf_out", metavar="OUT_DIR", help=argparse.SUPPRESS)  # deprecated: --out
    p.add_argument("--which", choices=["latest", "best"], default="latest",
                   help="for a run directory: its latest checkpoint or the best by validation loss "
                   "(default: latest)")
    p.add_argument("--overwrite", action="store_true", help="replace an OUT_DIR that logitlab exported "
                   "before (only its own files; anything else there is kept). Without it OUT_DIR must be "
                   "new or empty; it may lie inside the run directory (default: off)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_export)
