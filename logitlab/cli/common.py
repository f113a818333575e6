"""What every subcommand shares: the consoles, the flags made from config dataclasses, TOML
config files, and the one line an error prints.

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
                     skip: tuple[str, ...] = (), shown_defaults: dict[str, Any] | None = None,
                     description: str | None = None, renamed: dict[str, str] | None = None) -> None:
    """Add one flag per field of dataclass `cls`; defaults stay SUPPRESSED so that only the flags
    a user typed override the TOML file and the dataclass defaults. Each help line states its
    default once: the field help's own "default ..." wording when it has one, else "(default: X)";
    a default of None or an empty tuple is not shown ("(default: None)" tells a reader nothing).
    `shown_defaults` (help text only) replaces the dataclass defaults a command does not use
    (train's model fields come from the tiny preset); `description` heads the flag group.
    `renamed` gives a field the flag the whole command line uses for its concept (out_dir ->
    --out); the flag made from the field's name stays as a hidden alias (its old spelling)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} fields", description)
    for field in dataclasses.fields(cls):
        if not field.init or field.name in skip or field.name.startswith("_"):
            continue
        tp, optional = _unwrap_optional(hints[field.name])
        help_text = field.metadata.get("help", "")
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        if shown_defaults is not None and field.name in shown_defaults:
            shown = shown_defaults[field.name]
            if "default" not in help_text and shown not in (None, ()):
                help_text = f"{help_text} (default: {shown})"
            elif shown is not None:  # the field's own rule, which the preset replaces
                help_text = f"{help_text} (preset: {shown})"
        elif "default" not in help_text and default not in (None, ()):
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
            kwargs.update(type=inner, nargs="*", action="extend")       # repeated flags add up
            if get_origin(inner) is Literal:                            # a tuple of choices (layer_types)
                kwargs.update(type=str, choices=list(get_args(inner)))
        elif tp in (int, float, str):
            kwargs.update(type=_none_or(tp) if optional else tp)
        elif dataclasses.is_dataclass(tp):
            continue  # nested configs come from TOML tables only
        else:
            kwargs.update(type=str)
        if renamed and field.name in renamed:
            group.add_argument(renamed[field.name], **kwargs)
            kwargs["help"] = argparse.SUPPRESS
        group.add_argument(flag_name(field.name, prefix), **kwargs)


class ExamplesFormatter(argparse.HelpFormatter):
    """argparse's formatter, but an epilog of examples keeps its lines (one command per line, never
    re-wrapped: each is meant to be copied) while the description still wraps to the terminal."""

    def _fill_text(self, text, width, indent):
        if text.startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_examples(parser: argparse.ArgumentParser, *commands: str) -> None:
    """An "examples:" epilog for `parser`'s --help, one command per line (after `logitlab `)."""
    lines = "\n".join(f"  logitlab {c}" for c in commands)
    parser.epilog = f"example{'s' if len(commands) > 1 else ''}:\n{lines}"
    parser.formatter_class = ExamplesFormatter


def plural(n: int, word: str, many: str | None = None) -> str:
    """"1 doc", "2 docs", "1,024 tokens": a count with its noun in the right number."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


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
# Tables
# --------------------------------------------------------------------------------------------

_ESCAPES = {"'": "\\'", "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def quote_token(token: str | bytes) -> str:
    """A token as every table shows it (tokenizer show, inspect, demo): in single quotes; \\n \\t \\r \\' and
    \\\\ escaped; other unprintable characters as \\uNNNN; for bytes, those that are not valid UTF-8
    on their own (part of a multi-byte character) as \\xNN. No rich markup is interpreted."""
    text = token.decode("utf-8", errors="surrogateescape") if isinstance(token, bytes) else token
    out = []
    for c in text:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif 0xDC80 <= ord(c) <= 0xDCFF and isinstance(token, bytes):  # an undecodable byte
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        elif not c.isprintable():
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return "'" + "".join(out) + "'"


def print_table(out, title: str, columns: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> None:
    """One rich table whose cells are never cut, at any console width. The title stands on a line
    of its own (never wrapped). A table too wide for the console folds: its borders become a single
    rule under the header and its headers and text cells wrap at spaces, while numbers (the
    columns whose index is in `right`, right-aligned) keep their whole width. Where even that does
    not fit, each row is printed as a record: its key, then one `column: value` line per cell."""
    from rich import box
    from rich.table import Table

    def width(i: int, longest) -> int:
        return max([longest(columns[i])] + [longest(row[i]) for row in rows])

    def word(text: str) -> int:
        return max((len(w) for w in text.split()), default=0)

    natural = sum(width(i, len) + 3 for i in range(len(columns))) + 1      # cells, padding, borders
    narrowest = sum(width(i, len if i in right else word) + 2 for i in range(len(columns)))
    out.print(title, soft_wrap=True, markup=False, highlight=False)
    if narrowest > out.width:
        for row in rows:
            out.print(row[0], soft_wrap=True, markup=False, highlight=False)
            for name, cell in zip(columns[1:], row[1:]):
                if cell:
                    out.print(f"  {name}: {cell}", soft_wrap=True, markup=False, highlight=False)
        return
    compact = natural > out.width
    table = Table(box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD, show_edge=not compact)
    for i, name in enumerate(columns):
        numbers = width(i, len) if i in right else None                   # never folded
        table.add_column(name, justify="right" if i in right else "left", overflow="fold", min_width=numbers)
    for row in rows:
        table.add_row(*row)
    out.print(table)

