"""Words found in a text's UTF-8 bytes, without a str object per word, and their repeated n-grams.

bytewords.py owns the fast route to the word measurements of measures.py for texts without a
non-ASCII space (almost all): `ByteWords.of(text)` finds the words that str.split() would give as
byte offsets, each with its length in characters and a 64-bit key equal for equal words (prefix
sums of bytes times powers of an odd constant, mod 2^64); `duplicate_ngram_fraction` finds the
repeated word n-grams through the same kind of keys, comparing the words themselves wherever keys
collide, so the result is exact. measures.py's plain functions are the
reference (tests/test_data_filters.py checks equality). It imports nothing from logitlab.
"""

from __future__ import annotations

import collections

import numpy as np

# Words found in the UTF-8 bytes, without a str object per word (FastMeasures, when it applies)
WIDE_SPACES = "\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
              "\u2028\u2029\u202f\u205f\u3000"  # the non-ASCII characters str.split() splits at
_SOLID = bytes(0 if b < 128 and chr(b).isspace() else 1 for b in range(256))  # 1: a byte inside a word
_LEADS = bytes(0 if 0x80 <= b < 0xC0 else 1 for b in range(256))  # 1: the first byte of a character
MAX_BYTES = 1 << 16  # longer texts are split into str words


def _powers(base: int) -> np.ndarray:
    out = np.full(MAX_BYTES + 1, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out)  # base^j mod 2^64 (wraps, as intended)


_P = 0x100000001B3  # odd: invertible mod 2^64
_POWERS, _INVERSES = _powers(_P), _powers(pow(_P, -1, 1 << 64))


class ByteWords:
    """The words of a text (those of str.split()) found in its UTF-8 bytes: each word's byte
    [start, end), its length in characters, and a 64-bit key equal for equal words (its bytes
    b_0..b_k as sum b_j * P^j mod 2^64, from one prefix sum over the text: (H[end] - H[start]) *
    P^-start). `of(text)` is None where it does not apply (a text of 2^16 bytes or more, or one
    holding a non-ASCII space): FastMeasures then splits the text."""

    def __init__(self, raw: bytes, starts: np.ndarray, ends: np.ndarray, lengths: np.ndarray,
                 keys: np.ndarray) -> None:
        self.raw, self.starts, self.ends, self.lengths, self.keys = raw, starts, ends, lengths, keys

    @classmethod
    def of(cls, text: str) -> "ByteWords | None":
        ascii_ = text.isascii()
        if not ascii_ and any(c in text for c in WIDE_SPACES):
            return None
        raw = text.encode("utf-8", "surrogatepass")  # injective: equal words, equal bytes
        N = len(raw)
        if N >= MAX_BYTES:
            return None
        solid = np.frombuffer(b"\0" + raw.translate(_SOLID) + b"\0", dtype=np.int8)  # (N + 2,)
        edges = np.flatnonzero(solid[1:] != solid[:-1])  # start, end, start, end... of the words
        starts, ends = edges[0::2], edges[1::2]
        prefix = np.zeros(N + 1, dtype=np.uint64)  # prefix[j] = sum_{i<j} b_i P^i
        np.cumsum(np.frombuffer(raw, dtype=np.uint8) * _POWERS[:N], out=prefix[1:])
        keys = (prefix[ends] - prefix[starts]) * _INVERSES[starts]
        if ascii_:
            return cls(raw, starts, ends, ends - starts, keys)
        chars = np.zeros(N + 1, dtype=np.int64)  # characters before each byte
        np.cumsum(np.frombuffer(raw.translate(_LEADS), dtype=np.uint8), out=chars[1:])
        return cls(raw, starts, ends, chars[ends] - chars[starts], keys)

    def grams(self, firsts: np.ndarray, n: int) -> list[tuple[bytes, ...]]:
        """The n-grams starting at words `firsts`, each a tuple of the words' bytes."""
        at = firsts[:, None] + np.arange(n)  # (C, n) word numbers
        raw, starts, ends = self.raw, self.starts[at].tolist(), self.ends[at].tolist()
        return [tuple(raw[s:e] for s, e in zip(ss, es)) for ss, es in zip(starts, ends)]

    def duplicate_ngram_fraction(self, n: int, total_chars: int) -> float:
        """duplicate_ngram_fraction(text.split(), n); `total_chars`: the words' characters (the
        text's non-space ones). N-gram i's key is sum_k key_{i+k} P^k, from a prefix sum again."""
        L = len(self.keys)
        if L < n:
            return 0.0
        m, prefix = L - n + 1, np.zeros(L + 1, dtype=np.uint64)
        np.cumsum(self.keys * _POWERS[:L], out=prefix[1:])
        grams = (prefix[n:] - prefix[:m]) * _INVERSES[:m]
        ranked = np.sort(grams)
        if not (ranked[1:] == ranked[:-1]).any():  # no key twice: no n-gram twice
            return 0.0
        starts = repeated_starts(grams, lambda firsts: self.grams(firsts, n))
        if not starts.size:
            return 0.0
        return int(self.lengths[covered_words(starts, n, L)].sum()) / total_chars


def repeated_starts(grams: np.ndarray, tuples_of) -> np.ndarray:
    """Starts of the n-grams that occur more than once, given a 64-bit key per n-gram (equal
    n-grams, equal keys) and `tuples_of(starts)`, those n-grams as tuples: n-grams whose keys
    collide are compared as tuples, so a collision never counts."""
    order = np.argsort(grams)
    ranked = grams[order]
    same = ranked[1:] == ranked[:-1]
    if not same.any():
        return np.zeros(0, dtype=np.int64)
    shared = np.zeros(len(grams), dtype=bool)  # in sorted order: a key equal to a neighbour's
    shared[1:] = same
    shared[:-1] |= same
    candidates = order[shared]
    tuples = tuples_of(candidates)
    candidates = candidates.tolist()
    counts = collections.Counter(tuples)
    return np.array([i for i, g in zip(candidates, tuples) if counts[g] > 1], dtype=np.int64)


def covered_words(starts: np.ndarray, n: int, length: int) -> np.ndarray:
    """(length,) bool: the words inside at least one of the n-grams starting at `starts`."""
    edges = np.zeros(length + 1, dtype=np.int64)  # +1 where a repeated n-gram starts, -1 after it ends
    edges[starts] += 1  # the starts are distinct positions
    edges[starts + n] -= 1
    return np.cumsum(edges[:length]) > 0

