"""`logitlab tokenizer ...`: train, encode, decode, show and convert tokenizers (byte-level BPE,
and SentencePiece-style BPE read from a Hugging Face tokenizer.json).

Registered by cli.py. A tokenizer comes from `--tokenizer FILE` (logitlab JSON, or a Hugging Face
tokenizer.json), or from `--gpt2 DIR` (a folder with GPT-2's vocab.json + merges.txt).
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

EOT = "<|endoftext|>"

def register(subparsers) -> None:
    """Add the `tokenizer` command and its subcommands to `subparsers`."""
    from logitlab.cli.common import add_examples

    parser = subparsers.add_parser("tokenizer", help="train, inspect and use byte-level BPE tokenizers")
    add_examples(parser, "tokenizer train --vocab-size 4096 --max-bytes 2000000 --out tok.json",
                 'tokenizer show --tokenizer tok.json "def main():"', 'tokenizer encode --tokenizer gpt2 "Hello"')
    sub = parser.add_subparsers(dest="tokenizer_command", metavar="SUBCOMMAND")
    sub.required = True

    train = sub.add_parser("train", help="learn BPE merges from text files")
    add_examples(train, "tokenizer train --vocab-size 4096 --max-bytes 2000000 --out tok.json",
                 "tokenizer train --data notes/ essays.txt --vocab-size 8192 --special-token '<|endoftext|>' "
                 "--special-token '<|im_start|>' --out tok.json --export-hf tokenizer.json")
    # flags taking several values accumulate when repeated (--special-token A --special-token B)
    train.add_argument("--data", nargs="+", action="extend", metavar="PATH",
                       help="files or directories; repeatable (default: the Python standard library's *.py files)")
    train.add_argument("--glob", default="**/*", help="files taken from directories (default: **/*)")
    train.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary, specials included")
    train.add_argument("--max-bytes", type=int, default=None, metavar="N",
                       help="train on about N bytes: whole files spread evenly over the sources (default: all)")
    train.add_argument("--special-token", nargs="*", action="extend", default=None, metavar="S",
                       help="special tokens, several after one flag or the flag repeated (default: <|endoftext|>; "
                       "give the flag alone for none)")
    train.add_argument("--pattern", default="gpt2", help="gpt2 (default), cl100k, gpt2_digits or a regex")
    train.add_argument("--workers", type=int, default=None, help="pre-tokenization processes (default: all cores)")
    train.add_argument("--out", required=True, help="tokenizer file to write (logitlab JSON + .vocab listing)")
    train.add_argument("--export-hf", metavar="FILE", help="also write a Hugging Face tokenizer.json")
    train.add_argument("--export-tiktoken", metavar="FILE", help="also write a tiktoken rank file")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    for name, helptext in (("encode", "text -> ids"), ("decode", "ids -> text"),
                           ("show", "each token of a text with its id and bytes")):
        p = sub.add_parser(name, help=helptext)
        add_examples(p, *{"encode": ['tokenizer encode --tokenizer tok.json "def main():\\n" --json',
                                     "echo 'text from stdin' | logitlab tokenizer encode --tokenizer runs/a"],
                          "decode": ["tokenizer decode --tokenizer tok.json 100 257 31",
                                     "echo '[100, 257]' | logitlab tokenizer decode --tokenizer tok.json"],
                          "show": ['tokenizer show --tokenizer tok.json "def main():\\n\\treturn 0"',
                                   'tokenizer show --tokenizer Qwen/Qwen3-0.6B "Hello, world"']}[name])
        _add_source(p)
        if name == "decode":
            p.add_argument("ids", nargs="*", help="ids (default: read from stdin; JSON list or whitespace separated)")
        else:
            p.add_argument("text", nargs="?", help="text; \\n and \\t in it are a newline and a tab, \\\\ a "
                           "backslash, as in generate and inspect (default: read from stdin, taken as it is)")
            p.add_argument("--ordinary", action="store_true",
                           help="treat special-token strings as plain text (for untrusted input)")
        if name != "show":
            p.add_argument("--json", action="store_true", help="JSON output")
        p.set_defaults(func={"encode": cmd_encode, "decode": cmd_decode, "show": cmd_show}[name])

    convert = sub.add_parser("convert", help="write a tokenizer in another format")
    add_examples(convert, "tokenizer convert --tokenizer tok.json --to hf --out tokenizer.json",
                 "tokenizer convert --gpt2 gpt2/ --to tiktoken --out gpt2.tiktoken")
    _add_source(convert)
    convert.add_argument("--to", choices=["logitlab", "hf", "tiktoken"], required=True,
                         help="format to write: logitlab JSON, Hugging Face tokenizer.json or a tiktoken rank file")
    convert.add_argument("--out", required=True, metavar="FILE", help="file to write")
    convert.set_defaults(func=cmd_convert)

    from logitlab.cli import post  # add-special: the model's padded slots (post-training)
    post.add_special_parser(sub)


def _add_source(parser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--tokenizer", metavar="FILE|MODEL", help="a logitlab tokenizer JSON or a Hugging Face "
                       "tokenizer.json, or a MODEL whose tokenizer to use (a run or model directory, or a hub id)")
    group.add_argument("--gpt2", metavar="DIR", help="folder with GPT-2's vocab.json and merges.txt")
    parser.add_argument("--reference", action="store_true", help="use the pure-Python encoder")


def load_tokenizer(args):
    from logitlab.tokenizer.core import Tokenizer

    if args.gpt2:
        folder = Path(args.gpt2)
        if not folder.is_dir():
            raise FileNotFoundError(f"--gpt2 folder not found: {folder}")
        return Tokenizer.from_gpt2_files(folder / "vocab.json", folder / "merges.txt")
    path = Path(args.tokenizer)
    if not path.is_file():
        return _model_tokenizer(args.tokenizer)
    try:
        head = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: malformed tokenizer file (not JSON: {exc})") from None
    if isinstance(head, dict) and "model" in head and "format" not in head:
        return Tokenizer.from_hf(path)
    return Tokenizer.load(path)


def _model_tokenizer(spec: str):
    """The tokenizer of a model directory or hub id (io.hf.load_tokenizer), for --tokenizer MODEL."""
    from logitlab.io import hf, hub

    if not Path(spec).is_dir() and not hub.looks_like_hub_id(spec):
        raise FileNotFoundError(f"tokenizer file not found: {spec}")
    tok = hf.load_tokenizer(spec)
    if tok is None:
        raise FileNotFoundError(f"{spec}: no tokenizer file in this model directory")
    return tok


def _text(args) -> str:
    """TEXT with the escapes every command reads (\\n, \\t, \\\\), or stdin as it is."""
    from logitlab.cli.generate import _unescape

    return _unescape(args.text) if args.text is not None else sys.stdin.read()


def _encode(tok, args) -> list[int]:
    return tok.encode(_text(args), allowed_special="none" if args.ordinary else "all",
                      fast=False if args.reference else None)


def _check_outputs(args) -> None:
    """Refuse unusable output paths before training starts (minutes, for a large corpus)."""
    from logitlab.tokenizer.formats import HF, LISTING, LOGITLAB, TIKTOKEN, check_target

    out = Path(args.out)
    if out.suffix == ".vocab":
        raise ValueError(f"--out {out}: the readable listing is written beside the tokenizer as <name>.vocab, "
                         f"so --out needs another suffix (e.g. {out.with_suffix('.json')})")
    targets = [(out, LOGITLAB, "--out"), (out.with_suffix(".vocab"), LISTING, "--out's listing")]
    if args.export_hf:
        targets.append((Path(args.export_hf), HF, "--export-hf"))
    if args.export_tiktoken:
        targets.append((Path(args.export_tiktoken), TIKTOKEN, "--export-tiktoken"))
    seen: dict[Path, str] = {}
    for path, kind, flag in targets:
        key = path.absolute()
        if key in seen:
            raise ValueError(f"{flag} and {seen[key]} name the same file {path}")
        seen[key] = flag
        with _writing(path):
            check_target(path, kind)


@contextmanager
def _writing(path):
    """An OSError while writing `path` becomes one line naming the file (cli.main prints it)."""
    from logitlab.io.files import DiskFullError

    try:
        yield
    except DiskFullError as exc:
        raise RuntimeError(exc.strerror or str(exc)) from exc
    except OSError as exc:
        raise RuntimeError(f"cannot write {exc.filename or path}: {exc.strerror or exc}") from exc


@contextmanager
def bpe_progress_bar(enabled: bool = True, con=None):
    """A rich progress bar (bytes pre-tokenized, then merges learned) for BPE training, as the
    `progress(phase, done, total)` callback that train_bpe takes; None when not enabled."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=con, transient=False) as bar:
        tasks = {"pretokenize": bar.add_task("pre-tokenizing", total=None),
                 "merge": bar.add_task("merging", total=None)}
        yield lambda phase, done, total: bar.update(tasks[phase], completed=done, total=total)


