"""The steps around SentencePiece-style BPE, as Hugging Face `tokenizer.json` files state them.

A file of this kind (Llama-2, Mistral, TinyLlama, Gemma) describes, besides its vocabulary and
merges (sp_bpe.py), what happens to a text before BPE and to the pieces after it:

* normalizer: `Prepend("▁")` puts a "▁" before every piece of text (the "leading space" of
  SentencePiece's dummy prefix), `Replace(" ", "▁")` makes every space a "▁". Llama-2's files
  have both; Gemma's only the Replace.
* pre-tokenizer: newer files do the same with `Metaspace(replacement="▁", prepend_scheme=...,
  split=False)`: spaces become "▁", and a "▁" is prepended unless the piece already starts with
  one ("always"), only to the piece at the very start of the text ("first", so text after a
  special token gets none), or never. With split=True the piece is also cut before each "▁".
* decoder, run on the list of token strings: `Replace("▁", " ")`, `ByteFallback` (each run of
  byte tokens such as <0xE2><0x82><0xAC> becomes the text of those bytes, or one U+FFFD per
  byte when they are not valid UTF-8), `Fuse` (join into one string), `Strip(" ", 1, 0)` (drop
  one leading space: the prepended "▁" of the first word). A `Metaspace` decoder does the
  Replace and drops the "▁"s of the first token.

Each step is a small frozen dataclass with the method its position calls (normalize,
pre_tokenize, decode_chain), each a few lines that follow `tokenizers`' Rust code exactly.
`SentencePieceConfig` holds one file's choice of steps and its BPE flags; reading and writing the
JSON objects of the steps is here too (`*_from_json`, `config_to_json`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal, Union

from logitlab.tokenizer.sp_bpe import SPACE, byte_of_piece


def _text(value, field: str, owner: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ValueError(f"{owner}: field {field!r} must be a {'' if empty else 'non-empty '}string, got {value!r}")
    return value


@dataclass(frozen=True)
class Prepend:
    """Normalizer: `prefix` before every non-empty piece of text."""
    prefix: str

    def __post_init__(self):
        _text(self.prefix, "prefix", "Prepend")

    def normalize(self, text: str) -> str:
        return self.prefix + text if text else text


@dataclass(frozen=True)
class Replace:
    """Normalizer or decoder step: every `old` becomes `new` (in each token, when decoding)."""
    old: str
    new: str

    def __post_init__(self):
        _text(self.old, "old", "Replace")
        _text(self.new, "new", "Replace", empty=True)

    def normalize(self, text: str) -> str:
        return text.replace(self.old, self.new)

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return [t.replace(self.old, self.new) for t in tokens]


@dataclass(frozen=True)
class Metaspace:
    """Pre-tokenizer (spaces -> replacement, one prepended by `prepend_scheme`, cut before each
    replacement when `split`) or decoder (replacement -> space; in the first token, unless the
    scheme is "never", every replacement is dropped)."""
    replacement: str = SPACE
    prepend_scheme: Literal["always", "first", "never"] = "always"
    split: bool = True

    def __post_init__(self):
        if not isinstance(self.replacement, str) or len(self.replacement) != 1:
            raise ValueError(f"Metaspace: replacement must be one character, got {self.replacement!r}")
        if self.prepend_scheme not in ("always", "first", "never"):
            raise ValueError(f"Metaspace: prepend_scheme must be always, first or never, got {self.prepend_scheme!r}")
        if not isinstance(self.split, bool):
            raise ValueError(f"Metaspace: split must be true or false, got {self.split!r}")

    def pre_tokenize(self, text: str, at_start: bool) -> list[str]:
        """at_start: the piece begins the original text (what "first" asks)."""
        r = self.replacement
        text = text.replace(" ", r)
        wanted = self.prepend_scheme == "always" or (self.prepend_scheme == "first" and at_start)
        if wanted and not text.startswith(r):
            text = r + text
        if not self.split:
            return [text]
        return [p for p in re.split(f"(?={re.escape(r)})", text) if p]  # each replacement opens a piece

    def decode_chain(self, tokens: list[str]) -> list[str]:
        r, drop_first = self.replacement, self.prepend_scheme != "never"
        return [t.replace(r, "") if n == 0 and drop_first else t.replace(r, " ") for n, t in enumerate(tokens)]


@dataclass(frozen=True)
class SplitAfter:
    """Pre-tokenizer: the piece cut after each `delimiter` (Split(String, MergedWithPrevious))."""
    delimiter: str

    def __post_init__(self):
        _text(self.delimiter, "delimiter", "SplitAfter")

    def pre_tokenize(self, text: str, at_start: bool) -> list[str]:
        return [p for p in re.split(f"(?<={re.escape(self.delimiter)})", text) if p]


@dataclass(frozen=True)
class ByteFallback:
    """Decoder: each run of byte tokens (<0xNN>) -> the text of those bytes, or one U+FFFD per
    byte token when the run is not valid UTF-8 (so one bad byte spoils its whole run)."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out, run = [], []
        for t in tokens:
            b = byte_of_piece(t)
            if b is not None:
                run.append(b)
                continue
            if run:
                out.append(bytes_text(run))
                run = []
            out.append(t)
        if run:
            out.append(bytes_text(run))
        return out


