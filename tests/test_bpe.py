"""BPE training: hand-computable merges, the fast trainer against a recount-everything reference,
id layout, special tokens, determinism across workers, input handling and errors."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from logitlab.tokenizer import pretokenize as bpe_pretokenize
from logitlab.tokenizer.bpe import ShortVocabularyWarning, learn_merges, reference_merges, train_bpe, train_tokenizer
from logitlab.tokenizer.core import GPT2_PATTERN, Tokenizer
from logitlab.tokenizer.pretokenize import count_pretokens

EOT = "<|endoftext|>"
WS = r"\S+|\s+"  # whitespace pre-tokenization for hand-computed examples


def test_classic_example_merges(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("low low low low low lower lower widest widest widest "
                    "newest newest newest newest newest newest")
    vocab, merges = train_bpe(path, 256 + 1 + 6, [EOT], pattern=WS, workers=1)
    # Counts: "es" and "st" are both 9 (3 widest + 6 newest); the tie goes to the greater pair
    # ("s", "t"). Then ("e", "st") 9; ("o", "w") and ("l", "o") are both 7, ("o", "w") wins;
    # ("l", "ow") 7; ("w", "est") 9; ("n", "e") 6 ties ("e", "w") 6 and ("n", "e") wins.
    assert merges == [(b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"), (b"w", b"est"), (b"n", b"e")]
    assert [vocab[i] for i in range(256, 262)] == [b"st", b"est", b"ow", b"low", b"west", b"ne"]
    assert vocab[262] == EOT.encode() and len(vocab) == 263
    assert all(vocab[i] == bytes([i]) for i in range(256))


def test_ties_go_to_the_greatest_pair():
    merges = learn_merges({b"ab": 1, b"cd": 1, b"ce": 1, b"b": 5}, 3)
    assert merges == [(b"c", b"e"), (b"c", b"d"), (b"a", b"b")]
    # (b"a", b"bc") vs (b"ab", b"c"): lexicographic on the left part first
    assert learn_merges({b"xyz": 2}, 1) == [(b"y", b"z")]


words = st.dictionaries(st.binary(min_size=1, max_size=7).map(lambda b: bytes(x % 3 + 97 for x in b)),
                        st.integers(1, 5), max_size=12)


@settings(max_examples=120, deadline=None)
@given(word_counts=words, n=st.integers(1, 12))
def test_fast_trainer_equals_reference(word_counts, n):
    """Overlaps like "aaaa" and ties are common with a three-letter alphabet."""
    assert learn_merges(word_counts, n) == reference_merges(word_counts, n)


def test_fast_trainer_equals_reference_on_prose(shared_data):
    text = (shared_data / "corpus.en").read_text(encoding="utf-8")[:20_000]
    counts = Counter(t.encode() for t in regex.findall(GPT2_PATTERN, text))
    assert learn_merges(counts, 120) == reference_merges(counts, 120)


def test_special_tokens_never_merged(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text(("hello world" + EOT) * 200 + ("<|x|>ab" + EOT) * 50)
    vocab, merges = train_bpe(path, 266, [EOT, "<|x|>"], workers=1)
    assert len(merges) == 8 and vocab[264] == EOT.encode() and vocab[265] == b"<|x|>"
    for a, b in merges:
        assert b"<" not in a + b and b"|" not in a + b, (a, b)  # those bytes only occur in specials
    tok = train_tokenizer(path, 266, [EOT, "<|x|>"], workers=1)
    assert tok.special_tokens == {EOT: 264, "<|x|>": 265}
    assert tok.decode(tok.encode("hello world" + EOT)) == "hello world" + EOT


def test_workers_give_identical_merges(shared_data, tmp_path, monkeypatch):
    monkeypatch.setattr(bpe_pretokenize, "CHUNK_CHARS", 50_000)  # many chunks and batches
    monkeypatch.setattr(bpe_pretokenize, "MIN_BYTES_PER_WORKER", 0)  # really use two processes
    files = [shared_data / "tinyshakespeare.txt", shared_data / "corpus.en"]
    one = train_bpe(files, 700, [EOT], workers=1)
    two = train_bpe(files, 700, [EOT], workers=2)
    assert one == two
    folder = tmp_path / "folder"
    folder.mkdir()
    for f in files:
        (folder / f.name).write_bytes(f.read_bytes())
    assert train_bpe(folder, 700, [EOT], workers=2) == one


def test_chunking_does_not_change_pretokens(shared_data, monkeypatch):
    path = shared_data / "tinyshakespeare.txt"
    text = path.read_text(encoding="utf-8")
    for pattern in (GPT2_PATTERN, "cl100k"):
        from logitlab.tokenizer.core import resolve_pattern

        want = Counter(regex.findall(resolve_pattern(pattern), text))
        monkeypatch.setattr(bpe_pretokenize, "CHUNK_CHARS", 3_000)
        assert count_pretokens([path], resolve_pattern(pattern), [], workers=1) == want
        monkeypatch.undo()


def test_trained_vocabulary_is_tiktoken_consistent(shared_data):
    tok = train_tokenizer(shared_data / "corpus.en", 1500, [EOT], workers=1)
    assert tok.vocab_size == 1500 and len(tok.merges) == 1500 - 257
    assert tok.fast_path_ok
    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:100_000]
    assert tok.encode(text) == tok.encode(text, fast=False)


@pytest.fixture(scope="module")
def trained(shared_data) -> Tokenizer:
    return train_tokenizer(shared_data / "tinyshakespeare.txt", 2000, [EOT], workers=1)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(text=st.lists(st.one_of(st.text(max_size=16), st.sampled_from(
    [EOT, " the", "ing ", "\u0301", "\n\n", "  ", "'ll", "🎉", "\u088f'll", "x\U000323b0"])), max_size=10).map("".join))
def test_trained_tokenizer_both_encoders_agree(trained, text):
    ids = trained.encode(text)
    assert ids == trained.encode(text, fast=False)
    assert trained.decode(ids) == text
    assert trained.encode_ordinary(text, fast=False) == trained.encode_ordinary(text)


def test_training_errors(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("some text")
    with pytest.raises(ValueError, match=r"vocab_size \(257\) must be at least 256 \+ 2"):
        train_bpe(path, 257, [EOT, "<|x|>"])
    with pytest.raises(ValueError, match="non-empty"):
        train_bpe(path, 300, [""])
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        train_bpe(tmp_path / "nope.txt", 300)
    with pytest.raises(ValueError, match="not a valid regex"):
        train_bpe(path, 300, pattern="[")


def test_non_utf8_training_file_warns_with_file_and_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf".encode() + b"\xe9 ok " * 3 + b"fine")
    with pytest.warns(UnicodeWarning, match=r"latin1\.txt: invalid UTF-8 at byte offset 3"):
        vocab, merges = train_bpe(path, 260, [], workers=1)
    assert len(vocab) == 260


def test_bytes_only_corpus_stops_when_no_pairs(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("a b")
    with pytest.warns(ShortVocabularyWarning, match=r"learned 1 of the 43 merges .* has 258 ids, not 300"):
        vocab, merges = train_bpe(path, 300, [EOT], workers=1)
    assert merges == [(b" ", b"b")] and len(vocab) == 258 and vocab[257] == EOT.encode()


def test_empty_corpus_is_refused_and_a_short_one_warns(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError, match="empty.txt holds no text to learn merges from"):
        train_tokenizer(path, 300, [EOT], workers=1)
    path = tmp_path / "short.txt"
    path.write_text("abab")                                # one merge to learn, then nothing
    with pytest.warns(ShortVocabularyWarning) as caught:
        tok = train_tokenizer(path, 300, [EOT], workers=1)
    assert len(caught) == 1 and tok.vocab_size < 300
    message = str(caught[0].message)
    assert "of the 43 merges that vocab_size 300 asks for" in message
    assert "(1 file(s), 4 bytes)" in message and f"the tokenizer has {tok.vocab_size} ids, not 300" in message


def test_full_vocabulary_does_not_warn(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello hello world " * 50)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortVocabularyWarning)
        vocab, _ = train_bpe(path, 262, [EOT], workers=1)
    assert len(vocab) == 262


def test_progress_bar_runs(tmp_path, capsys):
    path = tmp_path / "a.txt"
    path.write_text("hello hello world " * 50)
    events = []
    vocab, _ = train_bpe(path, 262, [EOT], workers=1, progress=lambda *event: events.append(event))
    assert len(vocab) == 262
    assert events[0] == ("pretokenize", 0, path.stat().st_size) and events[-1] == ("merge", 5, 5)
    assert not capsys.readouterr().out  # the library reports through the callback; it never prints


def test_duplicate_merge_results_use_the_reference_path():
    """Two merges may give the same bytes (HF-style: the second reuses the first's id)."""
    vocab = {i: bytes([i]) for i in range(256)}
    vocab.update({256: b"ab", 257: b"bc", 258: b"abc"})
    merges = [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"a", b"bc")]
    tok = Tokenizer(vocab, merges)
    assert tok.vocab_size == 259 and not tok.fast_path_ok
    assert tok.encode("abc abcd bcx") == tok.encode("abc abcd bcx", fast=False) == [258, 32, 258, 100, 32, 257, 120]


@pytest.mark.slow
def test_stdlib_32k_vocabulary_both_encoders_agree():
    from logitlab.tokenizer.bpe import stdlib_files

    files = stdlib_files()
    tok = train_tokenizer(files, 32_000, [EOT])
    assert tok.vocab_size == 32_000 and tok.fast_path_ok
    text = "".join(f.read_text(encoding="utf-8", errors="replace") for f in files[::3])[:10_000_000]
    assert tok.encode(text) == tok.encode(text, fast=False)