def cmd_train(args) -> int:
    from rich.markup import escape

    from logitlab.cli.common import console, error_console
    from logitlab.tokenizer.bpe import ShortVocabularyWarning, stdlib_files, train_tokenizer

    _check_outputs(args)
    data = args.data or stdlib_files()
    if args.max_bytes is not None:
        data = _spread(data, args.max_bytes, args.glob)
    with warnings.catch_warnings(record=True) as caught:
        # Shown once each, as "warning: ..." lines: a short vocabulary, undecodable input bytes.
        warnings.simplefilter("always", ShortVocabularyWarning)
        warnings.simplefilter("always", UnicodeWarning)
        with bpe_progress_bar(enabled=not args.no_progress) as progress:
            specials = [EOT] if args.special_token is None else args.special_token
            tok = train_tokenizer(data, args.vocab_size, specials, pattern=args.pattern,
                                  workers=args.workers, progress=progress, glob=args.glob)
    for w in caught:
        error_console().print(f"[yellow]warning:[/yellow] {escape(str(w.message))}", soft_wrap=True)
    with _writing(args.out):
        tok.save(args.out)
    if args.export_hf:
        with _writing(args.export_hf):
            tok.save_hf(args.export_hf)
    if args.export_tiktoken:
        with _writing(args.export_tiktoken):
            tok.save_tiktoken(args.export_tiktoken)
    out = Path(args.out)
    console().print(f"wrote {out} and {out.with_suffix('.vocab')}: {tok!r}, fingerprint {tok.fingerprint()}, "
                    f"encoder {'tiktoken' if tok.fast_path_ok else 'reference (vocabulary not tiktoken-consistent)'}")
    return 0


