"""`logitlab`: the parser of every subcommand and `main()`, which turns a user's error into one
line and exit code 2. Each stage registers its subcommands from its own module, imported here
by name, so the dependency graph is the import list."""

from __future__ import annotations

import argparse

from logitlab.cli import chat, data, demo, doctor, eval, generate, inspect, model, post, serve, tokenizer, train
from logitlab.cli.common import error_console

# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def _error_text(exc: BaseException) -> str:
    """One line for a user: the message, with an OSError's file named ('permission denied: PATH')."""
    from rich.markup import escape

    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.strerror}: {exc.filename}"          # not "[Errno 13] Permission denied: '...'"
    elif isinstance(exc, OSError) and exc.strerror:
        text = str(exc.strerror)
    elif isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    else:
        text = str(exc)
    return escape(text)


class _Parser(argparse.ArgumentParser):
    """argparse without abbreviated flags: `--attention` is not silently `--attention-kernel`, and a
    flag added later never changes what an old command line means. Sub-commands inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from logitlab import __version__

    parser = _Parser(
        prog="logitlab",
        description="Text -> token ids -> logits -> text, every step visible. New here? Start with "
                    "`logitlab demo`: it trains a tokenizer and a small model on the Python standard "
                    "library in a few minutes, then samples from it.",
        epilog="One vocabulary everywhere: a command's first argument MODEL is the model it reads (a run, "
               "checkpoint, logitlab or Hugging Face directory, or a hub id ORG/NAME[@REVISION]); --out is what "
               "it writes; --batch-size and --seq-len are the batch and sequence length; \\n and \\t in "
               "text arguments are a newline and a tab. `logitlab doctor` lists the optional features.")
    parser.add_argument("--version", action="version", version=f"logitlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # --help lists the commands in this order: the path from text to a served model
    for module in (tokenizer, model, data, train, demo, generate, inspect, chat, eval, post, serve, doctor):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import sys

    from logitlab.cli.models import rewrite_legacy

    parser = build_parser()
    try:
        argv, notes = rewrite_legacy(list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        parser.error(str(exc))
    for note in notes:
        error_console().print(note, markup=False, highlight=False, soft_wrap=True)
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        error_console().print("[yellow]interrupted[/yellow]")
        return 130
    except ImportError as exc:
        line = doctor.missing_extra_line(args.command, exc)
        if line is None or getattr(args, "debug", False):
            raise
        error_console().print(f"[bold red]error:[/bold red] {_error_text(line)}", soft_wrap=True)
        return 2
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        if getattr(args, "debug", False):
            raise
        # soft_wrap: one line however long, for a terminal to wrap and for grep to find
        error_console().print(f"[bold red]error:[/bold red] {_error_text(exc)}", soft_wrap=True)
        return 2
    return int(result or 0)
