"""Tokenizing documents into flat token files: the middle step of "corpus -> token files -> batches".

tokens.py owns `prepare_corpus`: it tokenizes documents (found by corpus.py) in worker processes,
streaming (documents are read, encoded and appended a chunk at a time, so a large corpus never sits
in memory), into `train.bin` / `val.bin` (uint16 when every id fits, else uint32) plus
`manifest.json`. Every document is followed by the end-of-text id. Document k (0-based, in source
order) goes to validation when floor((k+1)·f) > floor(k·f) for f = val_fraction: deterministic,
spread evenly, and the two splits never share a document. When that rule would hold out no
document (one file, or fewer than 1/f documents) and f > 0, the tail of the token stream is held
out instead: the last max(1, round(f·N)) of the N tokens, at least `min_val_tokens` (one
evaluation window) when the training part keeps as many, and never more than half. The manifest
records which rule made validation ("validation": "documents", "tail" or "none") and a one-line
"val_note" the CLI prints; with f = 0 there is no validation set and the note says so. It also
owns reading them back:
`read_manifest` and `load_tokens` (a read-only memory map, or for the sharded layout that
merge.py writes a `shards.ShardedTokens` view across train-NNNNN.bin files; every file's size is
checked against the manifest before it is read). The batches drawn from them are batches.py's.

It imports nothing from logitlab but the file primitives (files.py) and its siblings; the tokenizer
is passed in (anything with encode_ordinary or encode, eot_id, vocab_size, fingerprint, save/load).
A token directory appears whole or not at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from logitlab.data.batches import RandomWindows, eval_windows, windows_to_batch  # noqa: F401  kept importable here
from logitlab.data.corpus import (  # noqa: F401  kept importable here (corpus.py)
    TEXT_SUFFIXES,
    default_corpus_files,
    iter_documents,
    limit_chars,
    resolve_sources,
    spread_files,
)
from logitlab.io import files, workdir

MANIFEST_FILE = "manifest.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
_CHUNK_CHARS = 1 << 20  # about 1 MB of text per worker task


# --------------------------------------------------------------------------------------------
# The split rule
# --------------------------------------------------------------------------------------------

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
                   column: str = "text", max_bytes: int | None = None, min_val_tokens: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenize `sources` (None: the standard library corpus) into `out_dir`/train.bin, val.bin
    and manifest.json; returns the manifest. `progress(documents, tokens)` is called after each
    chunk. `max_bytes` stops after about that many characters of text (a quick subset).
    `min_val_tokens` (e.g. seq_len + 1, one evaluation window) is the smallest tail held out when
    no document falls in validation. The manifest is written last, so a directory without one is
    incomplete."""
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
    # ours is replaced, anything else there is kept, and a directory we did not write is refused;
    # the temporary directory names its writer, so one that a killed run left is removed (workdir.py)
    with workdir.tracked_directory(out, TOKENS_KIND, overwrite=True, legacy=_legacy_token_dir(out)) as (tmp, _):
        manifest = _write_tokens(files_, default, sources, tokenizer, tmp, val_fraction, workers, text_field,
                                 column, max_bytes, progress, min_val_tokens)
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
                  max_bytes, progress, min_val_tokens=0) -> dict:
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
    validation = _hold_out_tail(out, counts, dtype, val_fraction, min_val_tokens)
    manifest = {
        "format": "logitlab-tokens", "version": 1,
        "tokenizer_fingerprint": tokenizer.fingerprint(), "tokenizer_file": tok_path.name,
        "vocab_size": int(tokenizer.vocab_size), "eot_id": int(eot), "dtype": dtype.name,
        "val_fraction": val_fraction, **validation,
        "sources": ["<python stdlib>"] if default else [str(s) for s in sources],
        "files": len(files_list), "documents": k,
        "splits": {s: dict(file=SPLIT_FILES[s], **counts[s]) for s in SPLIT_FILES},
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


DOCUMENT_RULE = "document k is validation iff floor((k+1)*f) > floor(k*f)"
TAIL_RULE = "tail of the token stream"


def tail_size(n_tokens: int, val_fraction: float, min_val_tokens: int = 0) -> int:
    """Tokens held out from the end of an `n_tokens` stream: max(1, round(f·N)), raised to
    `min_val_tokens` when the rest keeps at least as many, and at most half of the stream."""
    n = max(1, round(val_fraction * n_tokens), min(min_val_tokens, n_tokens - min_val_tokens))
    return min(n, n_tokens // 2)


def _hold_out_tail(out: Path, counts: dict, dtype: np.dtype, val_fraction: float, min_val_tokens: int) -> dict:
    """The manifest's validation fields; when the document rule held out nothing (f > 0), first
    move the last tail_size tokens of train.bin to val.bin (their documents stay counted in train;
    the tail may begin inside one)."""
    train, val = counts["train"], counts["val"]
    if val["documents"]:
        note = (f"validation: {val['documents']} of {val['documents'] + train['documents']} documents "
                f"({val['tokens']:,} tokens; every document k with floor((k+1)*f) > floor(k*f), f={val_fraction})")
        if val["tokens"] < min_val_tokens:
            note += f"; fewer than one window ({min_val_tokens:,} tokens): no validation loss"
        return {"validation": "documents", "val_rule": DOCUMENT_RULE, "val_note": note}
    if val_fraction == 0:
        return {"validation": "none", "val_rule": "none (val_fraction 0)",
                "val_note": "validation: none (val_fraction 0): no validation loss will be reported"}
    n_val = tail_size(train["tokens"], val_fraction, min_val_tokens)
    if n_val == 0:
        return {"validation": "none", "val_rule": DOCUMENT_RULE,
                "val_note": f"validation: none: {train['tokens']} token(s) are too few to hold any out"}
    keep = (train["tokens"] - n_val) * dtype.itemsize
    path = out / SPLIT_FILES["train"]
    with path.open("r+b") as f, files.writing(path):
        f.seek(keep)
        tail = f.read()
        f.truncate(keep)
    with files.writing(out / SPLIT_FILES["val"]):
        (out / SPLIT_FILES["val"]).write_bytes(tail)
    train["tokens"] -= n_val
    val["tokens"] = n_val
    short = f"; fewer than one window ({min_val_tokens:,} tokens): no validation loss" if n_val < min_val_tokens else ""
    return {"validation": "tail", "val_rule": TAIL_RULE, "val_tail_tokens": n_val,
            "val_note": f"validation: the last {n_val:,} tokens of the token stream (no document fell in the "
                        f"val_fraction={val_fraction} document split){short}"}


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
            isinstance(v, dict) and isinstance(v.get("tokens"), int) and (
                isinstance(v.get("file"), str) or _valid_shards(v.get("shards"), v["tokens"]))
            for v in splits.values())
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: malformed manifest (needs dtype, vocab_size and splits with tokens and a "
                         f"file or a shard list whose tokens add up)")
    return manifest


def _valid_shards(shards, total: int) -> bool:
    """A list of {"file": a plain file name in the directory, "tokens": int} adding up to total."""
    return isinstance(shards, list) and all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and Path(s["file"]).name == s["file"]
        and isinstance(s.get("tokens"), int) for s in shards) and sum(s["tokens"] for s in shards) == total


