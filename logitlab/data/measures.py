"""What the cleaning rules measure: for one document, each number a rule of filters.py compares
with its threshold.

measures.py owns three ways to get them. The plain functions (mean_word_length, line_share,
duplicate_ngram_fraction, alpha_share, ...) are the reference: one obvious loop each, the
definitions of Gopher (Rae et al. 2021, appendix A) checkable by eye. `FastMeasures` computes the
same numbers, equal to the last bit (tests/test_data_filters.py), with the loops inside Python's
and numpy's own C: str methods over whole lists, bytes.translate, numpy. `NativeMeasures` takes
them from the compiled extension _text_fast.c (built at install when a C compiler is present;
setup.py): one pass over the str's code points for every count, a second for the repeated
n-grams (tests/test_data_native.py checks it against the plain functions). `prepare` uses
`default_measures()`: the native one when built, else FastMeasures; a Python loop per character
(the alphabetic share) or per n-gram costs more than encoding the text. `Measures` gives the plain
numbers through the same interface, so the rules run unchanged on any of them. Words are the
whitespace-separated tokens of str.split(). It imports nothing from logitlab.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import numpy as np

from logitlab.data.bytewords import ByteWords, covered_words, repeated_starts

try:  # compiled from _text_fast.c at install when a C compiler is present (setup.py: optional extension)
    from logitlab.data import _text_fast as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

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
    starts = repeated_starts(grams, lambda firsts: [tuple(words[i:i + n]) for i in firsts.tolist()])
    if not starts.size:
        return 0.0
    covered = np.flatnonzero(covered_words(starts, n, L)).tolist()
    total = sum(map(len, words)) if total_chars is None else total_chars
    return sum(len(words[i]) for i in covered) / total


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

    def longest_line(self) -> int:
        return max(map(len, self.lines), default=0)


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
    def non_space(self) -> int:  # the words' characters
        if self.byte_words is not None:
            return int(self.byte_words.lengths.sum())
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


# --------------------------------------------------------------------------------------------
# The same measurements from the compiled extension (_text_fast.c), when the install built it
# --------------------------------------------------------------------------------------------

def native_available() -> bool:
    """Whether the compiled measurements (logitlab.data._text_fast) were built by this install."""
    return _native is not None


def default_measures() -> type[Measures]:
    """What the rules measure with unless told: NativeMeasures when built, else FastMeasures."""
    return NativeMeasures if _native is not None else FastMeasures


class TextCounts(NamedTuple):
    """_text_fast.text_counts(text): every count the rules divide, for one text."""

    words: int  # len(text.split())
    non_space: int  # characters not str.isspace: the words' characters
    symbols: int  # text.count("#") + text.count("...") + text.count("…")
    lines: int  # non-empty stripped lines of text.splitlines()
    bullet_lines: int  # of those, the ones starting with a BULLETS character
    ellipsis_lines: int  # ... ending with one of ELLIPSES
    duplicate_lines: int  # ... equal to an earlier one
    alpha: int  # characters passing str.isalpha (none is also a space)


class NativeMeasures(FastMeasures):
    """The same numbers, equal to the last bit (tests/test_data_native.py): every count of the
    Gopher rules and the alphabetic share from one pass of _text_fast.c over the str's code
    points (classed by CPython's own Unicode tables, the ones str.split, str.strip, str.splitlines
    and str.isalpha use, so any text qualifies), the repeated n-grams' characters from a second
    pass, and each share the same int / int division as the plain function's. The code rules'
    numbers are FastMeasures' (bytes.translate and str.splitlines: already one C loop each). What
    `prepare` uses when the extension is built."""

    @functools.cached_property
    def counts(self) -> TextCounts:
        return TextCounts._make(_native.text_counts(self.text))

    def word_count(self) -> int:
        return self.counts.words

    def mean_word_length(self) -> float:
        c = self.counts
        return c.non_space / c.words if c.words else 0.0

    def symbol_ratio(self) -> float:
        return self.counts.symbols / max(self.counts.words, 1)

    def _line_share(self, count: int) -> float:
        return count / self.counts.lines if self.counts.lines else 0.0

    def bullet_lines(self) -> float:
        return self._line_share(self.counts.bullet_lines)

    def ellipsis_lines(self) -> float:
        return self._line_share(self.counts.ellipsis_lines)

    def duplicate_lines(self) -> float:
        return self._line_share(self.counts.duplicate_lines)

    def duplicate_ngrams(self, n: int) -> float:
        c = self.counts
        if c.words < n or not c.non_space:
            return 0.0
        return _native.duplicate_ngram_chars(self.text, n) / c.non_space

    def alpha_share(self) -> float:
        return self.counts.alpha / self.counts.non_space if self.counts.non_space else 0.0
