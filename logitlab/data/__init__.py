"""Corpora -> token files -> batches: finding and reading documents (corpus.py), cleaning them
(filters.py), deduplicating (dedup.py), mixing sources (mixture.py), tokenizing into train.bin /
val.bin (tokens.py) or, at scale, into worker parts (parts.py) merged into sharded token files
(merge.py, shards.py), the data report (stats.py), and the random and sequential windows that
training and evaluation read (batches.py).

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "Document": "corpus",
    "RandomWindows": "batches",
    "default_corpus_files": "corpus",
    "eval_windows": "batches",
    "iter_documents": "corpus",
    "iter_records": "corpus",
    "load_tokens": "tokens",
    "prepare_corpus": "tokens",
    "read_manifest": "tokens",
    "resolve_sources": "corpus",
    "windows_to_batch": "batches",
}

__all__ = ["Document", "RandomWindows", "default_corpus_files", "eval_windows", "iter_documents", "iter_records",
           "load_tokens", "prepare_corpus", "read_manifest", "resolve_sources", "windows_to_batch"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
