"""The compiled BPE paths (_bpe_fast.c) against the Python ones: identical merges (ties and
overlaps included), identical pre-token counts, and a clean fallback when the extension is absent."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from logitlab.tokenizer import bpe
from logitlab.tokenizer import pretokenize as bpe_pretokenize
from logitlab.tokenizer.bpe import learn_merges, learn_merges_python, native_available, reference_merges, train_bpe
from logitlab.tokenizer.core import GPT2_PATTERN, resolve_pattern
from logitlab.tokenizer.patterns import pretokenizer
from logitlab.tokenizer.pretokenize import count_part, count_pretokens

needs_native = pytest.mark.skipif(not native_available(), reason="logitlab.tokenizer._bpe_fast is not built "
                                  "(no C compiler at install); the Python paths are tested in test_bpe.py")
EOT = "<|endoftext|>"

words = st.dictionaries(st.binary(min_size=1, max_size=9).map(lambda b: bytes(x % 3 + 97 for x in b)),
                        st.integers(1, 6), max_size=14)


@needs_native
@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(word_counts=words, n=st.integers(0, 16))
def test_native_merges_equal_python_and_reference(word_counts, n):
    """A three-letter alphabet makes ties and overlapping runs ("aaaa") common."""
    native = learn_merges(word_counts, n, native=True)
    assert native == learn_merges_python(word_counts, n) == reference_merges(word_counts, n)


@needs_native
def test_native_ties_go_to_the_greatest_pair():
    assert learn_merges({b"ab": 1, b"cd": 1, b"ce": 1, b"b": 5}, 3, native=True) == [(b"c", b"e"), (b"c", b"d"),
                                                                                     (b"a", b"b")]
    # a prefix sorts before the longer string: (b"a", b"b") < (b"a", b"bc") < (b"ab", b"c")
    assert learn_merges({b"xyz": 2}, 1, native=True) == [(b"y", b"z")]
    assert learn_merges({b"\xff\x00": 1, b"\xff": 3, b"\x00\xff": 1}, 1, native=True) == [(b"\xff", b"\x00")]


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_native_merges_equal_python_on_random_corpora(seed):
    """Zipf-like word frequencies over a small alphabet, long words, many merges: ties at every count."""
    rng = random.Random(seed)
    alphabet = [b"a", b"b", b"c", b" ", b"\xc3\xa9", b"\x00", b"\xff"][: 3 + seed]
    counts = {b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))): max(1, int(50 / (i + 1)))
              for i in range(400)}
    assert learn_merges(counts, 300, native=True) == learn_merges_python(counts, 300)
    assert learn_merges(counts, 300, first_id=1000, native=True) == learn_merges_python(counts, 300, first_id=1000)


@needs_native
@pytest.mark.parametrize("name", ["corpus.en", "tinyshakespeare.txt", "tinystories_sample.txt"])
def test_native_merges_equal_python_on_prose(shared_data, name):
    text = (shared_data / name).read_text(encoding="utf-8")[:150_000]
    counts = Counter(t.encode() for t in regex.findall(GPT2_PATTERN, text))
    n = 1000
    assert learn_merges(counts, n, native=True) == learn_merges_python(counts, n)


@needs_native
def test_native_merges_report_progress_and_stop_when_no_pairs():
    events = []
    assert learn_merges({b"ab": 2, b"a": 1}, 5, native=True, progress=events.append) == [(b"a", b"b")]
    assert events == [1]
    assert learn_merges({}, 5, native=True) == [] and learn_merges({b"abc": 1}, 0, native=True) == []


ascii_text = st.text(alphabet=st.sampled_from(list("ab Z09'srtvelmd.,!\t\n\x0b\x0c\r\x1c\x1f\x00_-")), max_size=60)


@needs_native
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=ascii_text)
def test_native_ascii_splitter_equals_the_gpt2_regex(text):
    """\\x1c-\\x1f are not whitespace for `regex` (they are for `re`): the C classes follow `regex`."""
    counts: Counter = Counter()
    bpe_pretokenize._count_ascii_gpt2(text, counts)
    assert counts == Counter(regex.findall(GPT2_PATTERN, text))


mixed_text = st.lists(st.one_of(ascii_text, st.text(max_size=6), st.sampled_from(
    ["é", "日本", "\u0301", "🎉", "\u00a0", "\u2028", " x\U000323b0", "  \n", "'ll"])), max_size=12).map("".join)


@needs_native
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(text=mixed_text)
def test_native_counting_equals_python_on_mixed_text(text):
    split = pretokenizer(GPT2_PATTERN)
    native, plain = Counter(), Counter()
    count_part(text, native, split, True)
    count_part(text, plain, split, False)
    assert native == plain == Counter(split(text))


@needs_native
def test_native_counting_rejects_non_ascii_and_keeps_existing_counts():
    with pytest.raises(ValueError, match="pure-ASCII"):
        bpe_pretokenize._count_ascii_gpt2("café", {})
    counts = Counter({" a": 2})
    bpe_pretokenize._count_ascii_gpt2(" a a", counts)
    assert counts == {" a": 4}


@needs_native
def test_native_count_pretokens_equal_python(shared_data, tmp_path, monkeypatch):
    monkeypatch.setattr(bpe_pretokenize, "CHUNK_CHARS", 20_000)
    sparse = tmp_path / "sparse.txt"
    sparse.write_text(("plain ascii text, mostly; " * 300 + "café naïve 日本語\n") * 20, encoding="utf-8")
    files = [shared_data / "tinyshakespeare.txt", shared_data / "corpus.en", sparse]
    pattern = resolve_pattern("gpt2")
    assert count_pretokens(files, pattern, [EOT], workers=1, native=True) == \
        count_pretokens(files, pattern, [EOT], workers=1, native=False)


def test_native_request_is_checked():
    with pytest.raises(ValueError, match="native=True needs the GPT-2 pattern"):
        count_pretokens([], resolve_pattern("cl100k"), [], native=True)
    if not native_available():
        with pytest.raises(ValueError, match="not built"):
            learn_merges({b"ab": 1}, 1, native=True)


def test_training_without_the_extension_gives_the_same_result(shared_data, monkeypatch):
    """An install without a C compiler falls back to the Python paths, with identical output."""
    path = shared_data / "corpus.en"
    default = train_bpe(path, 800, [EOT], workers=1)
    monkeypatch.setattr(bpe, "_native", None)
    monkeypatch.setattr(bpe_pretokenize, "_count_ascii_gpt2", None)
    assert not native_available() and not bpe_pretokenize.native_counting(GPT2_PATTERN)
    assert train_bpe(path, 800, [EOT], workers=1) == default