def bytes_text(run: list[int]) -> str:
    """A run of byte tokens' text: the bytes as UTF-8, or one U+FFFD per byte if they are not."""
    try:
        return bytes(run).decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


@dataclass(frozen=True)
class Fuse:
    """Decoder: all tokens joined into one."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return ["".join(tokens)]


@dataclass(frozen=True)
class Strip:
    """Decoder: up to `start` leading and `stop` trailing `content` characters cut from each token."""
    content: str = " "
    start: int = 0
    stop: int = 0

    def __post_init__(self):
        if not isinstance(self.content, str) or len(self.content) != 1:
            raise ValueError(f"Strip: content must be one character, got {self.content!r}")
        for name in ("start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Strip: {name} must be a non-negative integer, got {value!r}")

    def decode_chain(self, tokens: list[str]) -> list[str]:
        out = []
        for t in tokens:
            a = 0
            while a < min(self.start, len(t)) and t[a] == self.content:
                a += 1
            b = len(t)
            while len(t) - b < self.stop and b > a and t[b - 1] == self.content:
                b -= 1
            out.append(t[a:b])
        return out


Normalizer = Union[Prepend, Replace]
PreTokenizer = Union[Metaspace, SplitAfter]
DecoderStep = Union[Replace, ByteFallback, Fuse, Strip, Metaspace]
LLAMA_DECODER = (Replace(SPACE, " "), ByteFallback(), Fuse(), Strip(" ", 1, 0))


@dataclass(frozen=True)
class SentencePieceConfig:
    """How one file turns text into pieces and pieces back into text (the module docstring).

    normalizer: steps run on each piece of text between added tokens, in order.
    pre_tokenizer: then cuts it into words (None: the piece is one word).
    byte_fallback: characters outside the vocabulary become their bytes' <0xNN> tokens.
    unk_token: what they become otherwise (None: they are dropped); fuse_unk: a run becomes one.
    ignore_merges: a word that is itself in the vocabulary is taken whole.
    decoder: steps run on the list of token strings when decoding.
    bos_token: the token the post-processor puts before a text (None: it adds nothing)."""
    normalizer: tuple[Normalizer, ...] = ()
    pre_tokenizer: PreTokenizer | None = Metaspace(SPACE, "first", False)
    byte_fallback: bool = True
    unk_token: str | None = "<unk>"
    fuse_unk: bool = True
    ignore_merges: bool = False
    decoder: tuple[DecoderStep, ...] = LLAMA_DECODER
    bos_token: str | None = "<s>"

    def __post_init__(self):
        object.__setattr__(self, "normalizer", tuple(self.normalizer))
        object.__setattr__(self, "decoder", tuple(self.decoder))
        for step in self.normalizer:
            if not isinstance(step, (Prepend, Replace)):
                raise ValueError(f"normalizer steps must be Prepend or Replace, got {step!r}")
        if self.pre_tokenizer is not None and not isinstance(self.pre_tokenizer, (Metaspace, SplitAfter)):
            raise ValueError(f"pre_tokenizer must be Metaspace, SplitAfter or None, got {self.pre_tokenizer!r}")
        if not self.decoder:
            raise ValueError("decoder must have at least one step (Hugging Face joins tokens with spaces without one)")
        for step in self.decoder:
            if not isinstance(step, (Replace, ByteFallback, Fuse, Strip, Metaspace)):
                raise ValueError(f"decoder steps must be Replace, ByteFallback, Fuse, Strip or Metaspace, got {step!r}")
        for name in ("byte_fallback", "fuse_unk", "ignore_merges"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("unk_token", "bos_token"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")

    def normalize(self, text: str) -> str:
        for step in self.normalizer:
            text = step.normalize(text)
        return text

    def pre_tokenize(self, text: str, at_start: bool) -> list[str]:
        return [text] if self.pre_tokenizer is None else self.pre_tokenizer.pre_tokenize(text, at_start)

    def decode(self, tokens: list[str]) -> str:
        """Token strings -> text: each decoder step on the list, then the pieces joined."""
        for step in self.decoder:
            tokens = step.decode_chain(tokens)
        return "".join(tokens)

    @property
    def has_byte_fallback_decoder(self) -> bool:
        return any(isinstance(s, ByteFallback) for s in self.decoder)


@dataclass(frozen=True)
class AddedToken:
    """A token matched in the raw text before anything else (Hugging Face's added_tokens).
    special: a control token (<s>, </s>), matched only where special tokens are allowed.
    normalized: matched in the normalized text, as the normalizer spells it, instead."""
    content: str
    id: int
    special: bool = True
    normalized: bool = False

    def __post_init__(self):
        if not isinstance(self.content, str) or not self.content:
            raise ValueError(f"added token {self.id!r}: content must be a non-empty string, got {self.content!r}")
        if isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 0:
            raise ValueError(f"added token {self.content!r}: id must be a non-negative integer, got {self.id!r}")


# ------------------------------------------------------------------------------ JSON
def _steps(obj, key: str, where: str) -> list:
    """A component that may be a Sequence: its list of steps ([] for null)."""
    if obj is None:
        return []
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: {key} must be an object or null, got {json.dumps(obj)[:80]}")
    if obj.get("type") == "Sequence":
        inner = obj.get({"normalizer": "normalizers", "pre_tokenizer": "pretokenizers"}.get(key, "decoders"))
        if not isinstance(inner, list):
            raise ValueError(f"{where}: {key} Sequence without its list of steps")
        return inner
    return [obj]


def _string_pattern(step: dict, where: str, key: str) -> str:
    pattern = step.get("pattern")
    if not isinstance(pattern, dict) or set(pattern) != {"String"} or not isinstance(pattern["String"], str):
        raise ValueError(f"{where}: unsupported {key} {json.dumps(step)[:160]} (only a String pattern is supported)")
    return pattern["String"]


def _metaspace(step: dict) -> Metaspace:
    scheme = step.get("prepend_scheme", "always")
    if step.get("add_prefix_space") is False:  # files older than prepend_scheme
        scheme = "never"
    return Metaspace(step.get("replacement", SPACE), scheme, step.get("split", True))


def normalizer_from_json(obj, where: str) -> tuple[Normalizer, ...]:
    out = []
    for step in _steps(obj, "normalizer", where):
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "Prepend":
            out.append(Prepend(step.get("prepend")))
        elif kind == "Replace":
            out.append(Replace(_string_pattern(step, where, "normalizer"), step.get("content")))
        else:
            raise ValueError(f"{where}: unsupported normalizer {json.dumps(step)[:160]} (SentencePiece-style "
                             f"files use Prepend and Replace)")
    return tuple(out)


def pre_tokenizer_from_json(obj, where: str) -> PreTokenizer | None:
    steps = _steps(obj, "pre_tokenizer", where)
    if not steps:
        return None
    step = steps[0]
    if len(steps) == 1 and isinstance(step, dict) and step.get("type") == "Metaspace":
        return _metaspace(step)
    if (len(steps) == 1 and isinstance(step, dict) and step.get("type") == "Split"
            and step.get("behavior") == "MergedWithPrevious" and not step.get("invert")):
        return SplitAfter(_string_pattern(step, where, "pre_tokenizer"))
    raise ValueError(f"{where}: unsupported pre_tokenizer {json.dumps(obj)[:200]} (expected Metaspace, "
                     f"Split(String, MergedWithPrevious) or null for a SentencePiece-style file, or ByteLevel)")


def decoder_from_json(obj, where: str) -> tuple[DecoderStep, ...]:
    out = []
    for step in _steps(obj, "decoder", where):
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "Replace":
            out.append(Replace(_string_pattern(step, where, "decoder"), step.get("content")))
        elif kind in ("ByteFallback", "Fuse"):
            out.append(ByteFallback() if kind == "ByteFallback" else Fuse())
        elif kind == "Strip":
            out.append(Strip(step.get("content"), step.get("start"), step.get("stop")))
        elif kind == "Metaspace":
            out.append(_metaspace(step))
        else:
            raise ValueError(f"{where}: unsupported decoder {json.dumps(step)[:160]}")
    if not out:
        raise ValueError(f"{where}: decoder is null; a SentencePiece-style file needs one (e.g. Replace, "
                         f"ByteFallback, Fuse, Strip)")
    return tuple(out)


def _step_json(step) -> dict:
    if isinstance(step, Prepend):
        return {"type": "Prepend", "prepend": step.prefix}
    if isinstance(step, Replace):
        return {"type": "Replace", "pattern": {"String": step.old}, "content": step.new}
    if isinstance(step, Metaspace):
        return {"type": "Metaspace", "replacement": step.replacement, "prepend_scheme": step.prepend_scheme,
                "split": step.split}
    if isinstance(step, SplitAfter):
        return {"type": "Split", "pattern": {"String": step.delimiter}, "behavior": "MergedWithPrevious",
                "invert": False}
    if isinstance(step, Strip):
        return {"type": "Strip", "content": step.content, "start": step.start, "stop": step.stop}
    return {"type": type(step).__name__}  # ByteFallback, Fuse


def _sequence(steps, key: str):
    if not steps:
        return None
    if len(steps) == 1:
        return _step_json(steps[0])
    return {"type": "Sequence", key: [_step_json(s) for s in steps]}


def config_to_json(config: SentencePieceConfig) -> dict:
    """The normalizer, pre_tokenizer and decoder objects of a tokenizer.json."""
    return {"normalizer": _sequence(config.normalizer, "normalizers"),
            "pre_tokenizer": None if config.pre_tokenizer is None else _step_json(config.pre_tokenizer),
            "decoder": _sequence(config.decoder, "decoders")}
