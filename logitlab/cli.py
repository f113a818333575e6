"""The command line: argparse subcommands and the one function that turns config dataclasses into flags.

cli.py owns `main()`, the shared flag machinery and the console. Each concern registers its
subcommands from its own small module (cli_tokenizer.py, cli_model.py, cli_train.py,
cli_demo.py, cli_generate.py), so no single file grows past a few screens. Only the CLI layer reads argv
or formats output for humans; the library modules return data.

Config flags: `add_config_flags(parser, SomeConfig)` adds one `--field-name` flag per dataclass
field (help text from the field's `metadata["help"]`), and `build_config(SomeConfig, args,
toml_table)` builds the frozen config from, in increasing priority: the dataclass defaults, a
TOML table (`--config FILE`), and the flags the user actually typed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

# Subcommand modules, each exposing `register(subparsers)`. A module that fails to import is
# a bug, not an optional feature, so there is no try/except here.
_COMMAND_MODULES = ("cli_tokenizer", "cli_model", "cli_train", "cli_demo", "cli_generate")


# --------------------------------------------------------------------------------------------
# Console
# --------------------------------------------------------------------------------------------

def console():
    """The rich console used by every command (stdout)."""
    from rich.console import Console

    return Console(highlight=False)


def error_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


# --------------------------------------------------------------------------------------------
# Dataclass -> flags
# --------------------------------------------------------------------------------------------

def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """Optional[X] -> (X, True); X -> (X, False)."""
    origin = get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def _none_or(parse):
    def inner(text: str):
        if text.strip().lower() in ("none", "null", ""):
            return None
        return parse(text)

    inner.__name__ = getattr(parse, "__name__", "value")
    return inner


def flag_name(field_name: str, prefix: str = "") -> str:
    return "--" + (prefix + field_name).replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
                     skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of dataclass `cls`; defaults stay SUPPRESSED so that only the flags
    a user typed override the TOML file and the dataclass defaults."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} fields")
    for field in dataclasses.fields(cls):
        if not field.init or field.name in skip or field.name.startswith("_"):
            continue
        tp, optional = _unwrap_optional(hints[field.name])
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
        kwargs: dict[str, Any] = dict(default=argparse.SUPPRESS, dest=prefix + field.name,
                                      help=help_text)
        origin = get_origin(tp)
        if tp is bool:
            kwargs.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
        elif origin is Literal:
            choices = list(get_args(tp))
            kwargs.update(type=_none_or(str) if optional else str, choices=choices + ([None] if optional else []))
        elif origin in (tuple, list):
            (inner,) = {a for a in get_args(tp) if a is not Ellipsis} or {str}
            kwargs.update(type=inner, nargs="*")
        elif tp in (int, float, str):
            kwargs.update(type=_none_or(tp) if optional else tp)
        elif dataclasses.is_dataclass(tp):
            continue  # nested configs come from TOML tables only
        else:
            kwargs.update(type=str)
        group.add_argument(flag_name(field.name, prefix), **kwargs)


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """--progress [BOOL]: a live progress bar when the console is interactive (default true)."""
    parser.add_argument("--progress", type=_parse_bool, nargs="?", const=True, default=True, metavar="BOOL",
                        help="live progress bar when the console is interactive (default true)")


def add_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """--dtype: cast loaded weights (hf.parse_dtype names); default: as stored."""
    parser.add_argument("--dtype", default=None, help="cast the weights: fp32, bf16 or fp16 (default: as stored)")


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file, naming the file in any error."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p}: invalid TOML: {exc}") from exc


def build_config(cls: type, args: argparse.Namespace | None = None,
                 table: dict[str, Any] | None = None, prefix: str = "", **overrides: Any):
    """Defaults < TOML `table` < typed flags (`args`) < keyword `overrides`.

    Unknown keys in the TOML table are an error naming the key and the known fields."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, value in (table or {}).items():
        if isinstance(value, dict) and key not in names:
            continue  # another config's table
        if key not in names:
            raise ValueError(f"unknown {cls.__name__} field {key!r} in config; "
                             f"known fields: {', '.join(sorted(names))}")
        values[key] = tuple(value) if isinstance(value, list) else value
    if args is not None:
        for name in names:
            if hasattr(args, prefix + name):
                value = getattr(args, prefix + name)
                values[name] = tuple(value) if isinstance(value, list) else value
    values.update(overrides)
    return cls(**values)


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


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="logitlab",
        description="Text -> token ids -> logits -> text, every step visible.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        module = importlib.import_module(f"logitlab.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        error_console().print("[yellow]interrupted[/yellow]")
        return 130
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        if getattr(args, "debug", False):
            raise
        # soft_wrap: one line however long, for a terminal to wrap and for grep to find
        error_console().print(f"[bold red]error:[/bold red] {_error_text(exc)}", soft_wrap=True)
        return 2
    return int(result or 0)
