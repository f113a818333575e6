"""Finding documents: the first step of "corpus -> token files -> batches".

corpus.py owns where documents come from and how they are read: text files, directories, globs,
`.jsonl` (one document per line, a named text field) and `.parquet` (one document per row, a named
column; pyarrow is imported only when a parquet file is read). With no sources, the default corpus
is the Python standard library's own `*.py` source (`default_corpus_files`); `spread_files` and
`limit_chars` take a quick subset of it that still spans all of it. Errors name the file (and line).
It imports nothing from logitlab.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text", "")


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
    """Expand files, directories (recursively: text-like, .jsonl and .parquet files) and globs
    into a sorted, de-duplicated list of files in the order given."""
    files: list[Path] = []
    for src in sources:
        s = str(src)
        if any(ch in s for ch in "*?["):
            matches = sorted(Path(p) for p in globlib.glob(s, recursive=True) if Path(p).is_file())
            if not matches:
                raise FileNotFoundError(f"glob {s!r} matched no files")
            files.extend(matches)
        elif Path(s).is_dir():
            found = sorted(p for p in Path(s).rglob("*") if p.is_file() and not p.name.startswith(".")
                           and (p.suffix in (".jsonl", ".parquet") or p.suffix in TEXT_SUFFIXES))
            if not found:
                raise FileNotFoundError(f"directory {s} holds no text, .jsonl or .parquet files")
            files.extend(found)
        elif Path(s).is_file():
            files.append(Path(s))
        else:
            raise FileNotFoundError(f"data source not found: {s}")
    seen: set[Path] = set()
    return [f for f in files if not (f in seen or seen.add(f))]


def iter_documents(files: Iterable[Path], text_field: str = "text", column: str = "text",
                   skip_undecodable: bool = False) -> Iterator[str]:
    """Yield documents: a whole text file, one `.jsonl` line's `text_field`, or one parquet row's
    `column`. Errors name the file (and line)."""
    for path in files:
        path = Path(path)
        if path.suffix == ".jsonl":
            with path.open("r", encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise ValueError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
                    if not isinstance(record, dict) or text_field not in record:
                        raise ValueError(f"{path}:{lineno}: no field {text_field!r} (use --text-field)")
                    yield str(record[text_field])
        elif path.suffix == ".parquet":
            yield from _iter_parquet(path, column)
        else:
            try:
                yield path.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                if skip_undecodable:
                    continue
                raise ValueError(f"{path} is not valid UTF-8: {exc}") from exc


def _iter_parquet(path: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
    pf = pq.ParquetFile(path)
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {column!r} (columns: {pf.schema_arrow.names}; use --column)")
    for batch in pf.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield str(value)


def limit_chars(docs: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for doc in docs:
        if total >= max_chars:
            return
        total += len(doc)
        yield doc
