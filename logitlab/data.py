"""Corpora -> flat token files -> training and evaluation batches.

data.py owns three steps of the path "text -> ids":

1. Finding documents: text files, directories, globs, `.jsonl` (one document per line, a named
   text field) and `.parquet` (one document per row, a named column; pyarrow is imported only
   when a parquet file is read). With no sources, the default corpus is the Python standard
   library's own `*.py` source (`default_corpus_files`).
2. `prepare_corpus`: tokenizes documents in worker processes, streaming (documents are read,
   encoded and appended a chunk at a time, so a large corpus never sits in memory), into
   `train.bin` / `val.bin` (uint16 when every id fits, else uint32) plus `manifest.json`. Every
   document is followed by the end-of-text id. Document k (0-based, in source order) goes to
   validation when floor((k+1)·f) > floor(k·f) for f = val_fraction: deterministic, spread evenly,
   and the two splits never share a document.
3. Batches: `RandomWindows` draws B random windows of T+1 tokens from the memory-mapped file and
   returns inputs x (B, T) int64 and targets y (B, T) = x shifted by one (teacher forcing). Batch
   number i is drawn from a generator seeded with (seed, i), so the sampler's whole state is one
   counter: resuming is setting it. With world_size > 1 each rank takes its own slice of the same
   global batch, so the global batch does not depend on the number of ranks. `eval_windows` is
   the sequential pass used for validation: the same tokens every time.

It imports nothing from logitlab but the file primitives (files.py); the tokenizer is passed in
(anything with encode_ordinary or encode, eot_id, vocab_size, fingerprint, save/load). A token
directory appears whole or not at all, and the token files are checked against the manifest
(their sizes) before they are read.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from logitlab import files

MANIFEST_FILE = "manifest.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text", "")
_CHUNK_CHARS = 1 << 20  # about 1 MB of text per worker task


# --------------------------------------------------------------------------------------------
# Finding documents
# --------------------------------------------------------------------------------------------

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


def is_validation(k: int, val_fraction: float) -> bool:
    """Document k goes to validation when floor((k+1)·f) > floor(k·f): evenly spread, exact."""
    return int((k + 1) * val_fraction) > int(k * val_fraction)


def split_of_documents(n_docs: int, val_fraction: float) -> list[str]:
    """The split of each of n_docs documents (the reference for is_validation)."""
    return ["val" if is_validation(k, val_fraction) else "train" for k in range(n_docs)]


# --------------------------------------------------------------------------------------------
# Tokenizing into token files
# --------------------------------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


_worker_tok = None


def _worker_init(tokenizer) -> None:
    # With the fork start method the tokenizer object is inherited, not pickled.
    global _worker_tok
    _worker_tok = tokenizer


def _encode(tok, text: str) -> list[int]:
    # Corpus text is untrusted: special-token strings inside it are encoded as plain text.
    if hasattr(tok, "encode_ordinary"):
        return tok.encode_ordinary(text)
    return tok.encode(text, allowed_special="none")


def _encode_chunk(task: tuple[list[str], int, str]) -> list[np.ndarray]:
    docs, eot, dtype = task
    out = []
    for text in docs:
        ids = _encode(_worker_tok, text)
        ids.append(eot)
        out.append(np.asarray(ids, dtype=dtype))
    return out


def _chunks(docs: Iterable[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def prepare_corpus(sources: Sequence[str | os.PathLike] | None, tokenizer, out_dir: str | os.PathLike,
                   *, val_fraction: float = 0.01, workers: int | None = None, text_field: str = "text",
                   column: str = "text", max_bytes: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenize `sources` (None: the standard library corpus) into `out_dir`/train.bin, val.bin
    and manifest.json; returns the manifest. `progress(documents, tokens)` is called after each
    chunk. `max_bytes` stops after about that many characters of text (a quick subset).
    The manifest is written last, so a directory without one is incomplete."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    eot = getattr(tokenizer, "eot_id", None)
    if eot is None:
        raise ValueError("the tokenizer has no <|endoftext|> special token; documents need a separator")
    default = not sources
    files_ = default_corpus_files() if default else resolve_sources(sources)
    if default and max_bytes is not None:
        files_ = spread_files(files_, max_bytes)
    out = Path(out_dir)
    # the whole directory appears at once (files.atomic_directory): an earlier token directory of
    # ours is replaced, anything else there is kept, and a directory we did not write is refused
    with files.atomic_directory(out, TOKENS_KIND, overwrite=True, legacy=_legacy_token_dir(out)) as tmp:
        manifest = _write_tokens(files_, default, sources, tokenizer, tmp, val_fraction, workers, text_field,
                                 column, max_bytes, progress)
    return manifest


TOKENS_KIND = "token data"


def _legacy_token_dir(out: Path) -> set[str] | None:
    """A token directory written before output markers: its manifest says so."""
    try:
        manifest = json.loads((out / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != "logitlab-tokens":
        return None
    names = {MANIFEST_FILE, "tokenizer.logitlab.json", *SPLIT_FILES.values()}
    return names & set(os.listdir(out))


def _write_tokens(files_list, default, sources, tokenizer, out: Path, val_fraction, workers, text_field, column,
                  max_bytes, progress) -> dict:
    eot = tokenizer.eot_id
    tok_path = out / "tokenizer.logitlab.json"
    tokenizer.save(tok_path)
    dtype = token_dtype(tokenizer.vocab_size)
    docs = iter_documents(files_list, text_field, column, skip_undecodable=default)
    if max_bytes is not None:
        docs = limit_chars(docs, max_bytes)
    tasks = ((chunk, eot, dtype.str) for chunk in _chunks(docs))
    workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    counts = {s: {"documents": 0, "tokens": 0} for s in SPLIT_FILES}
    handles = {s: (out / SPLIT_FILES[s]).open("wb") for s in SPLIT_FILES}  # `out` is still temporary
    k = 0
    try:
        for chunk in _map_chunks(tasks, tokenizer, workers):
            for ids in chunk:
                split = "val" if is_validation(k, val_fraction) else "train"
                with files.writing(out / SPLIT_FILES[split]):
                    handles[split].write(ids.tobytes())
                counts[split]["documents"] += 1
                counts[split]["tokens"] += int(ids.size)
                k += 1
            if progress is not None:
                progress(k, sum(c["tokens"] for c in counts.values()))
    finally:
        for s, h in handles.items():
            with files.writing(out / SPLIT_FILES[s]):
                h.close()
    if counts["train"]["tokens"] == 0:
        raise ValueError(f"no training tokens: the sources hold {k} document(s)")
    manifest = {
        "format": "logitlab-tokens", "version": 1,
        "tokenizer_fingerprint": tokenizer.fingerprint(), "tokenizer_file": tok_path.name,
        "vocab_size": int(tokenizer.vocab_size), "eot_id": int(eot), "dtype": dtype.name,
        "val_fraction": val_fraction, "val_rule": "document k is validation iff floor((k+1)*f) > floor(k*f)",
        "sources": ["<python stdlib>"] if default else [str(s) for s in sources],
        "files": len(files_list), "documents": k,
        "splits": {s: dict(file=SPLIT_FILES[s], **counts[s]) for s in SPLIT_FILES},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def limit_chars(docs: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for doc in docs:
        if total >= max_chars:
            return
        total += len(doc)
        yield doc


def _map_chunks(tasks, tokenizer, workers: int) -> Iterator[list[np.ndarray]]:
    """Encode chunks in order, in `workers` processes (or inline for workers=1)."""
    if workers == 1:
        _worker_init(tokenizer)
        yield from map(_encode_chunk, tasks)
        return
    import collections
    import multiprocessing as mp

    ctx = mp.get_context("spawn" if os.name == "nt" else "fork")
    # apply_async with a bounded queue, not Pool.imap: imap reads its whole input eagerly, and
    # streaming means at most 2·workers chunks of text in memory at once.
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer,)) as pool:
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode_chunk, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def read_manifest(data_dir: str | os.PathLike) -> dict:
    """The token directory's manifest.json, checked for the fields the readers use."""
    path = Path(data_dir) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST_FILE} in {data_dir} (run `logitlab prepare` first)")
    manifest = files.read_json(path, "token manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != "logitlab-tokens":
        raise ValueError(f"{path} is not a logitlab token manifest (expected \"format\": \"logitlab-tokens\")")
    splits = manifest.get("splits")
    try:
        np.dtype(manifest["dtype"])
        ok = isinstance(manifest["vocab_size"], int) and isinstance(splits, dict) and all(
            isinstance(v, dict) and isinstance(v.get("file"), str) and isinstance(v.get("tokens"), int)
            for v in splits.values())
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: malformed manifest (needs dtype, vocab_size and splits with file and tokens)")
    return manifest


def load_tokens(data_dir: str | os.PathLike, split: str) -> np.memmap:
    """The token file of `split` ("train" or "val") as a read-only memory map."""
    manifest = read_manifest(data_dir)
    if split not in manifest["splits"]:
        raise ValueError(f"unknown split {split!r}; have {sorted(manifest['splits'])}")
    info = manifest["splits"][split]
    path = Path(data_dir) / info["file"]
    dtype = np.dtype(manifest["dtype"])
    expected = int(info["tokens"]) * dtype.itemsize
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing ({Path(data_dir) / MANIFEST_FILE} lists it)")
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"{path} holds {size:,} bytes, but {Path(data_dir) / MANIFEST_FILE} says "
                         f"{int(info['tokens']):,} {dtype.name} tokens = {expected:,} bytes: the file is "
                         f"truncated or was replaced; prepare the data again")
    if info["tokens"] == 0:
        return np.zeros(0, dtype=dtype)  # an empty split cannot be memory-mapped
    return np.memmap(path, dtype=dtype, mode="r", shape=(info["tokens"],))


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

