"""The byte-level `Tokenizer`'s methods that read and write files (core.py mixes them in): each a
call into formats.py, which owns the file formats (logitlab JSON, GPT-2's vocab.json + merges.txt,
Hugging Face tokenizer.json, tiktoken rank files). `load` and `from_hf` return the tokenizer of
the kind a file holds: byte-level, or SentencePiece-style (sentencepiece.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from logitlab.tokenizer.sentencepiece import SentencePieceTokenizer


class FileMethods:
    """Mixed into core.Tokenizer: its fingerprint and its files."""

    def fingerprint(self) -> str:
        from logitlab.tokenizer.formats import fingerprint

        return fingerprint(self)

    def save(self, path) -> None:
        """logitlab's JSON (bytes as hex, lossless) plus a readable `.vocab` listing beside it."""
        from logitlab.tokenizer.formats import save_logitlab

        save_logitlab(self, path)

    @classmethod
    def load(cls, path) -> Self | SentencePieceTokenizer:
        """A logitlab tokenizer file, as the tokenizer of the kind it holds."""
        from logitlab.tokenizer.formats import load_logitlab, read_logitlab
        from logitlab.tokenizer.sentencepiece import SentencePieceTokenizer

        kind, data = read_logitlab(path)
        return load_logitlab(cls, path, data) if kind == "byte_level" else SentencePieceTokenizer.load(path, data)

    @classmethod
    def from_gpt2_files(cls, vocab_json, merges_txt) -> Self:
        from logitlab.tokenizer.formats import load_gpt2

        return load_gpt2(cls, vocab_json, merges_txt)

    def save_hf(self, path) -> None:
        from logitlab.tokenizer.formats import save_hf

        save_hf(self, path)

    @classmethod
    def from_hf(cls, path) -> Self | SentencePieceTokenizer:
        """A Hugging Face tokenizer.json: byte-level BPE, or SentencePiece-style (sentencepiece.py)."""
        from logitlab.tokenizer.formats import _read_json, is_sentencepiece_json, load_hf
        from logitlab.tokenizer.sentencepiece import SentencePieceTokenizer

        data = _read_json(path, "tokenizer.json")
        return SentencePieceTokenizer.from_hf(path, data) if is_sentencepiece_json(data) else load_hf(cls, path, data)

    def save_tiktoken(self, path) -> None:
        from logitlab.tokenizer.formats import save_tiktoken

        save_tiktoken(self, path)
