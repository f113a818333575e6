"""The data report: what a person checks about a token directory before spending compute.

stats.py owns `data_stats`, which reads a token directory (either layout) and returns plain
values for the CLI to print and plot: documents and tokens per source, the document-length
histogram, what each filter removed, the duplicate rate, bytes per token (sharded directories
record them at merge), and the most frequent tokens and token n-grams of (up to `max_tokens` of)
the training split, counted in chunks so the split is never loaded whole. It imports nothing from
logitlab but its siblings.
"""

from __future__ import annotations

import collections
import os

import numpy as np

from logitlab.data.tokens import load_tokens, read_manifest

_CHUNK = 1 << 20


def token_counts(tokens, vocab_size: int, max_tokens: int | None = None) -> np.ndarray:
    """(V,) int64 occurrences of each id in the first `max_tokens` tokens, read in chunks."""
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, n, _CHUNK):
        counts += np.bincount(np.asarray(tokens[start:min(n, start + _CHUNK)]), minlength=vocab_size)[:vocab_size]
    return counts


def top_ngrams(tokens, n: int, k: int, max_tokens: int, exclude: int | None = None) -> list[tuple[tuple, int]]:
    """The k most frequent token n-grams among the first `max_tokens` tokens (n-grams that hold
    `exclude`, the end-of-text id, span two documents and are skipped); ties broken by the ids."""
    ids = np.asarray(tokens[:min(len(tokens), max_tokens)], dtype=np.int64)
    if ids.size < n:
        return []
    grams = np.lib.stride_tricks.sliding_window_view(ids, n)  # (N - n + 1, n)
    if exclude is not None:
        grams = grams[~(grams == exclude).any(axis=1)]
    counter = collections.Counter(map(tuple, grams.tolist()))
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def document_lengths(tokens, eot: int, max_tokens: int) -> np.ndarray:
    """Lengths (end-of-text id included) of the documents that end within the first `max_tokens`."""
    ends, n = [], min(len(tokens), max_tokens)
    for start in range(0, n, _CHUNK):
        ends.append(np.flatnonzero(np.asarray(tokens[start:min(n, start + _CHUNK)]) == eot) + start)
    ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    return np.diff(np.concatenate([[-1], ends]))


def data_stats(data_dir: str | os.PathLike, top: int = 20, max_tokens: int = 2_000_000) -> dict:
    """The report of `data_dir` (module docstring) as plain values."""
    manifest = read_manifest(data_dir)
    train = load_tokens(data_dir, "train")
    counts = token_counts(train, manifest["vocab_size"], max_tokens)
    order = np.argsort(-counts, kind="stable")[:top]
    counted = int(counts.sum())
    eot = manifest.get("eot_id")
    per_source = manifest.get("per_source") or {  # the single-file layout counts all sources together
        ", ".join(map(str, manifest.get("sources", []))) or "all": {
            "documents": manifest.get("documents", 0), "train_tokens": manifest["splits"]["train"]["tokens"],
            "tokens": sum(s["tokens"] for s in manifest["splits"].values())}}
    histogram = manifest.get("doc_length_histogram")
    if histogram is None and eot is not None:  # the single-file layout: from the end-of-text ids read
        from logitlab.data.merge import length_histogram

        histogram = length_histogram(document_lengths(train, eot, max_tokens))
    dedup = manifest.get("dedup")
    return {
        "layout": manifest.get("layout", "single file"),
        "splits": {s: {"tokens": v["tokens"], "documents": v.get("documents", 0),
                       "files": len(v["shards"]) if "shards" in v else 1} for s, v in manifest["splits"].items()},
        "per_source": per_source,
        "doc_length_histogram": histogram,
        "filters": manifest.get("filters"),
        "duplicate_rate": None if dedup is None else dedup["duplicate_rate"],
        "dedup": dedup,
        "mixture": manifest.get("mixture"),
        "bytes_per_token": manifest.get("bytes_per_token"),
        "top_tokens": [(int(i), int(counts[i]), float(counts[i] / max(counted, 1))) for i in order if counts[i]],
        "top_bigrams": top_ngrams(train, 2, top, max_tokens, eot),
        "top_trigrams": top_ngrams(train, 3, top, max_tokens, eot),
        "tokens_counted": counted,
        "tokenizer_file": manifest.get("tokenizer_file"),
    }