@dataclass
class RandomWindows:
    """Random windows of T+1 tokens -> (x, y), deterministic in (seed, batch index).

    `batch_size` is the GLOBAL batch; rank r of world_size takes rows [r·b, (r+1)·b) with
    b = batch_size // world_size. `state_dict()` / `load_state_dict()` hold the batch counter."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.seq_len <= 0 or self.batch_size <= 0:
            raise ValueError(f"seq_len ({self.seq_len}) and batch_size ({self.batch_size}) must be > 0")
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(f"token file holds {len(self.tokens)} tokens, fewer than seq_len + 1 "
                             f"= {self.seq_len + 1}; use more data or a shorter seq_len")
        if self.batch_size % self.world_size or not 0 <= self.rank < self.world_size:
            raise ValueError(f"batch_size ({self.batch_size}) must divide by world_size "
                             f"({self.world_size}) and 0 <= rank ({self.rank}) < world_size")

    def offsets(self, index: int) -> np.ndarray:
        """Start offsets of global batch `index` (all ranks)."""
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def next(self):
        """The next (x, y), each (b, T) int64 on CPU, and advance the counter."""
        b = self.batch_size // self.world_size
        starts = self.offsets(self.index)[self.rank * b:(self.rank + 1) * b]
        self.index += 1
        return windows_to_batch(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "index": self.index, "batch_size": self.batch_size, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this run has {getattr(self, key)}")
        self.index = int(state["index"])


def windows_to_batch(tokens: np.ndarray, starts: Iterable[int], seq_len: int):
    """Windows tokens[s : s+T+1] -> x (B, T) int64, y (B, T) int64 with y[:, t] = x[:, t+1]'s token."""
    import torch

    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])  # (B, T+1)
    full = torch.from_numpy(rows)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int | None = None,
                 rank: int = 0, world_size: int = 1):
    """The sequential evaluation pass: non-overlapping windows at 0, T, 2T, ... covering up to
    `max_tokens` targets, yielded as (x, y) batches of at most batch_size rows. Rank r takes
    windows r, r + world_size, ... . Always the same tokens for the same arguments."""
    n_windows = (len(tokens) - 1) // seq_len
    if max_tokens is not None:
        n_windows = min(n_windows, max(1, max_tokens // seq_len))
    starts = [i * seq_len for i in range(rank, n_windows, world_size)]
    for i in range(0, len(starts), batch_size):
        yield windows_to_batch(tokens, starts[i:i + batch_size], seq_len)
