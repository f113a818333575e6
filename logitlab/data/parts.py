"""One worker's share of a large preparation: read, clean, tokenize and hash a slice of the inputs.

parts.py owns the first pass of the scaled-out pipeline. `named_files` lists every input file in
the global order (sources in the order given, each source's files sorted), and `slice_files`
gives worker i of N a contiguous run of them, balanced by bytes: file j goes to worker
floor(N * (bytes before j) / (all bytes)). `prepare_part` then streams its files' documents,
removes boilerplate lines and documents that fail the filters (filters.py), and writes, into a
part directory that appears whole or not at all:

- `tokens.bin`: every kept document's ids followed by the end-of-text id, in order;
- `docs.bin`: one fixed-size record per kept document (`doc_dtype`): its tokens, UTF-8 bytes,
  source number, exact hash and LSH band keys (dedup.py), the signatures of the two-pass scheme;
- `doc_ids.jsonl`: each kept document's id (file and line or row);
- `filtered.jsonl`: each document the filters removed: its id, source and reason;
- `part.json`: what the part holds, its filter counts and the fingerprints merge checks.

Nothing is deduplicated, split or mixed here: merge.py decides that once over all parts in global
order, which is why one worker and N workers give identical shards. A part whose `part.json`
matches the job (same slice, inputs, options and tokenizer) is kept as it is: rerunning a job
resumes it. The tokenizer is passed in.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from logitlab.data import dedup as dd
from logitlab.data import filters as flt
from logitlab.data.corpus import default_corpus_files, iter_records, parse_source, resolve_sources, spread_files
from logitlab.io import files

PART_FORMAT = "logitlab-token-part"
PART_KIND = "token part"
PART_FILE = "part.json"
FILTERED_FILE = "filtered.jsonl"
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


def doc_dtype(bands: int) -> np.dtype:
    """The record of one document in docs.bin (bands = 0 when near-dedup is off)."""
    return np.dtype([("tokens", "<i8"), ("bytes", "<i8"), ("source", "<i4"), ("exact", "<u8"),
                     ("bands", "<u8", (bands,))])


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


def _documents(picked, cfg: PrepareConfig, stats: dict[str, flt.FilterStats], skip_undecodable: bool,
               rejects=None) -> Iterator[tuple[str, str, str]]:
    """(text, source, doc id) of every document that survives boilerplate removal and filters;
    each removed one is written to `rejects` (a text file) as {"id", "source", "reason"}."""
    fcfg, chars = cfg.filters, 0
    for name, path in picked:
        read = functools.partial(iter_records, path, name, cfg.text_field, cfg.column, skip_undecodable)
        keys: set = set()
        if fcfg.enabled and fcfg.boilerplate_min_docs:  # a first pass over this file: its repeated lines
            keys = flt.boilerplate_lines((d.text for d in read()), fcfg.boilerplate_min_docs,
                                         fcfg.boilerplate_min_chars)
        st = stats.setdefault(name, flt.FilterStats())
        for doc in read():
            if cfg.max_bytes is not None and chars >= cfg.max_bytes:
                return
            text, n_lines = flt.strip_lines(doc.text, keys)
            st.boilerplate_lines += n_lines
            reason = flt.document_reason(text, name, fcfg)
            st.count(reason)
            if reason is not None and rejects is not None:
                rejects.write(json.dumps({"id": doc.doc_id, "source": name, "reason": reason}) + "\n")
            if reason is None:
                chars += len(text)
                yield text, name, doc.doc_id


# --------------------------------------------------------------------------------------------
# The work of one chunk (in a worker process)
# --------------------------------------------------------------------------------------------

_worker: dict = {}


def _init(tokenizer, cfg: PrepareConfig, dtype: str, eot: int) -> None:
    _worker.update(tok=tokenizer, cfg=cfg, dtype=dtype, eot=eot)


def _encode(text: str) -> list[int]:
    tok = _worker["tok"]  # corpus text is untrusted: special-token strings are plain text
    return tok.encode_ordinary(text) if hasattr(tok, "encode_ordinary") else tok.encode(text, allowed_special="none")


def _work(chunk: list[tuple[str, int]]) -> tuple[list[np.ndarray], np.ndarray]:
    """Token arrays and docs.bin records of a chunk of (text, source number)."""
    cfg: PrepareConfig = _worker["cfg"]
    d = cfg.dedup
    records = np.zeros(len(chunk), dtype=doc_dtype(d.bands if d.near else 0))
    ids_out = []
    for i, (text, source) in enumerate(chunk):
        ids = _encode(text)
        ids.append(_worker["eot"])
        ids_out.append(np.asarray(ids, dtype=_worker["dtype"]))
        rec = records[i]
        rec["tokens"], rec["bytes"], rec["source"] = len(ids), len(text.encode("utf-8")), source
        rec["exact"] = dd.exact_hash(text) if d.exact else 0
        if d.near:
            rec["bands"] = dd.band_keys(dd.signature(text, d), d.bands, d.rows)
    return ids_out, records


def _map_ordered(chunks, init_args: tuple, workers: int):
    """_work over chunks, results in order; at most 2 * workers chunks in flight."""
    if workers == 1:
        _init(*init_args)
        yield from map(_work, chunks)
        return
    import collections
    import multiprocessing as mp

    ctx = mp.get_context("spawn" if os.name == "nt" else "fork")
    with ctx.Pool(workers, initializer=_init, initargs=init_args) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_work, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


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
                 progress: Callable[[int, int], None] | None = None) -> dict:
    """Write worker `shard_index` of `num_shards`'s part of `sources` into `out_dir` (module
    docstring); returns its part.json. An identical finished part there is reused as it is."""
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
    with files.atomic_directory(out, PART_KIND, overwrite=True) as tmp:
        info = _write_part(tmp, named, picked, tokenizer, cfg, workers, progress, default=not sources)
        info.update(job)
        (tmp / PART_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _write_part(tmp: Path, named, picked, tokenizer, cfg: PrepareConfig, workers, progress, default: bool) -> dict:
    from logitlab.data.tokens import token_dtype

    names = list(dict.fromkeys(n for n, _ in named))
    number = {n: i for i, n in enumerate(names)}
    dtype = token_dtype(tokenizer.vocab_size)
    tokenizer.save(tmp / "tokenizer.logitlab.json")
    stats: dict[str, flt.FilterStats] = {}
    workers = max(1, workers if workers is not None else min(4, os.cpu_count() or 1))
    n_docs = n_tokens = n_bytes = 0
    paths = [tmp / "tokens.bin", tmp / "docs.bin", tmp / "doc_ids.jsonl", tmp / FILTERED_FILE]
    with paths[0].open("wb") as tf, paths[1].open("wb") as df, paths[2].open("w", encoding="utf-8") as idf, \
            paths[3].open("w", encoding="utf-8") as rf:
        docs = _documents(picked, cfg, stats, default, rf)
        for ids_list, records, doc_ids in _chunked_results(docs, number, (tokenizer, cfg, dtype.str,
                                                                          tokenizer.eot_id), workers):
            with files.writing(paths[0]):
                for ids in ids_list:
                    tf.write(ids.tobytes())
                df.write(records.tobytes())
                idf.writelines(json.dumps(d) + "\n" for d in doc_ids)
            n_docs += len(records)
            n_tokens += int(records["tokens"].sum())
            n_bytes += int(records["bytes"].sum())
            if progress is not None:
                progress(n_docs, n_tokens)
    return {"format": PART_FORMAT, "version": 1, "vocab_size": int(tokenizer.vocab_size),
            "eot_id": int(tokenizer.eot_id), "dtype": dtype.name, "tokenizer_file": "tokenizer.logitlab.json",
            "sources": names, "files": len(picked), "documents": n_docs, "tokens": n_tokens, "bytes": n_bytes,
            "bands": cfg.dedup.bands if cfg.dedup.near else 0, "dedup": asdict(cfg.dedup),
            "filters": {n: s.to_dict() for n, s in stats.items()}}


def _chunked_results(docs, number: dict, init_args: tuple, workers: int):
    """(token arrays, records, doc ids) per chunk of about 1 MB of text, in document order."""
    def chunks():
        chunk, ids, size = [], [], 0
        for text, name, doc_id in docs:
            chunk.append((text, number[name]))
            ids.append(doc_id)
            size += len(text)
            if size >= _CHUNK_CHARS:
                yield chunk, ids
                chunk, ids, size = [], [], 0
        if chunk:
            yield chunk, ids

    id_queue: list = []

    def texts():
        for chunk, ids in chunks():
            id_queue.append(ids)
            yield chunk

    for ids_list, records in _map_ordered(texts(), init_args, workers):
        yield ids_list, records, id_queue.pop(0)
