"""Text <-> token ids for SentencePiece-style BPE with byte fallback: `SentencePieceTokenizer`.

The tokenizers of Llama-2, Mistral, TinyLlama and Gemma, as their Hugging Face `tokenizer.json`
files describe them, with the same public interface as the byte-level `Tokenizer` (core.py), so
generation, chat, inspection, serving, evaluation and fine-tuning take either.

Encoding a text, step by step (each step as `tokenizers` runs it; the ids equal its ids):

1. Added tokens (<s>, </s>, <start_of_turn>, ...) are cut out of the text, leftmost and at one
   position the longest. Special ones only when allowed (`allowed_special`, as in Tokenizer);
   non-special added tokens always, as in Hugging Face.
2. Every other piece is normalized and pre-tokenized (sp_pipeline.py): spaces become "▁" and a
   "▁" is prepended, so "Hello world" reads "▁Hello▁world". Whether text after an added token
   gets a "▁" too depends on the file (Llama-2's normalizer prepends one to every piece; newer
   files' Metaspace "first" only to the text's start).
3. Each word's characters become ids, with byte fallback for characters outside the vocabulary,
   and merges join them by rank (sp_bpe.py).

`encode(text)` adds nothing around the text, as Tokenizer.encode does. `encode(text,
add_bos=True)` puts the file's BOS token first (`bos_id`, e.g. <s>: its post-processor's
template, what transformers' `add_special_tokens=True` adds). A model's input from a plain
text (a prompt, a document) wants it; a chat template writes its own.

Decoding. `decode(ids)` runs the file's decoder over the token strings ("▁" -> space, byte
tokens -> their bytes, one leading space stripped) and equals `tokenizers`' decode with special
tokens kept. `token_bytes(i)` is what one id adds in the middle of a text: "▁the" -> b" the",
<0xE2> -> b"\\xe2", a special token its UTF-8. `decode_stream(ids)` yields the text the ids add
after earlier text (a generated continuation): like decode, but the first token keeps its space,
and a run of byte tokens waits until it ends (a later byte can make the whole run U+FFFDs).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Iterator

from logitlab.tokenizer.chat import ChatMethods
from logitlab.tokenizer.sp_bpe import (
    BYTE_PIECE,
    byte_of_piece,
    independent_parts,
    joined_pairs,
    merge,
    merge_plain,
    pair_table,
    symbols,
)
from logitlab.tokenizer.sp_pipeline import AddedToken, Metaspace, Replace, SentencePieceConfig, bytes_text

CACHE_LIMIT = 100_000  # encoded word parts kept
CACHE_LENGTH = 256  # characters of the longest part kept


def _alternation(strings: Iterable[str]) -> re.Pattern | None:
    """Leftmost match, and at one position the longest (alternatives longest first)."""
    strings = sorted(set(strings), key=lambda s: (-len(s), s))
    return re.compile("|".join(map(re.escape, strings))) if strings else None


class SentencePieceTokenizer(ChatMethods):
    """`SentencePieceTokenizer(vocab, merges, config, added_tokens=(), roles=None)`.

    vocab: piece -> id (the BPE model's vocabulary: "▁the", "<0x0A>", "<unk>"...). merges: (left,
    right) pieces in rank order, each part and their concatenation in vocab. config: the steps
    around BPE (sp_pipeline.SentencePieceConfig). added_tokens: AddedToken entries, at ids of
    vocab (with the same piece) or after it. roles: the special tokens' names for chat templates
    and generation, as a Hugging Face tokenizer_config.json gives them ({"bos_token": "<s>",
    "eos_token": "</s>", ...}); eot_id is the eos_token's id. Ids must run 0..V-1 without gaps.
    """

    kind = "sentencepiece"

    def __init__(self, vocab: dict[str, int], merges: Iterable[tuple[str, str]], config: SentencePieceConfig,
                 added_tokens: Iterable[AddedToken] = (), roles: dict[str, str] | None = None):
        if not isinstance(config, SentencePieceConfig):
            raise ValueError(f"config must be a SentencePieceConfig, got {type(config).__name__}")
        self.config = config
        self._vocab = self._check_vocab(vocab)
        self.merges = [(str(a), str(b)) for a, b in merges]
        self._added = tuple(added_tokens)
        self._pieces = self._id_table()
        self._added_by_content = {t.content: t for t in self._added}
        self.vocab_size = len(self._pieces)
        self._pairs = pair_table([self._merge_ids(n, a, b) for n, (a, b) in enumerate(self.merges)])
        self._unk_id = self._role_id(config.unk_token, "unk_token") if config.unk_token else None
        self.bos_id = self._role_id(config.bos_token, "bos_token") if config.bos_token else None
        self._roles = {name: (token, self._role_id(token, name)) for name, token in dict(roles or {}).items()}
        self._byte_ids = [self._vocab.get(BYTE_PIECE(b)) for b in range(256)] if config.byte_fallback else None
        self._joined = joined_pairs(a + b for a, b in self.merges)  # where tokens may join characters
        self._special = {t.content: t.id for t in self._added if t.special}
        self._special_ids = set(self._special.values())
        self._raw_re = _alternation(t.content for t in self._added if not t.normalized)
        self._normalized = {config.normalize(t.content): t for t in self._added if t.normalized}
        self._normalized_re = _alternation(self._normalized)
        byte_decoder = config.has_byte_fallback_decoder
        self._is_byte = [byte_decoder and byte_of_piece(p) is not None for p in self._pieces]
        self._bytes = [bytes([byte_of_piece(p)]) if b else self._text_of(p)  # token_bytes
                       for p, b in zip(self._pieces, self._is_byte)]
        self._cache: dict[str, list[int]] = {}
        self.chat_template: str | None = None  # Jinja source; None: ChatML (chat.py)

    # ---------------------------------------------------------------- construction details
    @staticmethod
    def _check_vocab(vocab) -> dict[str, int]:
        if not isinstance(vocab, dict) or not vocab:
            raise ValueError("vocab must be a non-empty dict piece -> id")
        seen: dict[int, str] = {}
        for piece, i in vocab.items():
            if not isinstance(piece, str) or not piece:
                raise ValueError(f"vocab piece {piece!r} must be a non-empty string")
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"vocab piece {piece!r} has a bad id {i!r}")
            if i in seen:
                raise ValueError(f"vocab pieces {seen[i]!r} and {piece!r} share id {i}")
            seen[i] = piece
        return dict(vocab)

    def _id_table(self) -> list[str]:
        """id -> the piece's string: an added token's content, else the vocabulary's piece."""
        model = {i: p for p, i in self._vocab.items()}
        table = dict(model)
        for t in self._added:
            if not isinstance(t, AddedToken):
                raise ValueError(f"added_tokens must be AddedToken entries, got {t!r}")
            if model.get(t.id, t.content) != t.content:
                raise ValueError(f"added token {t.content!r} has id {t.id}, which is vocab piece {model[t.id]!r}")
            if table.get(t.id, t.content) != t.content:
                raise ValueError(f"added tokens {table[t.id]!r} and {t.content!r} share id {t.id}")
            table[t.id] = t.content
        contents = [t.content for t in self._added]
        if len(set(contents)) != len(contents):
            twice = next(c for c in contents if contents.count(c) > 1)
            raise ValueError(f"added token {twice!r} is listed twice")
        n = max(table) + 1
        if len(table) != n:
            first = next(i for i in range(n) if i not in table)
            raise ValueError(f"vocab ids must run 0..{n - 1} without gaps; id {first} is missing")
        return [table[i] for i in range(n)]

    def _merge_ids(self, n: int, a: str, b: str) -> tuple[int, int, int]:
        for part in (a, b, a + b):
            if part not in self._vocab:
                raise ValueError(f"merge #{n} ({a!r} {b!r}): {part!r} is not in the vocab")
        return self._vocab[a], self._vocab[b], self._vocab[a + b]

    def _role_id(self, token: str, name: str) -> int:
        found = self._id_of(token) if isinstance(token, str) else None
        if found is None:
            raise ValueError(f"{name} {token!r} is not a token of this vocabulary")
        return found

    def _id_of(self, token: str) -> int | None:
        """An added token's or a vocabulary piece's id (None: neither)."""
        added = self._added_by_content.get(token)
        return added.id if added is not None else self._vocab.get(token)

    def _text_of(self, piece: str) -> bytes:
        """What a piece that is not a byte token adds in the middle of a text: the piece through
        the decoder's per-token replacements ("▁the" -> b" the")."""
        for step in self.config.decoder:
            if isinstance(step, Replace):
                piece = piece.replace(step.old, step.new)
            elif isinstance(step, Metaspace):
                piece = piece.replace(step.replacement, " ")
        return piece.encode("utf-8")

    # ---------------------------------------------------------------- look-ups
    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    @property
    def added_tokens(self) -> tuple[AddedToken, ...]:
        return self._added

    @property
    def roles(self) -> dict[str, str]:
        """The special tokens' names: {"bos_token": "<s>", "eos_token": "</s>", ...}."""
        return {name: token for name, (token, _) in self._roles.items()}

    @property
    def eot_id(self) -> int | None:
        """The end-of-text id generation stops on: roles["eos_token"]'s (None without one)."""
        return self._roles["eos_token"][1] if "eos_token" in self._roles else None

    @property
    def vocab(self) -> dict[int, bytes]:
        """id -> bytes (token_bytes) for every id."""
        return dict(enumerate(self._bytes))

    @property
    def pieces(self) -> dict[str, int]:
        """The BPE model's vocabulary, piece -> id (added tokens that are not in it aside)."""
        return dict(self._vocab)

    def _index(self, token_id) -> int:
        if isinstance(token_id, bool):
            raise ValueError(f"token id {token_id!r} is a bool, not an integer")
        try:
            i = operator.index(token_id)
        except TypeError:
            raise ValueError(f"token id {token_id!r} is not an integer ({type(token_id).__name__})") from None
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {token_id!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        return i

    def piece(self, token_id: int) -> str:
        """The vocabulary's spelling of an id: "▁the", "<0xE2>", "<s>"."""
        return self._pieces[self._index(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """What one id adds in the middle of a text (module docstring); ValueError for a bad id."""
        return self._bytes[self._index(token_id)]

    id_to_token = token_bytes

    def token_to_id(self, token: bytes | str) -> int:
        """A piece's id ("▁the", "<s>"), or for bytes the first id whose token_bytes they are."""
        if isinstance(token, str):
            found = self._id_of(token)
        else:
            found = next((i for i, b in enumerate(self._bytes) if b == bytes(token)), None)
        if found is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return found

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # ---------------------------------------------------------------- encoding
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
        """Text -> ids (module docstring). allowed_special: "all" (default), "none" (untrusted text)
        or a set of special-token strings. add_bos: put `bos_id` first (when the file has one).
        fast=False: the plain reference path (whole words, merge_plain, no cache)."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}")
        allowed = self._allowed(allowed_special)
        out = [self.bos_id] if add_bos and self.bos_id is not None else []
        for piece, token, at_start in self._cut_added(text, self._raw_re, self._added_by_content, allowed, True):
            if token is not None:
                out.append(token)
                continue
            normalized = self.config.normalize(piece)
            for sub, token2, sub_start in self._cut_added(normalized, self._normalized_re, self._normalized,
                                                          allowed, at_start):
                if token2 is not None:
                    out.append(token2)
                    continue
                for word in self.config.pre_tokenize(sub, sub_start):
                    out.extend(self._word(word, fast is not False))
        return out

    @staticmethod
    def _cut_added(text: str, rx, table: dict[str, AddedToken], allowed: set[str], at_start: bool):
        """(piece, None, starts the text) for text between added tokens, (token, id, False) for
        an added token; an added special token that is not allowed stays text. Empty pieces are
        left out, as `tokenizers` leaves them."""
        start = 0
        for m in rx.finditer(text) if rx is not None and text else ():
            t = table[m.group()]
            if t.special and t.content not in allowed:
                continue
            if m.start() > start:
                yield text[start:m.start()], None, at_start and start == 0
            yield m.group(), t.id, False
            start = m.end()
        if start < len(text):
            yield text[start:], None, at_start and start == 0

    def _word(self, word: str, fast: bool) -> list[int]:
        """One word's ids: whole when ignore_merges finds it in the vocab; else its characters
        (sp_bpe.symbols) merged, part by part where that is exact (sp_bpe.independent_parts)."""
        if self.config.ignore_merges and word in self._vocab:
            return [self._vocab[word]]
        cfg = self.config
        if not fast:
            return merge_plain(symbols(word, self._vocab, self._byte_ids, self._unk_id, cfg.fuse_unk), self._pairs)
        out = []
        for part in independent_parts(word, self._vocab, self._joined):
            ids = self._cache.get(part)
            if ids is None:
                ids = merge(symbols(part, self._vocab, self._byte_ids, self._unk_id, cfg.fuse_unk), self._pairs)
                if len(self._cache) >= CACHE_LIMIT:
                    self._cache.clear()
                if len(part) <= CACHE_LENGTH:
                    self._cache[part] = ids
            out.extend(ids)
        return out

    def encode_ordinary(self, text: str, fast: bool | None = None) -> list[int]:
        """Encode untrusted text: special-token strings are ordinary text."""
        return self.encode(text, allowed_special="none", fast=fast)

    def encode_iterable(self, iterable: Iterable[str], allowed_special="all", fast: bool | None = None,
                        chunk_chars: int = 1 << 16) -> Iterator[int]:
        """The ids of the joined strings. The text is encoded whole: cut anywhere, its second part
        would get a "▁" of its own."""
        yield from self.encode("".join(iterable), allowed_special, fast)

    # ---------------------------------------------------------------- decoding
    def _checked(self, ids: Iterable[int]) -> list[int]:
        out = []
        for n, i in enumerate(ids):
            try:
                out.append(self._index(i))
            except ValueError as exc:
                raise ValueError(f"{exc}, at position {n} of the ids") from None
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text through the file's decoder, special tokens kept (= `tokenizers`' decode)."""
        return self.config.decode([self._pieces[i] for i in self._checked(ids)])

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Each id's token_bytes joined (a continuation's bytes: the first token keeps its space)."""
        return b"".join(self._bytes[i] for i in self._checked(ids))

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield the text `ids` add after earlier text, as soon as it is known (module docstring)."""
        run: list[int] = []
        for n, i in enumerate(ids):
            try:
                i = self._index(i)
            except ValueError as exc:
                raise ValueError(f"{exc}, at position {n} of the ids") from None
            raw = self._bytes[i]
            if self._is_byte[i]:
                run.append(raw[0])
                continue
            if run:
                yield bytes_text(run)
                run = []
            if raw:
                yield raw.decode("utf-8")
        if run:
            yield bytes_text(run)

    def with_added_tokens(self, tokens: dict[str, int]) -> SentencePieceTokenizer:
        """A copy with more special added tokens ({content: id}, ids from vocab_size on)."""
        added = [*self._added, *(AddedToken(s, i, special=True, normalized=False) for s, i in tokens.items())]
        return type(self)(self._vocab, self.merges, self.config, added, self.roles)

    # ---------------------------------------------------------------- formats (sp_files.py)
    def fingerprint(self) -> str:
        from logitlab.tokenizer.sp_files import fingerprint

        return fingerprint(self)

    def save(self, path) -> None:
        """logitlab's JSON (pieces, merges, the steps) plus a readable `.vocab` listing beside it."""
        from logitlab.tokenizer.sp_files import save_logitlab

        save_logitlab(self, path)

    @classmethod
    def load(cls, path, data: dict | None = None) -> SentencePieceTokenizer:
        """A logitlab tokenizer file of this kind (`data`: its parsed JSON when already read)."""
        from logitlab.tokenizer.formats import read_logitlab
        from logitlab.tokenizer.sp_files import load_logitlab

        kind, data = read_logitlab(path) if data is None else (cls.kind, data)
        if kind != cls.kind:
            raise ValueError(f"{path}: a {kind} tokenizer, not a SentencePiece-style one (Tokenizer.load reads either)")
        return load_logitlab(cls, data, path)

    def save_hf(self, path) -> None:
        """Hugging Face tokenizer.json (read back by `tokenizers` and transformers with equal ids)."""
        from logitlab.tokenizer.sp_files import save_hf

        save_hf(self, path)

    @classmethod
    def from_hf(cls, path, data: dict | None = None) -> SentencePieceTokenizer:
        """A SentencePiece-style tokenizer.json, with the tokenizer_config.json beside it (sp_files.py)."""
        from logitlab.tokenizer.sp_files import load_hf

        return load_hf(cls, path, data)

    def save_tiktoken(self, path) -> None:
        raise ValueError("a SentencePiece-style tokenizer has no tiktoken rank file (tiktoken is byte-level BPE); "
                         "write tokenizer.json (--to hf) or logitlab JSON instead")

    def __repr__(self) -> str:
        return (f"SentencePieceTokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self._special)}, bos={self.config.bos_token!r}, "
                f"eos={self.roles.get('eos_token')!r})")
