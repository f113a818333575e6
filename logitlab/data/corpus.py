"""Finding documents: the first step of "corpus -> token files -> batches".

corpus.py owns where documents come from and how they are read, streaming: text files,
directories, globs, `.jsonl` / `.jsonl.gz` / `.jsonl.zst` (one document per line, a named text
field) and `.parquet` (one document per row, a named column, read one row group at a time; pyarrow
and zstandard are imported only when such a file is read). `iter_records` yields `Document`s that
keep their metadata (source name, document id = file and line or row); `iter_documents` yields the
texts alone. A source may be named (`web=crawl/`, see `parse_source`). With no sources, the default
corpus is the Python standard library's own `*.py` source (`default_corpus_files`); `spread_files`
and `limit_chars` take a quick subset of it that still spans all of it. Errors name the file (and
line). It imports nothing from logitlab.
"""

from __future__ import annotations

import glob as globlib
import gzip
import io
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text", "")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Document:
    """One document and where it came from: `source` (the source's name) and `doc_id`
    (`file`, `file:LINE` for JSON lines, `file:rowN` for parquet rows)."""

    text: str
    source: str
    doc_id: str


def file_kind(path: Path) -> str:
    """"jsonl", "jsonl.gz", "jsonl.zst", "parquet" or "text", from the file name."""
    name = path.name
    for suffix in JSONL_SUFFIXES:
        if name.endswith(suffix):
            return suffix[1:]
    return "parquet" if name.endswith(".parquet") else "text"


def _readable(path: Path) -> bool:
    return not path.name.startswith(".") and (file_kind(path) != "text" or path.suffix in TEXT_SUFFIXES)


def parse_source(spec: str | os.PathLike) -> tuple[str, str]:
    """"NAME=PATH" -> (NAME, PATH); a plain PATH is its own name. A path that exists as written
    is never split (a file may contain "=")."""
    s = str(spec)
    name, eq, rest = s.partition("=")
    if eq and rest and _NAME.fullmatch(name) and not Path(s).exists():
        return name, rest
    return s, s


def default_corpus_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Every `*.py` under the standard library directory (`sysconfig.get_paths()["stdlib"]`),
    sorted by path, skipping `site-packages` / `dist-packages` (third-party code) and
    `__pycache__`. Files that are not valid UTF-8 (a few deliberate encoding test cases) are
    skipped when read."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory not found: {root}")
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(out)


def spread_files(files: Sequence[Path], max_bytes: int, offset: int = 0) -> list[Path]:
    """About `max_bytes` worth of `files`, taken as every k-th file (starting at `offset`) so a
    subset of a sorted corpus spans all of it rather than its first directories."""
    files = list(files)
    sizes = [f.stat().st_size for f in files]
    k = max(1, sum(sizes) // max(max_bytes, 1))
    picked, total = [], 0
    for i in range(offset % k, len(files), k):
        if total >= max_bytes:
            break
        picked.append(files[i])
        total += sizes[i]
    return picked


def resolve_sources(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand files, directories (recursively: text-like, .jsonl(.gz/.zst) and .parquet files)
    and globs, each optionally named (NAME=PATH, see parse_source), into a sorted, de-duplicated
    list of files in the order given."""
    files: list[Path] = []
    for src in sources:
        s = parse_source(src)[1]
        if any(ch in s for ch in "*?["):
            matches = sorted(Path(p) for p in globlib.glob(s, recursive=True) if Path(p).is_file())
            if not matches:
                raise FileNotFoundError(f"glob {s!r} matched no files")
            files.extend(matches)
        elif Path(s).is_dir():
            found = sorted(p for p in Path(s).rglob("*") if p.is_file() and _readable(p))
            if not found:
                raise FileNotFoundError(f"directory {s} holds no text, .jsonl(.gz/.zst) or .parquet files")
            files.extend(found)
        elif Path(s).is_file():
            files.append(Path(s))
        else:
            raise FileNotFoundError(f"data source not found: {s}")
    seen: set[Path] = set()
    return [f for f in files if not (f in seen or seen.add(f))]


def iter_documents(files: Iterable[Path], text_field: str = "text", column: str = "text",
                   skip_undecodable: bool = False) -> Iterator[str]:
    """Yield documents' texts: a whole text file, one JSON line's `text_field`, or one parquet
    row's `column`. Errors name the file (and line)."""
    for path in files:
        for doc in iter_records(Path(path), str(path), text_field, column, skip_undecodable):
            yield doc.text


def iter_records(path: Path, source: str, text_field: str = "text", column: str = "text",
                 skip_undecodable: bool = False) -> Iterator[Document]:
    """The documents of one file, streamed, with their metadata (see `Document`)."""
    kind = file_kind(path)
    if kind == "parquet":
        for row, text in _iter_parquet(path, column):
            yield Document(text, source, f"{path}:row{row}")
    elif kind != "text":
        with _open_lines(path, kind) as f:
            for lineno, line in enumerate(f, 1):
                text = _json_text(path, lineno, line, text_field)
                if text is not None:
                    yield Document(text, source, f"{path}:{lineno}")
    else:
        try:
            yield Document(path.read_text(encoding="utf-8"), source, str(path))
        except UnicodeDecodeError as exc:
            if not skip_undecodable:
                raise ValueError(f"{path} is not valid UTF-8: {exc}") from exc


def _open_lines(path: Path, kind: str):
    """A text stream over the lines of a (compressed) JSON-lines file."""
    if kind == "jsonl.gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if kind == "jsonl.zst":
        try:
            import zstandard
        except ImportError as exc:
            raise ValueError(f"reading {path} needs zstandard: pip install zstandard") from exc
        raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _json_text(path: Path, lineno: int, line: str, text_field: str) -> str | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
    if not isinstance(record, dict) or text_field not in record:
        raise ValueError(f"{path}:{lineno}: no field {text_field!r} (use --text-field)")
    value = record[text_field]
    return None if value is None else str(value)


def _iter_parquet(path: Path, column: str) -> Iterator[tuple[int, str]]:
    """(row number, text) of each non-null row, one row group in memory at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
    pf = pq.ParquetFile(path)
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {column!r} (columns: {pf.schema_arrow.names}; use --column)")
    row = 0
    for group in range(pf.num_row_groups):
        for value in pf.read_row_group(group, columns=[column]).column(0).to_pylist():
            if value is not None:
                yield row, str(value)
            row += 1


def limit_chars(docs: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for doc in docs:
        if total >= max_chars:
            return
        total += len(doc)
        yield doc
