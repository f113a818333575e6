"""Text <-> token ids: the byte-level BPE `Tokenizer`.

This module owns encoding and decoding. Split patterns and safe cut points live in patterns.py
(re-exported here); the reference encoder in reference.py; learning merges in bpe.py; file formats
in formats.py. SentencePiece-style BPE (Llama-2, Gemma) is sentencepiece.py's, with this interface.

Id layout. A tokenizer we train puts the 256 byte values at ids 0..255 (id == byte value), one
id per merge after them in learned order (256, 257, ...), and the special tokens last: GPT-2's
layout (its <|endoftext|> is 50256), so ids are also tiktoken ranks. Loaded vocabularies keep
the ids their files give (GPT-2's byte tokens, for example, are not in byte order).

Encoding. Text is cut at special tokens (leftmost; at one position the longest wins), each piece
split by the pre-tokenization regex, and each pre-token's UTF-8 bytes merged by BPE. The split
pattern's whole matches (capture groups ignored) are the pieces and must cover the text: a
custom pattern that drops characters is refused when the Tokenizer is built, and text it would
still drop raises ValueError naming it (patterns.py). Two encoders give the same ids:

* the reference path (`encode(..., fast=False)`): replays merges, lowest rank first, exactly as
  training learned them (reference.py: `bpe`, O(n log n), beside `bpe_plain`, the same rule
  written the obvious O(n^2) way), with a cache of already-encoded pre-tokens;
* the fast path (default): tiktoken's Rust core built from the same ranks. tiktoken merges the
  adjacent pair whose *concatenation* has the lowest rank, which equals replaying merges only
  when the vocabulary is consistent: merge results are distinct byte strings whose ids grow with
  merge order, and every token's own bytes encode to that single token. `Tokenizer` checks these
  conditions on first use (`fast_path_ok`) and uses the reference path when they fail. They are
  a static check; tests compare both paths on GPT-2 and trained vocabularies (property-based
  text, tinyshakespeare, 10 MB of stdlib source with a 32k vocabulary).

Special tokens: `encode(text)` turns every special-token string into its id (the default
`allowed_special="all"`); `encode_ordinary(text)` (untrusted text) keeps them ordinary text.
`encode(text, add_bos=True)` puts the BOS token first when the tokenizer has one (`bos_token`,
from a tokenizer.json's post-processor, such as Llama 3's <|begin_of_text|>). A vocabulary that
lacks some byte tokens (SmolLM2's) drops those bytes from the text, as `tokenizers` does
(byte_vocab.py); a text holding one takes the reference path.
"""

from __future__ import annotations

import codecs
import operator
import unicodedata
from collections.abc import Iterable, Iterator

from logitlab.tokenizer.byte_files import FileMethods  # save, load, from_hf, save_hf, ...
from logitlab.tokenizer.byte_vocab import bos_id_of, missing_byte_finder, ordinary_tokens, vocab_size_of
from logitlab.tokenizer.chat import ChatMethods  # apply_chat_template, chat_turns
from logitlab.tokenizer.patterns import (  # noqa: F401  (re-exported: the stage's public names)
    ASCII_PATTERNS,
    CL100K_PATTERN,
    GPT2_PATTERN,
    PATTERNS,
    SAFE_CUT,
    check_special_tokens,
    digits_unknown_to_tiktoken,
    find_safe_cut,
    pattern_name,
    pretokenizer,
    resolve_pattern,
    special_regex,
    uncovered_error,
)
from logitlab.tokenizer.reference import bpe, bpe_plain, consistent_for_tiktoken, encode_pieces, merge_table, utf8
from logitlab.tokenizer.special import place_specials, split_at_specials
from logitlab.tokenizer.special import prefix_overlap as _prefix_overlap


