"""One worker's share of a large preparation: read, clean, tokenize and hash a slice of the inputs.

parts.py owns the first pass of the scaled-out pipeline. `named_files` lists every input file in
the global order (sources in the order given, each source's files sorted), and `slice_files`
gives worker i of N a contiguous run of them, balanced by bytes: file j goes to worker
floor(N * (bytes before j) / (all bytes)). `prepare_part` then streams its files' documents
(removing boilerplate lines) in chunks of about a megabyte to its worker processes, which drop
the documents that fail the filters and encode and hash the rest (chunks.py), and writes the
results in document order into a part directory that appears whole or not at all:

- `tokens.bin`: every kept document's ids followed by the end-of-text id, in order;
- `docs.bin`: one fixed-size record per kept document (`doc_dtype`): its tokens, UTF-8 bytes,
  source number, exact hash and LSH band keys (dedup.py), the signatures of the two-pass scheme;
- `doc_ids.jsonl`: each kept document's id (file and line or row);
- `filtered.jsonl`: each document the filters removed: its id, source and reason;
- `part.json`: what the part holds, its filter counts and the fingerprints merge checks.

Nothing is deduplicated, split or mixed here: merge.py decides that once over all parts in global
order, which is why one worker and N workers give identical shards. A part whose `part.json`
matches the job (same slice, inputs, options and tokenizer) is kept as it is: rerunning a job
resumes it. An unfinished part is written in a temporary directory that names its writer
(io/workdir.py) and holds a progress record (progress.py): a run of the same job after a kill
continues it from that record, to the same bytes an uninterrupted run writes. The tokenizer is
passed in.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from logitlab.data import dedup as dd
from logitlab.data import filters as flt
from logitlab.data import progress as pg
from logitlab.data.chunks import doc_dtype, map_ordered
from logitlab.data.corpus import default_corpus_files, iter_records, parse_source, resolve_sources, spread_files
from logitlab.io import files, workdir

PART_FORMAT = "logitlab-token-part"
PART_KIND = "token part"
PART_FILE = "part.json"
FILTERED_FILE = "filtered.jsonl"
TOKENIZER_FILE = "tokenizer.logitlab.json"
DEFAULT_SOURCE = "stdlib"
_CHUNK_CHARS = 1 << 20


@dataclass(frozen=True)
class PrepareConfig:
    """What a worker reads and how it cleans and hashes: the reader's field/column, the filters,
    the dedup signatures, and an optional cap on characters read per part."""

    text_field: str = "text"
    column: str = "text"
    filters: flt.FilterConfig = field(default_factory=lambda: flt.FilterConfig(enabled=False))
    dedup: dd.DedupConfig = field(default_factory=dd.DedupConfig)
    max_bytes: int | None = None

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def named_files(sources: Sequence[str | os.PathLike] | None) -> list[tuple[str, Path]]:
    """(source name, file) in the global order; no sources: the standard library as "stdlib"."""
    if not sources:
        return [(DEFAULT_SOURCE, f) for f in default_corpus_files()]
    out, seen = [], set()
    for spec in sources:
        name, path = parse_source(spec)
        for f in resolve_sources([path]):
            if f not in seen:
                seen.add(f)
                out.append((name, f))
    return out


def slice_files(named: list[tuple[str, Path]], shard_index: int, num_shards: int) -> list[tuple[str, Path]]:
    """Worker `shard_index`'s contiguous run of `named`, balanced by bytes (module docstring)."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"--shard-index ({shard_index}) must be in [0, --num-shards ({num_shards}))")
    sizes = [p.stat().st_size for _, p in named]
    total, before, picked = max(sum(sizes), 1), 0, []
    for item, size in zip(named, sizes):
        if num_shards * before // total == shard_index:
            picked.append(item)
        before += size
    return picked


def inputs_fingerprint(named: list[tuple[str, Path]]) -> str:
    """Names, paths and sizes of every input: workers of one job must all see the same list."""
    h = hashlib.sha256()
    for name, path in named:
        h.update(f"{name}\0{path}\0{path.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Reading the slice, from a position on
# --------------------------------------------------------------------------------------------

def _read(picked, cfg: PrepareConfig, skip_undecodable: bool, start) -> Iterator[tuple]:
    """(text, source, doc id, boilerplate lines removed, position after it) of each document from
    `start` on. A position is [file index in `picked`, documents read from that file, characters
    read in all]; reading stops once cfg.max_bytes characters are read."""
    fcfg, (k0, skip, chars) = cfg.filters, start
    for k in range(k0, len(picked)):
        name, path = picked[k]
        read = functools.partial(iter_records, path, name, cfg.text_field, cfg.column, skip_undecodable)
        keys: set = set()
        if fcfg.enabled and fcfg.boilerplate_min_docs:  # a first pass over this file: its repeated lines
            keys = flt.boilerplate_lines((d.text for d in read()), fcfg.boilerplate_min_docs,
                                         fcfg.boilerplate_min_chars)
        n = skip if k == k0 else 0
        for doc in itertools.islice(read(), n, None):
            if cfg.max_bytes is not None and chars >= cfg.max_bytes:
                return
            text, removed = flt.strip_lines(doc.text, keys)
            n, chars = n + 1, chars + len(text)
            yield text, name, doc.doc_id, removed, [k, n, chars]


def _chunks(docs, number: dict) -> Iterator[tuple[list, list, list]]:
    """Chunks of about _CHUNK_CHARS characters: ([(text, source number)], [(source, doc id,
    boilerplate lines)], the position after the last document)."""
    texts, meta, size, position = [], [], 0, None
    for text, name, doc_id, removed, position in docs:
        texts.append((text, number[name]))
        meta.append((name, doc_id, removed))
        size += len(text)
        if size >= _CHUNK_CHARS:
            yield texts, meta, position
            texts, meta, size = [], [], 0
    if texts:
        yield texts, meta, position


# --------------------------------------------------------------------------------------------
# A part directory
# --------------------------------------------------------------------------------------------

def read_part(part_dir: str | os.PathLike) -> dict:
    """A finished part's part.json, with its token and record files' sizes checked against it."""
    path = Path(part_dir) / PART_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{part_dir} is not a finished part (no {PART_FILE}); run its "
                                f"`logitlab prepare --shard-index` again")
    info = files.read_json(path, "part manifest")
    if not isinstance(info, dict) or info.get("format") != PART_FORMAT:
        raise ValueError(f"{path} is not a logitlab part manifest (expected \"format\": \"{PART_FORMAT}\")")
    try:
        expected = {"tokens.bin": info["tokens"] * np.dtype(info["dtype"]).itemsize,
                    "docs.bin": info["documents"] * doc_dtype(info["bands"]).itemsize}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: malformed part manifest ({exc})") from None
    for name, size in expected.items():
        have = (Path(part_dir) / name).stat().st_size if (Path(part_dir) / name).is_file() else None
        if have != size:
            raise ValueError(f"{Path(part_dir) / name} holds {have} bytes, but {path} says {size}: the part is "
                             f"damaged; remove it and run its `logitlab prepare --shard-index` again")
    return info


