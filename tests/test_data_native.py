"""The compiled text passes (data/_text_fast.c) against the plain Python definitions: identical
counts, shares, n-gram fractions and keep/drop decisions on any text (CJK, emoji, every kind of
whitespace and line break, lone surrogates, empty), hashes that collide never counting, the same
exact-dedup bytes, and the route: NativeMeasures when built, FastMeasures when not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logitlab.data import dedup as dd
from logitlab.data import filters as flt
from logitlab.data import measures as ms

needs_native = pytest.mark.skipif(not ms.native_available(), reason="logitlab.data._text_fast is not built (no C "
                                  "compiler at install); the Python paths are tested in test_data_filters.py")

SPACES = "".join(c for c in map(chr, range(0x110000)) if c.isspace())  # ASCII, \x1c-\x1f, \x85, \u2028, \u3000...
PIECES = ["a", "bb", "the", "The", "word", "中文", "字", "😀", "👍🏽", "é", "ǅ", "١٢", "²", "_", "#", ".", "..", "...",
          "…", "-", "•", "●", "*", "‣", "◦", "–", "\ud800", "\x00", "x\x1cy", "\r\n", "\r", "\n"]
PIECES += list(SPACES)


def _text(pieces: list[str]) -> str:
    return "".join(pieces)


texts = st.lists(st.sampled_from(PIECES), max_size=80).map(_text)
small_vocab = st.lists(st.sampled_from(["ab", "ba", "ab ", " ", "\n", "中", "😀", "ab\n", "- x\n", "x...\n"]),
                       max_size=120).map(_text)  # few distinct words and lines: many repeats


def plain_counts(text: str) -> tuple:
    """text_counts' numbers from the plain Python definitions."""
    words, lines = text.split(), text.splitlines()
    kept = [ln.strip() for ln in lines if ln.strip()]
    return (len(words), sum(map(len, words)), text.count("#") + text.count("...") + text.count("…"), len(kept),
            sum(ln.startswith(ms.BULLETS) for ln in kept), sum(ln.endswith(ms.ELLIPSES) for ln in kept),
            len(kept) - len(set(kept)), sum(c.isalpha() for c in text))


def _assert_native_equals_plain(text: str, mask: int | None = None) -> None:
    args = () if mask is None else (mask,)
    assert ms._native.text_counts(text, *args) == plain_counts(text), text[:60]
    words = text.split()
    for n in range(1, 11):
        covered = ms._native.duplicate_ngram_chars(text, n, *args)
        total = sum(map(len, words))
        fraction = covered / total if total and len(words) >= n else 0.0
        assert fraction == ms.duplicate_ngram_fraction(words, n), (n, text[:60])


@needs_native
def test_the_constants_are_measures():
    assert ms._native.BULLETS == "".join(ms.BULLETS) and ms._native.ELLIPSES == ms.ELLIPSES


@needs_native
@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(texts)
def test_counts_and_ngrams_equal_the_plain_definitions(text):
    _assert_native_equals_plain(text)


@needs_native
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(small_vocab)
def test_hashes_that_collide_never_count(text):
    """mask 0: every word, n-gram and line hash is 0, so only the comparisons of the characters decide."""
    _assert_native_equals_plain(text, mask=0)


@needs_native
@pytest.mark.parametrize("text", ["", " ", "\n\n", "\r\n", "a", "... .... ...... …", "#", "•", "- x\n- x\n  - x  \n",
                                  "中文 字 中文 字 中文 字 中文 字", "😀 x 😀 x 😀 x", "\ud800 a \ud800 a \ud800 a",
                                  "line\u2028split\x85and\x1cmore\u2029", "a\u3000b a\u3000b a\u3000b",
                                  "end..\nend...\nend…\n...\n", "word " * (1 << 14)])
def test_edge_cases(text):
    _assert_native_equals_plain(text)


@needs_native
def test_every_code_point_is_classed_as_python_classes_it():
    every = "".join(map(chr, range(0x110000)))  # surrogates included: corpus text may hold lone ones
    assert ms._native.text_counts(every) == plain_counts(every)
    spaced = " ".join(every[i:i + 7] for i in range(0, len(every), 7))
    assert ms._native.text_counts(spaced) == plain_counts(spaced)


MEASURE_NAMES = ("word_count", "mean_word_length", "symbol_ratio", "bullet_lines", "ellipsis_lines", "duplicate_lines",
                 "alpha_share", "alnum_share", "longest_line")
CONFIGS = (flt.FilterConfig(), flt.FilterConfig(min_words=3, max_symbol_ratio=0.5, max_duplicate_lines=0.5,
                                                duplicate_ngram_size=2, code_sources=("c",)),
           flt.FilterConfig(min_words=1, min_alpha_share=0.2, max_duplicate_ngrams=0.3, duplicate_ngram_size=1))


@needs_native
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.one_of(texts, small_vocab))
def test_native_measures_and_decisions_equal_the_plain_ones(text):
    plain, native = ms.Measures(text), ms.NativeMeasures(text)
    for name in MEASURE_NAMES:
        assert getattr(native, name)() == getattr(plain, name)(), name
    for n in (1, 2, 5, 10):
        assert native.duplicate_ngrams(n) == plain.duplicate_ngrams(n)
    for cfg in CONFIGS:
        for source in ("web", "c"):
            reason = flt.document_reason(text, source, cfg, ms.Measures)
            assert flt.document_reason(text, source, cfg, ms.NativeMeasures) == reason
            assert flt.document_reason(text, source, cfg, ms.FastMeasures) == reason


@needs_native
def test_argument_errors():
    with pytest.raises(ValueError, match="n-gram size must be >= 1, got 0"):
        ms._native.duplicate_ngram_chars("a b", 0)
    with pytest.raises(TypeError):
        ms._native.text_counts(b"bytes")
    with pytest.raises(ValueError, match="ASCII"):
        ms._native.ascii_normalised("café")


@needs_native
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from([chr(i) for i in range(128)] + ["  ", "\t\n", "AbC"]), max_size=60).map(_text))
def test_ascii_normalised_equals_normalise(text):
    assert ms._native.ascii_normalised(text) == dd.ascii_normalised(text) == dd.normalise(text).encode("utf-8")


@needs_native
def test_exact_hash_is_the_same_without_the_extension(monkeypatch):
    docs = ["  Hello\tWORLD \x1c again\n", "", "   ", "Ünïcode  TEXT", "a" * 10_000 + "\n\n b"]
    native = [dd.exact_hash(t) for t in docs]
    monkeypatch.setattr(dd, "_native_ascii_normalised", None)
    assert [dd.exact_hash(t) for t in docs] == native


def test_the_route_is_native_when_built_and_python_otherwise(monkeypatch):
    expected = ms.NativeMeasures if ms.native_available() else ms.FastMeasures
    assert ms.default_measures() is expected
    monkeypatch.setattr(ms, "_native", None)  # what an install without a C compiler has
    assert not ms.native_available() and ms.default_measures() is ms.FastMeasures
    seen = []
    monkeypatch.setattr(ms.FastMeasures, "word_count", lambda self: seen.append(self) or 0)
    assert flt.document_reason("a few words here", "web", flt.FilterConfig()) == "gopher.word_count"
    assert len(seen) == 1  # the default measurements came from FastMeasures
