"""A byte-level vocabulary taken apart, as `Tokenizer` (core.py) is built from it.

A vocabulary is id -> bytes. Its ordinary tokens are the 256 single bytes and one result per
merge; every other entry must be a special token (special.place_specials). Ids run 0..V-1 without
gaps, and no special token shares an ordinary token's id. Two things a loaded file may bring:

* Bytes the vocabulary lacks. A vocabulary learned without the whole byte alphabet cannot spell
  every text: SmolLM2's lacks 21 of the 256 (C0, C1, F1, F2 and F5..FF, which only invalid UTF-8
  or unassigned code points hold, and the control characters 04, 06, 13, 14, 16 and 1D).
  `tokenizers` skips a character its BPE model does not know when the model has no unk_token, so
  such a byte vanishes from its pre-token before merging, and the bytes on either side of it may
  merge. `Tokenizer(..., drop_missing_bytes=True)` does the same (core.py); without it a missing
  byte is an error, and a vocabulary logitlab trains always holds all 256.
* A BOS token: the special token a tokenizer.json's post-processor puts before every text
  (Llama 3's <|begin_of_text|>), which `encode(text, add_bos=True)` puts first.
"""

from __future__ import annotations

import re


def ordinary_tokens(vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], drop_missing_bytes: bool
                    ) -> tuple[dict[bytes, int], dict[int, bytes], tuple[int, ...]]:
    """(bytes -> id of the ordinary tokens, id -> bytes of every other entry, the byte values the
    vocabulary lacks). ValueError for a negative id, a missing merge result, a merge whose part is
    missing, or a missing byte unless `drop_missing_bytes`."""
    ordinary = {bytes([b]) for b in range(256)} | {a + b for a, b in merges}
    encoder: dict[bytes, int] = {}
    others: dict[int, bytes] = {}
    for i, tok in sorted(vocab.items()):
        if i < 0:
            raise ValueError(f"vocab id {i} is negative")
        if tok in ordinary and tok not in encoder:
            encoder[tok] = i
        else:
            others[i] = tok
    absent = sorted(ordinary - encoder.keys())
    missing_bytes = tuple(t[0] for t in absent if len(t) == 1)
    lacking = [t for t in absent if len(t) > 1 or not drop_missing_bytes]
    if lacking:
        hint = "" if len(lacking[0]) > 1 else (" (drop_missing_bytes=True drops the bytes a vocabulary lacks "
                                                "from the text, as tokenizers does)")
        raise ValueError(f"vocab lacks {len(lacking)} byte/merge token(s), e.g. {lacking[0]!r}{hint}")
    for a, b in merges:
        for part in (a, b):
            if part not in encoder:
                raise ValueError(f"merge {a!r} + {b!r} uses {part!r}, which the vocabulary lacks")
    return encoder, others, missing_bytes


def vocab_size_of(encoder: dict[bytes, int], specials: dict[str, int]) -> int:
    """V, checking that no special token takes an ordinary token's id and that ids run 0..V-1."""
    used = set(encoder.values())
    clash = [i for i in specials.values() if i in used]
    if clash:
        raise ValueError(f"special token id {clash[0]} is already an ordinary token's id")
    all_ids = used | set(specials.values())
    if not all_ids:
        raise ValueError("the vocabulary is empty")
    size = max(all_ids) + 1
    if size != len(all_ids):
        first = next(i for i in range(size) if i not in all_ids)
        raise ValueError(f"vocab ids must run 0..{size - 1} without gaps; id {first} is missing")
    return size


def missing_byte_finder(missing_bytes: tuple[int, ...]) -> re.Pattern | None:
    """A pattern that finds any of `missing_bytes` in UTF-8 (None when there is none)."""
    if not missing_bytes:
        return None
    return re.compile(b"[" + b"".join(re.escape(bytes([b])) for b in missing_bytes) + b"]")


def bos_id_of(bos_token: str | None, specials: dict[str, int]) -> int | None:
    """The BOS token's id: it must be one of the special tokens."""
    if bos_token is None:
        return None
    if bos_token not in specials:
        raise ValueError(f"bos_token {bos_token!r} is not one of the special tokens "
                         f"({', '.join(map(repr, list(specials)[:5])) or 'there are none'})")
    return specials[bos_token]
