"""A byte-level tokenizer.json with a Unicode normalizer (Qwen2, Qwen3 and Qwen3.5 ship NFC): the
text between special tokens is normalized before it is split, as `tokenizers` does, so the ids
equal theirs on decomposed accents, Hangul jamo and marks that follow a special token; the form
survives logitlab's own file, tokenizer.json and added special tokens."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logitlab.tokenizer import Tokenizer
from logitlab.tokenizer.special import add_special_tokens

tokenizers = pytest.importorskip("tokenizers")

# Qwen2's split pattern (one digit per piece; otherwise cl100k's)
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EDGE_CASES = [
    "cafe\u0301 caf\u00e9",                       # decomposed and composed é: the same ids after NFC
    "\u1100\u1161\u11a8 \uac01",                  # Hangul jamo compose into one syllable
    "\u212b \u00c5 A\u030a",                      # the angstrom sign, Å, and A + ring
    "<|im_end|>\u0338",                           # a mark after a special token stays a mark
    ">\u0338 = \u226f",                           # ... but after ">" it composes into ≯
    "e\u0301\u0301\u0323 \ufb01 x\u00b2",         # several marks (reordered), NFC keeps compatibility forms
    "<|im_start|>user\nna\u0308i\u0308ve<|im_end|>\n",
    "",
]


def _corpus() -> list[str]:
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]:
        lines += path.read_text(encoding="utf-8", errors="replace")[:2000].splitlines()
    return lines + ["café naïve Ångström 한국어 텍스트 ≯ ﬁne x²"] * 5


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory) -> Path:
    """A Qwen-style tokenizer.json (NFC, Split + ByteLevel, special tokens after the vocabulary)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("qwen") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def pair(qwen_style):
    return Tokenizer.from_hf(qwen_style), tokenizers.Tokenizer.from_file(str(qwen_style))


@pytest.mark.parametrize("text", EDGE_CASES)
def test_ids_equal_tokenizers(pair, text):
    ours, theirs = pair
    assert ours.normalization == "NFC"
    want = theirs.encode(text, add_special_tokens=False).ids
    assert ours.encode(text) == want
    assert ours.encode(text, fast=False) == want
    if not any(s in text for s in SPECIALS):
        assert ours.encode_ordinary(text) == want
        assert ours.encode_ordinary(text, fast=False) == want


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list("ae AÅ>=x\n\u0301\u0308\u030a\u0323\u0338\u1100\u1161\u11a8\uac00"
                                     "\u212b\ufb01") + SPECIALS), max_size=30))
def test_random_text_with_marks_and_specials(pair, pieces):
    ours, theirs = pair
    text = "".join(pieces)
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids


def test_encoding_normalizes_what_decoding_returns(pair):
    ours, _ = pair
    assert ours.decode(ours.encode("cafe\u0301")) == "caf\u00e9"
    assert ours.encode("cafe\u0301") == ours.encode("caf\u00e9")


def test_the_form_survives_every_file_and_added_tokens(pair, tmp_path):
    ours, theirs = pair
    text = "na\u0308i\u0308ve \u212b<|im_end|>"
    ours.save_hf(tmp_path / "tokenizer.json")
    assert json.loads((tmp_path / "tokenizer.json").read_text())["normalizer"] == {"type": "NFC"}
    again = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert again.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False).ids
    ours.save(tmp_path / "tok.json")
    loaded = Tokenizer.load(tmp_path / "tok.json")
    assert loaded.normalization == "NFC" and loaded.encode(text) == ours.encode(text)
    plain = Tokenizer(dict(ours._decoder), ours.merges, ours.special_tokens, ours.pattern)
    assert plain.fingerprint() != ours.fingerprint()           # the form changes ids, so it is in the fingerprint
    assert plain.encode("cafe\u0301") != ours.encode("cafe\u0301")
    grown, added = add_special_tokens(ours, ["<|tool|>"])
    assert grown.normalization == "NFC" and grown.encode("cafe\u0301<|tool|>") == ours.encode("caf\u00e9") + [
        added["<|tool|>"]]


def test_other_normalizers_are_refused_by_name(qwen_style, tmp_path):
    data = json.loads(qwen_style.read_text())
    for normalizer in ({"type": "Lowercase"}, {"type": "Sequence", "normalizers": [{"type": "NFC"}]}, "NFC"):
        data["normalizer"] = normalizer
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=r"tokenizer.json: normalizer .* not supported .*one Unicode normal form"):
            Tokenizer.from_hf(path)
    with pytest.raises(ValueError, match="normalization must be NFC, NFD, NFKC, NFKD or None, got 'nfc'"):
        Tokenizer({i: bytes([i]) for i in range(256)}, [], normalization="nfc")
