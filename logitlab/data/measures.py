"""What the cleaning rules measure: for one document, each number a rule of filters.py compares
with its threshold.

measures.py owns two ways to get them. The plain functions (mean_word_length, line_share,
duplicate_ngram_fraction, alpha_share, ...) are the reference: one obvious loop each, the
definitions of Gopher (Rae et al. 2021, appendix A) checkable by eye. `FastMeasures` computes the
same numbers, equal to the last bit (tests/test_data_filters.py), with the loops in C: str methods
over whole lists, bytes.translate, numpy. `prepare` uses it: a Python loop per character (the
alphabetic share) or per n-gram cost more than encoding the text. `Measures` gives the plain
numbers through the same interface, so the rules run unchanged on either. Words are the
whitespace-separated tokens of str.split(). It imports nothing from logitlab.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

BULLETS = ("•", "●", "-", "*", "‣", "◦", "–")
ELLIPSES = ("...", "…")


# --------------------------------------------------------------------------------------------
# The reference: one plain loop per number
# --------------------------------------------------------------------------------------------

def mean_word_length(words: list[str]) -> float:
    return sum(map(len, words)) / len(words) if words else 0.0


def symbol_ratio(text: str, words: list[str]) -> float:
    """("#" characters + ellipses) per word."""
    symbols = text.count("#") + text.count("...") + text.count("…")
    return symbols / max(len(words), 1)


def line_share(lines: list[str], predicate) -> float:
    """Share of the non-empty lines for which predicate(stripped line) holds."""
    kept = [ln.strip() for ln in lines if ln.strip()]
    return sum(1 for ln in kept if predicate(ln)) / len(kept) if kept else 0.0


def duplicate_line_fraction(lines: list[str]) -> float:
    """Share of non-empty lines equal to an earlier line of the document."""
    seen, dup, total = set(), 0, 0
    for ln in lines:
        ln = ln.strip()
        if not ln:
            continue
        total += 1
        dup += ln in seen
        seen.add(ln)
    return dup / total if total else 0.0


def duplicate_ngram_fraction(words: list[str], n: int) -> float:
    """Share of word characters inside word n-grams that occur more than once (each word counted
    once, however many repeated n-grams cover it)."""
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = collections.Counter(grams)
    covered = [False] * len(words)
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i:i + n] = [True] * n
    total = sum(map(len, words))
    return sum(len(w) for w, c in zip(words, covered) if c) / total if total else 0.0


def alpha_share(text: str) -> float:
    """Alphabetic characters / non-whitespace characters (0 for an empty text)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) / len(chars) if chars else 0.0


def alnum_share(text: str) -> float:
    """Alphanumeric characters / all characters (0 for an empty text)."""
    return sum(c.isalnum() for c in text) / len(text) if text else 0.0


# --------------------------------------------------------------------------------------------
# The same measurements with the loops in C (the fast path; tests check they equal the above)
# --------------------------------------------------------------------------------------------

def _ascii_rejects(test) -> bytes:
    return bytes(b for b in range(128) if not test(chr(b)))


_ASCII_REJECTS = {name: _ascii_rejects(getattr(str, name)) for name in ("isspace", "isalpha", "isalnum")}


def count_chars(text: str, kind: str) -> int:
    """How many characters of `text` pass str.<kind> ("isspace", "isalpha" or "isalnum"): the count
    `sum(getattr(c, kind)() for c in text)`, with each distinct character tested once. ASCII text
    is counted by bytes.translate deleting the bytes that fail; other text through its code points,
    counted per distinct value by numpy."""
    if text.isascii():
        return len(text.encode("ascii").translate(None, _ASCII_REJECTS[kind]))
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    values, counts = np.unique(codes, return_counts=True)
    test = getattr(str, kind)
    return sum(n for v, n in zip(values.tolist(), counts.tolist()) if test(chr(v)))


