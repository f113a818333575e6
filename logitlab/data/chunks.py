"""The work on one chunk of documents, in a worker process of `prepare`: filter, encode, hash.

chunks.py owns what each worker does with a chunk of about a megabyte of text, a list of
(text, source number): the cleaning filters (filters.document_reason, whose fast measurements
equal the plain ones), the tokenizer's encoding with the end-of-text id appended, and the
document's record for docs.bin (`doc_dtype`: tokens, UTF-8 bytes, source, exact hash, LSH band
keys). `map_ordered` runs `work` over chunks in `workers` processes (inline for one) and yields
the results in input order; each worker does a whole chunk alone, and only reading the input and
writing the results stay in the parent. parts.py reads the documents and writes the results.
The tokenizer and the options are passed in; nothing is global but the worker's own copy of them.
"""

from __future__ import annotations

import os

import numpy as np

from logitlab.data import dedup as dd
from logitlab.data import filters as flt


def doc_dtype(bands: int) -> np.dtype:
    """The record of one document in docs.bin (bands = 0 when near-dedup is off)."""
    return np.dtype([("tokens", "<i8"), ("bytes", "<i8"), ("source", "<i4"), ("exact", "<u8"),
                     ("bands", "<u8", (bands,))])


_worker: dict = {}


def init(tokenizer, cfg, names: list[str], dtype: str, eot: int) -> None:
    """A worker's copy of the tokenizer, the PrepareConfig, the source names, the token dtype and
    the end-of-text id (inherited under fork, pickled under spawn)."""
    _worker.update(tok=tokenizer, cfg=cfg, names=names, dtype=dtype, eot=eot)


def encode(text: str) -> list[int]:
    tok = _worker["tok"]  # corpus text is untrusted: special-token strings are plain text
    return tok.encode_ordinary(text) if hasattr(tok, "encode_ordinary") else tok.encode(text, allowed_special="none")


def encode_with_eot(text: str) -> np.ndarray:
    """The document's ids and the end-of-text id, in the part's token dtype: straight from the
    encoder's array where it has one (no Python int per id), else from its list."""
    tok, eot, dtype = _worker["tok"], _worker["eot"], _worker["dtype"]
    ids = tok.encode_ordinary_array(text) if hasattr(tok, "encode_ordinary_array") else encode(text)
    out = np.empty(len(ids) + 1, dtype=dtype)
    out[:-1] = ids
    out[-1] = eot
    return out


def work(chunk: list[tuple[str, int]]) -> tuple[list[str | None], list[np.ndarray], np.ndarray]:
    """A chunk of (text, source number) -> (the filters' reason per document, None when kept;
    the kept documents' token arrays, each ending in the end-of-text id; their docs.bin records)."""
    cfg, names = _worker["cfg"], _worker["names"]
    reasons = [flt.document_reason(text, names[source], cfg.filters) for text, source in chunk]
    kept = [item for item, reason in zip(chunk, reasons) if reason is None]
    d = cfg.dedup
    ids_out = [encode_with_eot(text) for text, _ in kept]
    records = np.zeros(len(kept), dtype=doc_dtype(d.bands if d.near else 0))
    records["tokens"] = [len(ids) for ids in ids_out]
    records["bytes"] = [len(text.encode("utf-8")) for text, _ in kept]
    records["source"] = [source for _, source in kept]
    if d.exact:
        records["exact"] = [dd.exact_hash(text) for text, _ in kept]
    if d.near:
        for i, (text, _) in enumerate(kept):
            records["bands"][i] = dd.band_keys(dd.signature(text, d), d.bands, d.rows)
    return reasons, ids_out, records


def map_ordered(chunks, init_args: tuple, workers: int):
    """`work` over chunks, results in order; at most 2 * workers chunks in flight."""
    if workers == 1:
        init(*init_args)
        yield from map(work, chunks)
        return
    import collections
    import multiprocessing as mp

    init(*init_args)
    encode("")  # the encoder's one-time checks happen here once, and forked workers inherit them
    ctx = mp.get_context("spawn" if os.name == "nt" else "fork")
    with ctx.Pool(workers, initializer=init, initargs=init_args) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(work, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