def _reusable(out: Path, job: dict) -> dict | None:
    try:
        info = read_part(out)
    except (OSError, ValueError):
        return None
    return info if all(info.get(k) == v for k, v in job.items()) else None


def prepare_part(sources, tokenizer, out_dir: str | os.PathLike, cfg: PrepareConfig | None = None, *,
                 shard_index: int = 0, num_shards: int = 1, workers: int | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 notice: Callable[[str], None] | None = None) -> dict:
    """Write worker `shard_index` of `num_shards`'s part of `sources` into `out_dir` (module
    docstring); returns its part.json. An identical finished part there is reused as it is; the
    unfinished work of a killed or interrupted run of the same job is resumed from its last
    progress record (`notice(message)` says so), other leftovers of ours are removed."""
    cfg = cfg or PrepareConfig()
    if getattr(tokenizer, "eot_id", None) is None:
        raise ValueError("the tokenizer has no <|endoftext|> special token; documents need a separator")
    named = named_files(sources)
    if not sources and cfg.max_bytes is not None:  # a quick subset that still spans the stdlib
        named = [(DEFAULT_SOURCE, f) for f in spread_files([f for _, f in named], cfg.max_bytes)]
    job = {"shard_index": shard_index, "num_shards": num_shards, "inputs": inputs_fingerprint(named),
           "config": cfg.fingerprint(), "tokenizer_fingerprint": tokenizer.fingerprint()}
    picked = slice_files(named, shard_index, num_shards)
    out = Path(out_dir)
    done = _reusable(out, job)
    if done is not None:
        return done
    resume = lambda tmp: pg.resumable(tmp, job) is not None  # noqa: E731  (a killed run of this job)
    with workdir.tracked_directory(out, PART_KIND, overwrite=True, resume=resume, keep=pg.has_progress) as (tmp, again):
        state = pg.resumable(tmp, job) if again else None
        if state is not None and notice is not None:
            k, n, _ = state["position"]
            notice(f"resuming {out} from its last progress record: {state['documents']:,} documents and "
                   f"{state['tokens']:,} tokens kept, {n:,} documents into file {k + 1} of {len(picked)}")
        info = _write_part(tmp, named, picked, tokenizer, cfg, workers, progress, not sources, state or pg.start(job))
        info.update(job)
        pg.discard(tmp)
        (tmp / PART_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _write_part(tmp: Path, named, picked, tokenizer, cfg: PrepareConfig, workers, progress, default: bool,
                state: dict) -> dict:
    from logitlab.data.tokens import token_dtype

    names = list(dict.fromkeys(n for n, _ in named))
    number = {n: i for i, n in enumerate(names)}
    dtype = token_dtype(tokenizer.vocab_size)
    tokenizer.save(tmp / TOKENIZER_FILE)
    for name, _ in picked:  # every source of the slice is reported, in order, documents or not
        state["filters"].setdefault(name, flt.FilterStats().to_dict())
    workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    chunks = _chunks(_read(picked, cfg, default, state["position"]), number)
    queue: collections.deque = collections.deque()

    def texts():
        for texts_, meta, position in chunks:
            queue.append((meta, position))
            yield texts_

    with pg.PartFiles(tmp, state) as out:
        if progress is not None and state["documents"]:
            progress(state["documents"], state["tokens"])
        for result in map_ordered(texts(), (tokenizer, cfg, names, dtype.str, tokenizer.eot_id), workers):
            out.write(*queue.popleft(), *result)
            if progress is not None:
                progress(state["documents"], state["tokens"])
    return {"format": PART_FORMAT, "version": 1, "vocab_size": int(tokenizer.vocab_size),
            "eot_id": int(tokenizer.eot_id), "dtype": dtype.name, "tokenizer_file": TOKENIZER_FILE,
            "sources": names, "files": len(picked), "documents": state["documents"], "tokens": state["tokens"],
            "bytes": state["bytes"], "bands": cfg.dedup.bands if cfg.dedup.near else 0, "dedup": asdict(cfg.dedup),
            "filters": {n: dict(st, removed=dict(sorted(st["removed"].items()))) for n, st in state["filters"].items()}}