def _multipliers(n: int) -> np.ndarray:
    """n odd 64-bit constants (odd: multiplying by one is a bijection of the 64-bit integers)."""
    return np.array([(0x9E3779B97F4A7C15 * (2 * k + 1)) % (1 << 64) | 1 for k in range(n)], dtype=np.uint64)


def fast_duplicate_ngram_fraction(words: list[str], n: int, total_chars: int | None = None) -> float:
    """duplicate_ngram_fraction without a Python object per n-gram: n-gram i gets the 64-bit key
    sum(hash(words[i+k]) * c_k) (mod 2^64; `hash` is Python's, so equal words hash alike), and
    equal n-grams get equal keys. Sorting the keys finds the shared ones; only those candidates
    are compared as word tuples, so a collision of keys never counts (exact, like the plain
    one). `total_chars` is sum(map(len, words)) when the caller knows it."""
    L = len(words)
    if L < n:
        return 0.0
    hashes = np.fromiter(map(hash, words), dtype=np.int64, count=L).view(np.uint64)
    m, c = L - n + 1, _multipliers(n)
    grams = hashes[:m] * c[0]
    for k in range(1, n):
        grams += hashes[k:k + m] * c[k]  # wraps mod 2^64, as intended
    starts = _repeated_starts(grams, lambda i: tuple(words[i:i + n]))
    if not starts.size:
        return 0.0
    covered = np.flatnonzero(_covered(starts, n, L)).tolist()
    total = sum(map(len, words)) if total_chars is None else total_chars
    return sum(len(words[i]) for i in covered) / total


# Words found in the UTF-8 bytes, without a str object per word (FastMeasures, when it applies)
WIDE_SPACES = "\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
              "\u2028\u2029\u202f\u205f\u3000"  # the non-ASCII characters str.split() splits at
_SOLID = bytes(0 if b < 128 and chr(b).isspace() else 1 for b in range(256))  # 1: a byte inside a word
_LEADS = bytes(0 if 0x80 <= b < 0xC0 else 1 for b in range(256))  # 1: the first byte of a character
_MAX_BYTES = 1 << 16  # longer texts are split into str words


def _powers(base: int) -> np.ndarray:
    out = np.full(_MAX_BYTES + 1, base, dtype=np.uint64)
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
        if N >= _MAX_BYTES:
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

    def gram(self, i: int, n: int) -> tuple[bytes, ...]:
        return tuple(self.raw[s:e] for s, e in zip(self.starts[i:i + n].tolist(), self.ends[i:i + n].tolist()))

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
        starts = _repeated_starts(grams, lambda i: self.gram(i, n))
        if not starts.size:
            return 0.0
        return int(self.lengths[_covered(starts, n, L)].sum()) / total_chars


def _repeated_starts(grams: np.ndarray, gram) -> np.ndarray:
    """Starts of the n-grams that occur more than once, given a 64-bit key per n-gram (equal
    n-grams, equal keys) and `gram(i)`, n-gram i as a tuple: n-grams whose keys collide are
    compared as tuples, so a collision never counts."""
    order = np.argsort(grams)
    ranked = grams[order]
    same = ranked[1:] == ranked[:-1]
    if not same.any():
        return np.zeros(0, dtype=np.int64)
    shared = np.zeros(len(grams), dtype=bool)  # in sorted order: a key equal to a neighbour's
    shared[1:] = same
    shared[:-1] |= same
    candidates = order[shared].tolist()
    tuples = [gram(i) for i in candidates]
    counts = collections.Counter(tuples)
    return np.array([i for i, g in zip(candidates, tuples) if counts[g] > 1], dtype=np.int64)


def _covered(starts: np.ndarray, n: int, length: int) -> np.ndarray:
    """(length,) bool: the words inside at least one of the n-grams starting at `starts`."""
    edges = np.zeros(length + 1, dtype=np.int64)  # +1 where a repeated n-gram starts, -1 after it ends
    edges[starts] += 1  # the starts are distinct positions
    edges[starts + n] -= 1
    return np.cumsum(edges[:length]) > 0