def _spread(sources, max_bytes: int, glob: str) -> list[str]:
    """About `max_bytes` of `sources` as every k-th file, so a sample spans the whole corpus."""
    from logitlab.data.corpus import spread_files
    from logitlab.tokenizer.bpe import expand_paths

    if max_bytes <= 0:
        raise ValueError(f"--max-bytes must be a positive number of bytes, got {max_bytes}")
    return [str(p) for p in spread_files(expand_paths(sources, glob), max_bytes, offset=1)]


def cmd_encode(args) -> int:
    ids = _encode(load_tokenizer(args), args)
    print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_decode(args) -> int:
    tok = load_tokenizer(args)
    ids = parse_ids(" ".join(args.ids) if args.ids else sys.stdin.read())
    text = tok.decode(ids)  # an id outside the vocabulary: ValueError naming it and its position
    if args.json:
        print(json.dumps({"text": text}, ensure_ascii=False))
    else:
        sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
    return 0


_INTEGER = re.compile(r"-?[0-9]+")


def parse_ids(raw: str) -> list[int]:
    """Decode input -> ids: a flat JSON list of integers, or integers separated by whitespace or
    commas. Anything else (a nested list, true/false, 1.0, "7", 1e3) is a ValueError naming the
    element and its position: an id is never guessed from another type."""
    raw = raw.strip()
    if raw.startswith("["):
        try:
            items = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"decode input is not a valid JSON list of ids: {exc}") from None
        for n, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, int):
                shown = json.dumps(x, ensure_ascii=False)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise ValueError(f"decode input: element {n} is {shown}, not an integer token id")
        return items
    items = raw.replace(",", " ").split()
    for n, x in enumerate(items):
        if not _INTEGER.fullmatch(x):
            shown = x if len(x) <= 40 else x[:37] + "..."
            raise ValueError(f"decode input: element {n} is {shown!r}, not an integer token id")
    return [int(x) for x in items]


def cmd_show(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    from logitlab.cli.common import console, quote_token

    tok = load_tokenizer(args)
    text = _text(args)
    ids = _encode(tok, args)
    table = Table(title=f"{len(ids)} tokens", show_lines=False)
    for col in ("#", "id", "token", "bytes"):
        table.add_column(col, justify="right" if col in ("#", "id") else "left")
    pieces = tok.kind == "sentencepiece"  # its pieces as the vocabulary spells them: '▁the', '<0xE2>'
    for n, i in enumerate(ids):
        raw = tok.token_bytes(i)
        label = escape(quote_token(tok.piece(i) if pieces else raw))
        table.add_row(str(n), str(i), f"[bold]{label}[/bold] special" if tok.is_special(i) else label,
                      raw.hex(" "))
    out = console()
    out.print(table)
    n_bytes = len(text.encode("utf-8", errors="replace"))
    ratio = n_bytes / len(ids) if ids else 0.0
    if pieces:
        encoder = "SentencePiece-style BPE" + (", reference encoder" if args.reference else "")
    else:
        encoder = "encoder " + ("tiktoken" if tok.fast_path_ok and not args.reference else "reference")
    out.print(f"{len(ids)} tokens, {n_bytes} bytes, {ratio:.2f} bytes/token (vocab_size {tok.vocab_size}, {encoder})")
    if pieces:
        out.print("'▁' is a space; <0xNN> is one byte of a character outside the vocabulary (byte fallback); "
                  "bytes: what each token adds to the text", markup=False, highlight=False, soft_wrap=True)
    return 0


def cmd_convert(args) -> int:
    from logitlab.cli.common import console

    tok = load_tokenizer(args)
    with _writing(args.out):
        {"logitlab": tok.save, "hf": tok.save_hf, "tiktoken": tok.save_tiktoken}[args.to](args.out)
    console().print(f"wrote {args.out} ({args.to})")
    return 0
