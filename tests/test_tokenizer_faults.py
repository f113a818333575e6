"""Tokenizer faults: split patterns that would lose text, the reference BPE on long runs, ids that
are not integers, and writers that must not replace what they did not write."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logitlab.tokenizer import formats as tokenizer_formats
from logitlab.tokenizer.bpe import BPEConfig, train_bpe
from logitlab.tokenizer.core import CL100K_PATTERN, GPT2_PATTERN, Tokenizer
from logitlab.tokenizer.patterns import COVERAGE_PROBES, pretokenizer

BYTES = {i: bytes([i]) for i in range(256)}
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def gpt2(gpt2_files) -> Tokenizer:
    return Tokenizer.from_gpt2_files(*gpt2_files)


# ------------------------------------------------------------------------------ split coverage
def test_pattern_that_drops_text_is_refused_with_an_example():
    with pytest.raises(ValueError) as info:
        Tokenizer(BYTES, [], pattern=r"\w+")
    assert str(info.value) == (r"split pattern '\w+' does not cover the input: "
                               r"it drops ', ' and '!' from 'hello, world!'")


def test_pattern_that_drops_text_is_refused_before_training(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello, world!")
    with pytest.raises(ValueError, match="does not cover the input"):
        BPEConfig(300, pattern=r"\w+")
    with pytest.raises(ValueError, match=r"drops ', ' and '!'"):
        train_bpe(path, 300, pattern=r"[a-z]+", workers=1)


@pytest.mark.parametrize("pattern, dropped", [
    (r"\S+", r"' '"),                               # whitespace
    (r"\p{L}+|\p{N}+|\s+|[!-~]+", r"'—'"),         # non-ASCII punctuation
    (r"[^\n]+", r"'\n"),                            # newlines
    (r"[\x00-\uffff]+", "'🎉"),                      # outside the BMP
])
def test_probes_catch_each_kind_of_gap(pattern, dropped):
    with pytest.raises(ValueError, match="does not cover the input") as info:
        Tokenizer(BYTES, [], pattern=pattern)
    assert dropped in str(info.value)


def test_built_in_patterns_cover_every_probe():
    for pattern in (GPT2_PATTERN, CL100K_PATTERN):
        split = pretokenizer(pattern)
        for probe in COVERAGE_PROBES:
            assert "".join(split(probe)) == probe and all(split(probe))


def test_empty_matches_are_refused():
    """tiktoken cannot encode an empty piece (its core panics), so such a pattern is refused."""
    with pytest.raises(ValueError, match=r"split pattern '\\w\*\|\\W' matches the empty string"):
        Tokenizer(BYTES, [], pattern=r"\w*|\W")


def test_capture_groups_take_the_whole_match():
    """Pieces are whole matches (group 0), as tiktoken and HF take them; the groups are ignored."""
    vocab = {**BYTES, 256: b"ab"}
    tok = Tokenizer(vocab, [(b"a", b"b")], pattern=r"(\w+)|(\W+)")
    tok_plain = Tokenizer(vocab, [(b"a", b"b")], pattern=r"\w+|\W+")
    for text in ("ab, cab!", "naïve café 🎉\n"):
        want = tok_plain.encode(text)
        assert tok.encode(text) == tok.encode(text, fast=False) == want
        assert tok.decode(want) == text
    assert pretokenizer(r"(a)(b)|[^a]|a")("abxa") == ["ab", "x", "a"]
    with pytest.raises(ValueError, match=r"split pattern '\(\\w\+\)\|\(\\s\+\)' does not cover the input"):
        Tokenizer(BYTES, [], pattern=r"(\w+)|(\s+)")


# A pattern that covers every probe but drops U+1F300 (a character no probe holds).
SLY = r"[a-z]+|[^a-z\U0001F300]+"


@pytest.mark.parametrize("fast", [True, False])
def test_runtime_check_names_the_dropped_text(fast):
    tok = Tokenizer(BYTES, [], special_tokens=[EOT], pattern=SLY)
    assert tok.encode("ab 🎉 c", fast=fast) == list("ab 🎉 c".encode())
    with pytest.raises(ValueError, match="it drops '🌀' from 'ab 🌀 c'"):
        tok.encode("ab 🌀 c", fast=fast)
    with pytest.raises(ValueError, match="drops '🌀'"):
        tok.encode(f"x{EOT}ab 🌀 c", fast=fast)
    long_text = "word " * 100 + "🌀"
    with pytest.raises(ValueError, match=r"it drops '🌀' from a text of 501 characters \(the first at character 500\)"):
        tok.encode(long_text, fast=fast)


def test_training_never_drops_text_silently(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("plain words 🌀 and more\n")
    with pytest.raises(ValueError, match="drops '🌀'"):
        train_bpe(path, 300, pattern=SLY, workers=1)


# ------------------------------------------------------------------------------ reference BPE
class CountingDict(dict):
    """A pair table that counts its look-ups."""

    calls = 0

    def get(self, key, default=None):
        self.calls += 1
        return super().get(key, default)


def _letters(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)).encode()


def test_reference_bpe_work_grows_linearly(gpt2):
    """Pair look-ups for one pre-token of n and of 4n letters: about 4x for the heap merge (at most
    n - 1 to start plus two per merge), about 16x for a rescan-everything merge."""
    counting = CountingDict(gpt2._pair_rank)
    original, gpt2._pair_rank = gpt2._pair_rank, counting
    try:
        calls = []
        for n in (2_000, 8_000):
            counting.calls = 0
            ids = gpt2._bpe(_letters(n, seed=n))
            calls.append(counting.calls)
            assert counting.calls <= 3 * n and gpt2.decode(ids).encode() == _letters(n, seed=n)
    finally:
        gpt2._pair_rank = original
    assert calls[1] < 4.5 * calls[0], calls  # a rescan-everything merge: 660k and 5.0M look-ups


def test_long_run_without_a_split_reference_equals_fast(gpt2):
    """160k letters with no space: one pre-token. The reference path used to take ~30 s here."""
    text = _letters(160_000, seed=1).decode()
    assert gpt2.encode(text, fast=False) == gpt2.encode(text)
    rng = random.Random(2)
    mixed = "".join(rng.choice(["ab", "the", "ing", "é", "中", "1", "!!", "🎉"]) for _ in range(20_000))
    assert gpt2.encode(mixed, fast=False) == gpt2.encode(mixed)


def test_heap_bpe_equals_plain_bpe_on_gpt2(gpt2):
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 100, 1000):
        for _ in range(20):
            data = "".join(rng.choice("abcab e\u00e9\u4e2d ll'") for _ in range(n)).encode()
            assert gpt2._bpe(data) == gpt2._bpe_plain(data)


def test_one_rank_is_merged_everywhere_before_the_merges_it_enables():
    """(a, b) has rank 1 and (ab, a) rank 0: "abab" merges both (a, b) first, as the plain rule
    does, although the first merge alone would let the lower-ranked (ab, a) take the middle."""
    tok = Tokenizer({**BYTES, 256: b"aba", 257: b"ab"}, [(b"ab", b"a"), (b"a", b"b")])
    assert tok._bpe(b"abab") == tok._bpe_plain(b"abab") == [257, 257]
    assert tok._bpe(b"aba") == tok._bpe_plain(b"aba") == [256]


merge_lists = st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c", b"ab", b"ba", b"bc", b"aa", b"abc"]),
                                 st.sampled_from([b"a", b"b", b"c", b"ab", b"ba", b"bc", b"aa"])),
                       max_size=10)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(merges=merge_lists, text=st.text(alphabet="abc", max_size=40))
def test_heap_bpe_equals_plain_bpe_on_any_merge_list(merges, text):
    """Any merge order, duplicates and parts made later included (vocabularies tiktoken cannot take)."""
    made = {a + b for a, b in merges}
    missing = {p for a, b in merges for p in (a, b) if len(p) > 1 and p not in made}
    if missing:
        merges = merges + [(p[:1], p[1:]) for p in sorted(missing)]
        made = {a + b for a, b in merges}
        if {p for a, b in merges for p in (a, b) if len(p) > 1} - made:
            return
    vocab = dict(BYTES)
    for token in dict.fromkeys(a + b for a, b in merges):
        vocab[len(vocab)] = token
    tok = Tokenizer(vocab, merges)
    data = text.encode()
    assert tok._bpe(data) == tok._bpe_plain(data)


# ------------------------------------------------------------------------------ decoding ids
@pytest.mark.parametrize("bad, message", [
    (True, "token id True is a bool, not an integer, at position 1"),
    ([1, 2], r"token id \[1, 2\] is not an integer \(list\), at position 1"),
    (1.0, r"token id 1.0 is not an integer \(float\), at position 1"),
    ("7", r"token id '7' is not an integer \(str\), at position 1"),
    (None, r"token id None is not an integer"),
    (50257, r"token id 50257 is outside the vocabulary \(0..50256\), at position 1"),
    (-1, r"token id -1 is outside the vocabulary"),
])
def test_decode_refuses_ids_that_are_not_vocabulary_integers(gpt2, bad, message):
    for call in (gpt2.decode, gpt2.decode_bytes, lambda ids: list(gpt2.decode_stream(ids))):
        with pytest.raises(ValueError, match=message):
            call([72, bad])


def test_decode_takes_integer_like_ids(gpt2):
    import numpy as np
    import torch

    ids = gpt2.encode("Hello world")
    assert gpt2.decode(np.array(ids)) == gpt2.decode(torch.tensor(ids)) == "Hello world"
    assert gpt2.decode([np.int64(ids[0])]) == "Hello"
    assert gpt2.token_bytes(gpt2.eot_id) == EOT.encode()


# ------------------------------------------------------------------------------ writing files
@pytest.fixture(scope="module")
def small() -> Tokenizer:
    vocab = {**BYTES, 256: b"ab"}
    return Tokenizer(vocab, [(b"a", b"b")], special_tokens=[EOT])


def test_save_refuses_a_directory(small, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    for save in (small.save, small.save_hf, small.save_tiktoken):
        with pytest.raises(ValueError, match=f"to {folder}: it is a directory"):
            save(folder)
    assert list(folder.iterdir()) == []


def test_save_never_replaces_a_file_of_another_kind(small, tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"my": "data"}')
    for save in (small.save, small.save_hf, small.save_tiktoken):
        with pytest.raises(ValueError, match="notes.json exists and is not a .*; refusing to overwrite it"):
            save(notes)
    assert notes.read_text() == '{"my": "data"}'
    listing = tmp_path / "tok.vocab"
    listing.write_text("my vocabulary notes\n")
    with pytest.raises(ValueError, match="tok.vocab exists and is not a vocab listing"):
        small.save(tmp_path / "tok.json")
    assert not (tmp_path / "tok.json").exists() and listing.read_text() == "my vocabulary notes\n"
    with pytest.raises(ValueError, match="the tokenizer file needs another suffix"):
        small.save(tmp_path / "other.vocab")


def test_save_replaces_its_own_files(small, tmp_path, gpt2):
    path = tmp_path / "t.json"
    gpt2.save(path)
    small.save(path)
    assert Tokenizer.load(path).fingerprint() == small.fingerprint()
    hf = tmp_path / "tokenizer.json"
    gpt2.save_hf(hf)
    small.save_hf(hf)
    assert Tokenizer.from_hf(hf).fingerprint() == small.fingerprint()
    ranks = tmp_path / "ranks.tiktoken"
    gpt2.save_tiktoken(ranks)
    small.save_tiktoken(ranks)
    assert len(ranks.read_text().splitlines()) == 257
    with pytest.raises(ValueError, match="tokenizer.json exists and is not a logitlab tokenizer file"):
        small.save(hf)  # a tokenizer, but not of the kind this writer writes
    empty = tmp_path / "empty.json"
    empty.write_text("")  # nothing to lose
    small.save(empty)
    assert Tokenizer.load(empty).fingerprint() == small.fingerprint()


def test_save_refuses_a_symbolic_link(small, tmp_path):
    target = tmp_path / "real.json"
    small.save(target)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="link.json is a symbolic link"):
        small.save(link)


def test_failed_write_leaves_the_old_file_and_no_temporary(small, gpt2, tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    small.save(path)
    before = path.read_bytes()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr("os.replace", refuse)
    with pytest.raises(PermissionError) as info:
        gpt2.save(path)
    assert info.value.filename == str(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.vocab"]


def test_check_target_refuses_an_unwritable_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_formats.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match="is not writable") as info:
        tokenizer_formats.check_target(tmp_path / "sub" / "t.json", tokenizer_formats.LOGITLAB)
    assert info.value.filename == str(tmp_path / "sub" / "t.json")


def test_logitlab_json_starts_as_check_target_expects(small, tmp_path):
    """The overwrite rule recognises our files by their start; a reformatted file still counts."""
    path = tmp_path / "t.json"
    small.save(path)
    path.write_text(json.dumps(json.loads(path.read_text())))  # one line, no indent
    small.save(path)
    assert Tokenizer.load(path).fingerprint() == small.fingerprint()