_BULLET_CHARS = "".join(BULLETS)  # every bullet is one character: a line's first one says it
_ELLIPSIS_ENDS = "".join({e[-1] for e in ELLIPSES})  # the last characters an ellipsis can end with


class Measures:
    """What the rules compare with their thresholds, for one text, each by the plain function
    above (the reference); computed when a rule asks, so a rule that is off costs nothing."""

    def __init__(self, text: str) -> None:
        self.text = text

    @functools.cached_property
    def words(self) -> list[str]:
        return self.text.split()

    @functools.cached_property
    def lines(self) -> list[str]:
        return self.text.splitlines()

    def word_count(self) -> int:
        return len(self.words)

    def mean_word_length(self) -> float:
        return mean_word_length(self.words)

    def symbol_ratio(self) -> float:
        return symbol_ratio(self.text, self.words)

    def bullet_lines(self) -> float:
        return line_share(self.lines, lambda ln: ln.startswith(BULLETS))

    def ellipsis_lines(self) -> float:
        return line_share(self.lines, lambda ln: ln.endswith(ELLIPSES))

    def duplicate_lines(self) -> float:
        return duplicate_line_fraction(self.lines)

    def duplicate_ngrams(self, n: int) -> float:
        return duplicate_ngram_fraction(self.words, n)

    def alpha_share(self) -> float:
        return alpha_share(self.text)

    def alnum_share(self) -> float:
        return alnum_share(self.text)


class FastMeasures(Measures):
    """The same numbers, equal to the last bit (tests/test_data_filters.py), in fewer passes, most
    of them loops in C: the non-empty stripped lines made once (a bullet line told by its first
    character), duplicates as len - len(set), characters by count_chars (the words' characters
    are the non-space ones), the words found in the UTF-8 bytes (ByteWords: no str per word) and
    their repeated n-grams from 64-bit keys; a text ByteWords does not take is split, its n-grams
    by fast_duplicate_ngram_fraction. What `prepare` uses."""

    @functools.cached_property
    def kept_lines(self) -> list[str]:
        return list(filter(None, map(str.strip, self.lines)))

    @functools.cached_property
    def non_space(self) -> int:
        return len(self.text) - count_chars(self.text, "isspace")

    @functools.cached_property
    def byte_words(self) -> ByteWords | None:
        return ByteWords.of(self.text)

    def word_count(self) -> int:
        return len(self.words) if self.byte_words is None else len(self.byte_words.keys)

    def mean_word_length(self) -> float:  # the words are the runs of non-space characters
        count = self.word_count()
        return self.non_space / count if count else 0.0

    def symbol_ratio(self) -> float:
        symbols = self.text.count("#") + self.text.count("...") + self.text.count("…")
        return symbols / max(self.word_count(), 1)

    def bullet_lines(self) -> float:
        kept = self.kept_lines  # non-empty: s[0] exists
        return sum(1 for s in kept if s[0] in _BULLET_CHARS) / len(kept) if kept else 0.0

    def ellipsis_lines(self) -> float:
        kept = self.kept_lines
        return sum(1 for s in kept if s[-1] in _ELLIPSIS_ENDS and s.endswith(ELLIPSES)) / len(kept) if kept else 0.0

    def duplicate_lines(self) -> float:
        kept = self.kept_lines
        return (len(kept) - len(set(kept))) / len(kept) if kept else 0.0

    def duplicate_ngrams(self, n: int) -> float:
        if self.byte_words is not None:
            return self.byte_words.duplicate_ngram_fraction(n, self.non_space)
        return fast_duplicate_ngram_fraction(self.words, n, self.non_space)

    def alpha_share(self) -> float:
        return count_chars(self.text, "isalpha") / self.non_space if self.non_space else 0.0

    def alnum_share(self) -> float:
        return count_chars(self.text, "isalnum") / len(self.text) if self.text else 0.0