def _checked_file(data_dir: Path, name: str, tokens: int, dtype: np.dtype) -> Path:
    """data_dir/name, its size checked against the manifest's `tokens`."""
    path = data_dir / name
    expected = int(tokens) * dtype.itemsize
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing ({data_dir / MANIFEST_FILE} lists it)")
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"{path} holds {size:,} bytes, but {data_dir / MANIFEST_FILE} says "
                         f"{int(tokens):,} {dtype.name} tokens = {expected:,} bytes: the file is "
                         f"truncated or was replaced; prepare the data again")
    return path


def load_tokens(data_dir: str | os.PathLike, split: str):
    """The tokens of `split` ("train" or "val"), read-only and not loaded: a memory map of the
    single-file layout (train.bin), or a `ShardedTokens` view over train-NNNNN.bin shards. Each
    file's size is checked against the manifest first."""
    from logitlab.data.shards import ShardedTokens

    manifest = read_manifest(data_dir)
    if split not in manifest["splits"]:
        raise ValueError(f"unknown split {split!r}; have {sorted(manifest['splits'])}")
    info, data_dir = manifest["splits"][split], Path(data_dir)
    dtype = np.dtype(manifest["dtype"])
    if "shards" in info:
        paths = [_checked_file(data_dir, s["file"], s["tokens"], dtype) for s in info["shards"]]
        return ShardedTokens(paths, [s["tokens"] for s in info["shards"]], dtype)
    path = _checked_file(data_dir, info["file"], info["tokens"], dtype)
    if info["tokens"] == 0:
        return np.zeros(0, dtype=dtype)  # an empty split cannot be memory-mapped
    return np.memmap(path, dtype=dtype, mode="r", shape=(info["tokens"],))