class Tokenizer(ChatMethods, FileMethods):
    """Byte-level BPE tokenizer: `Tokenizer(vocab, merges, special_tokens=None, pattern="gpt2")`.

    vocab: id -> bytes for the 256 single bytes, every merge result and (optionally) the special
    tokens' UTF-8 bytes. merges: (left bytes, right bytes) in learned order (rank = index).
    special_tokens: a list of strings (ids looked up in `vocab` by their bytes among entries that
    are neither bytes nor merge results, or else appended after the last id) or a dict str -> id.
    pattern: "gpt2" (default), "cl100k" or a regex whose whole matches cover any text and are
    never empty (checked here; ValueError with an example of what it drops otherwise).
    normalization: None, or the Unicode normal form ("NFC", ...) that the text between special
    tokens is put in before it is split, as a tokenizer.json's normalizer does (Qwen's: NFC).
    bos_token: None, or the special token that `encode(text, add_bos=True)` puts first (`bos_id`).
    drop_missing_bytes: False (default): vocab must hold all 256 bytes; True: the bytes it lacks
    (`missing_bytes`) are dropped from the text before merging, as `tokenizers` does (byte_vocab.py).
    """

    kind = "byte_level"  # SentencePieceTokenizer (sentencepiece.py) has the same interface

    def __init__(self, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                 special_tokens: Iterable[str] | dict[str, int] | None = None, pattern: str = "gpt2",
                 normalization: str | None = None, bos_token: str | None = None, drop_missing_bytes: bool = False):
        if normalization not in (None, "NFC", "NFD", "NFKC", "NFKD"):  # unicodedata's forms
            raise ValueError(f"normalization must be NFC, NFD, NFKC, NFKD or None, got {normalization!r}")
        self.normalization = normalization
        self.pattern = resolve_pattern(pattern)
        self.pattern_name = pattern_name(self.pattern)
        self._split = pretokenizer(self.pattern)
        self.merges = [(bytes(a), bytes(b)) for a, b in merges]
        vocab = {int(i): bytes(t) for i, t in vocab.items()}
        encoder, others, self.missing_bytes = ordinary_tokens(vocab, self.merges, drop_missing_bytes)
        specials = self._place_specials(special_tokens, others, len(vocab) and max(vocab) + 1)
        self.vocab_size = vocab_size_of(encoder, specials)
        self._encoder = encoder
        self._decoder: dict[int, bytes] = {i: t for t, i in encoder.items()}
        self._special = specials
        self._special_decoder = {i: s.encode("utf-8") for s, i in specials.items()}
        self.bos_token, self.bos_id = bos_token, bos_id_of(bos_token, specials)
        self._byte_ids = [encoder.get(bytes([b]), -1) for b in range(256)]  # -1: dropped before merging
        self._missing_in = missing_byte_finder(self.missing_bytes)
        # The reference path's merge table: left << 20 | right -> rank << 20 | merged id.
        if self.vocab_size > 0xFFFFF or len(self.merges) > 0xFFFFF:
            raise ValueError(f"vocab_size ({self.vocab_size}) and merges must stay below {0xFFFFF}")
        self._merge_ids, self._pair_rank = merge_table(encoder, self.merges)
        self._special_re = special_regex(specials)
        self._cache: dict[str, list[int]] = {}
        self._fast_path_ok: bool | None = None  # computed on first use (about 1 s for 50k tokens)
        self._tiktoken, self._ordinary = None, None  # tiktoken's Encoding and encode_ordinary, on first use
        self._token_lengths: list[int] | None = None  # bytes per id, for _check_fast_covered
        self.chat_template: str | None = None  # Jinja source; None: ChatML (chat.py)

    # ---------------------------------------------------------------- construction details
    _place_specials = staticmethod(place_specials)  # special.py: ids for the special tokens

    @property
    def fast_path_ok(self) -> bool:
        """True when tiktoken's core gives the same ids as replaying merges (see module docstring)."""
        if self._fast_path_ok is None:
            self._fast_path_ok = self._consistent_for_tiktoken()
        return self._fast_path_ok

    def _consistent_for_tiktoken(self) -> bool:
        """True when merging by rank of the concatenation (tiktoken) equals replaying merges."""
        return consistent_for_tiktoken(self._encoder, self.merges, self._bpe)

    def _fast(self):
        if self._tiktoken is None:
            import tiktoken

            self._tiktoken = tiktoken.Encoding(
                f"logitlab-{self.fingerprint()}", pat_str=self.pattern,
                mergeable_ranks=dict(self._encoder), special_tokens=dict(self._special))
        return self._tiktoken

    # ---------------------------------------------------------------- look-ups
    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    @property
    def eot_id(self) -> int | None:
        return self._special.get("<|endoftext|>")

    @property
    def vocab(self) -> dict[int, bytes]:
        """id -> bytes for every id (special tokens as their UTF-8 bytes)."""
        return {**self._decoder, **self._special_decoder}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one id. An id is an int (or has __index__, e.g. a NumPy or 0-d torch
        integer); a bool, a float or a list is a ValueError, as is an id outside the vocabulary."""
        if type(token_id) is int:
            found = self._decoder.get(token_id)
            if found is not None:
                return found
        elif isinstance(token_id, bool):
            raise ValueError(f"token id {token_id!r} is a bool, not an integer")
        else:
            try:
                token_id = operator.index(token_id)
            except TypeError:
                raise ValueError(f"token id {token_id!r} is not an integer "
                                 f"({type(token_id).__name__})") from None
            if token_id in self._decoder:
                return self._decoder[token_id]
        if token_id in self._special_decoder:
            return self._special_decoder[token_id]
        raise ValueError(f"token id {token_id!r} is outside the vocabulary (0..{self.vocab_size - 1})")

    id_to_token = token_bytes

    def token_to_id(self, token: bytes | str) -> int:
        if isinstance(token, str):
            if token in self._special:
                return self._special[token]
            token = token.encode("utf-8")
        if token in self._encoder:
            return self._encoder[token]
        raise ValueError(f"token {token!r} is not in the vocabulary")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_decoder

    # ---------------------------------------------------------------- encoding
    def _bpe(self, data: bytes) -> list[int]:
        """Replay merges on one pre-token's bytes (reference.bpe, O(n log n) in its length); bytes
        the vocabulary lacks are dropped first (byte_vocab.py)."""
        if self._missing_in is not None:
            data = data.translate(None, bytes(self.missing_bytes))
        return bpe(data, self._byte_ids, self._pair_rank, self._merge_ids)

    def _bpe_plain(self, data: bytes) -> list[int]:
        """The same rule written the obvious way (reference.bpe_plain, O(n^2)): what `_bpe` is tested against."""
        if self._missing_in is not None:
            data = data.translate(None, bytes(self.missing_bytes))
        return bpe_plain(data, self._byte_ids, self._pair_rank, self._merge_ids)

    def _fast_takes(self, text: str) -> bool:
        """Whether tiktoken's core may encode `text`: not when it holds a byte the vocabulary lacks
        (its ranks have none; dropped, the byte lets its neighbours merge), nor, for gpt2_digits, a
        digit that tiktoken's Unicode tables do not know (patterns.digits_unknown_to_tiktoken)."""
        if self._missing_in is not None and self._missing_in.search(utf8(text)):
            return False
        return (self.pattern_name != "gpt2_digits" or text.isascii()
                or digits_unknown_to_tiktoken().isdisjoint(text))

    def _encode_plain_reference(self, text: str, out: list[int]) -> None:
        encode_pieces(text, self._split, self._bpe, self._cache, out)

    def _allowed(self, allowed_special) -> set[str]:
        if allowed_special == "all":
            return set(self._special)
        if allowed_special in ("none", None):
            return set()
        allowed = set(allowed_special)
        unknown = allowed - self._special.keys()
        if unknown:
            raise ValueError(f"allowed_special names unknown special tokens: {sorted(unknown)}")
        return allowed

    def encode(self, text: str, allowed_special: str | Iterable[str] = "all", fast: bool | None = None,
               add_bos: bool = False) -> list[int]:
        """Text -> ids. allowed_special: "all" (default: special-token strings become their ids),
        "none" (untrusted text: they are ordinary text) or a set of special-token strings.
        fast: None/True -> tiktoken core when the vocabulary allows it; False -> reference path.
        add_bos: put `bos_id` first (when the tokenizer has a BOS token; else nothing is added)."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}")
        allowed = self._allowed(allowed_special)
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        if self.normalization is None:
            return bos + self._encode(text, allowed, fast) if bos else self._encode(text, allowed, fast)
        out, norm = bos, self.normalization  # special tokens are found in the text as given; the rest is normalized
        for piece, special in self._split_special(text, allowed):
            out += [special] if special is not None else self._encode(unicodedata.normalize(norm, piece), set(), fast)
        return out

    def _encode(self, text: str, allowed: set[str], fast: bool | None) -> list[int]:
        use_fast = fast is not False and self.fast_path_ok and self._fast_takes(text)
        if use_fast and not allowed:
            out = self._fast().encode_ordinary(text)  # no special-token scan: tiktoken's fastest entry
        elif use_fast and not _prefix_overlap(allowed):
            out = self._fast().encode(text, allowed_special=allowed, disallowed_special=())
        else:
            out = []
            for piece, special in self._split_special(text, allowed):
                if special is not None:
                    out.append(special)
                elif use_fast:
                    out.extend(self._fast().encode_ordinary(piece))
                else:
                    self._encode_plain_reference(piece, out)  # its splitter checks coverage itself
        if use_fast and self.pattern_name is None:
            self._check_fast_covered(text, allowed, out)
        return out

    def _check_fast_covered(self, text: str, allowed: set[str], ids: list[int]) -> None:
        """A custom pattern's pieces must cover the text (see patterns.py): tiktoken would
        silently skip what no match takes. The ids' bytes add up to the text's UTF-8 length
        exactly when nothing was skipped; if not, the reference splitter names what was."""
        if self._token_lengths is None:
            self._token_lengths = [len(self.token_bytes(i)) for i in range(self.vocab_size)]
        lengths = self._token_lengths
        if sum(lengths[i] for i in ids) == len(utf8(text)):
            return
        for piece, special in self._split_special(text, allowed):
            if special is None:
                self._split(piece)  # raises ValueError naming the dropped text
        raise uncovered_error(self.pattern, text)

    def encode_ordinary(self, text: str, fast: bool | None = None) -> list[int]:
        """Encode untrusted text: special-token strings are ordinary text."""
        if self.normalization is not None and isinstance(text, str):
            text = unicodedata.normalize(self.normalization, text)
        if fast is None and self._ordinary is not None:  # tiktoken's core, once the checks below passed:
            try:                                         # they cost more than a short text's encoding
                return self._ordinary(text)
            except UnicodeEncodeError:                   # lone surrogates: tiktoken's own replacement
                return self._fast().encode_ordinary(text)
            except TypeError:                            # not a str: the checked path says what is wrong
                pass
        if (fast is not False and type(text) is str and self.pattern_name is not None and self.fast_path_ok
                and self._fast_takes(text)):
            enc = self._fast()      # its Rust core's method, under Encoding.encode_ordinary's wrapper
            if self._missing_in is None and self.pattern_name != "gpt2_digits":  # else each text is checked
                self._ordinary = getattr(getattr(enc, "_core_bpe", enc), "encode_ordinary", enc.encode_ordinary)
            return enc.encode_ordinary(text)
        return self.encode(text, allowed_special="none", fast=fast)

    def encode_ordinary_array(self, text: str):
        """encode_ordinary's ids as a (T,) uint32 numpy array. Once the direct path is on (after a
        first encode_ordinary), tiktoken's core writes them into a buffer with no Python int per id
        (its encode with no special token allowed: the same ids); otherwise the list, converted."""
        import numpy as np

        core = getattr(self._tiktoken, "_core_bpe", None)
        if self._ordinary is not None and self.normalization is None and type(text) is str \
                and hasattr(core, "encode_to_tiktoken_buffer"):
            try:
                return np.frombuffer(core.encode_to_tiktoken_buffer(text, set()), dtype=np.uint32)
            except UnicodeEncodeError:  # lone surrogates: encode_ordinary replaces them as tiktoken does
                pass
        return np.asarray(self.encode_ordinary(text), dtype=np.uint32)

    def _split_special(self, text: str, allowed: set[str]) -> Iterator[tuple[str, int | None]]:
        rx = self._special_re if allowed == set(self._special) else special_regex(allowed)
        return split_at_specials(text, rx, self._special)

    def encode_iterable(self, iterable: Iterable[str], allowed_special="all", fast: bool | None = None,
                        chunk_chars: int = 1 << 16) -> Iterator[int]:
        """Lazily encode a stream of strings (e.g. an open file's lines) in bounded memory.

        Text is buffered until about `chunk_chars` characters, then cut at the last position no
        pre-token crosses (SAFE_CUT, outside any special token) and the part before it is encoded.
        The ids equal `encode("".join(iterable))` for the gpt2 and cl100k patterns."""
        pending: list[str] = []
        size = 0
        for text in iterable:
            pending.append(text)
            size += len(text)
            if size < chunk_chars:
                continue
            buf = "".join(pending)
            cut = self._safe_cut(buf)
            if cut > 0:
                yield from self.encode(buf[:cut], allowed_special, fast)
                buf = buf[cut:]
            pending, size = [buf], len(buf)
        if pending:
            yield from self.encode("".join(pending), allowed_special, fast)

    def _safe_cut(self, buf: str) -> int:
        return find_safe_cut(buf, self._special_re, max(map(len, self._special), default=0))

    # ---------------------------------------------------------------- decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Ids -> their bytes joined; a bad id is a ValueError naming it and its position."""
        return b"".join(self._each_token_bytes(ids))

    def _each_token_bytes(self, ids: Iterable[int]) -> Iterator[bytes]:
        for n, i in enumerate(ids):
            try:
                yield self.token_bytes(i)
            except ValueError as exc:
                raise ValueError(f"{exc}, at position {n} of the ids") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield text as soon as it is valid UTF-8; a character split across tokens waits."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for token in self._each_token_bytes(ids):
            piece = decoder.decode(token)
            if piece:
                yield piece
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail

    def __repr__(self) -> str:
        extra = (f", bos_token={self.bos_token!r}" if self.bos_token else "") + (
            f", missing_bytes={len(self.missing_bytes)}" if self.missing_bytes else "")
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self._special)}, pattern={self.pattern_name or self.pattern!r}{extra})")

