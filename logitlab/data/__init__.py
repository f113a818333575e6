"""Corpora -> token files -> batches: finding documents (corpus.py), tokenizing them into
train.bin / val.bin with a manifest (tokens.py), and the random and sequential windows that
training and evaluation read (batches.py)."""

from logitlab.data.batches import RandomWindows, eval_windows, windows_to_batch
from logitlab.data.corpus import default_corpus_files, iter_documents, resolve_sources
from logitlab.data.tokens import load_tokens, prepare_corpus, read_manifest

__all__ = ["RandomWindows", "default_corpus_files", "eval_windows", "iter_documents", "load_tokens",
           "prepare_corpus", "read_manifest", "resolve_sources", "windows_to_batch"]
