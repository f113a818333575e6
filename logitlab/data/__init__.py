"""Corpora -> token files -> batches: finding and reading documents (corpus.py), cleaning them
(filters.py), deduplicating (dedup.py), mixing sources (mixture.py), tokenizing into train.bin /
val.bin (tokens.py) or, at scale, into worker parts (parts.py) merged into sharded token files
(merge.py, shards.py), the data report (stats.py), and the random and sequential windows that
training and evaluation read (batches.py)."""

from logitlab.data.batches import RandomWindows, eval_windows, windows_to_batch
from logitlab.data.corpus import Document, default_corpus_files, iter_documents, iter_records, resolve_sources
from logitlab.data.tokens import load_tokens, prepare_corpus, read_manifest

__all__ = ["Document", "RandomWindows", "default_corpus_files", "eval_windows", "iter_documents", "iter_records",
           "load_tokens", "prepare_corpus", "read_manifest", "resolve_sources", "windows_to_batch"]
