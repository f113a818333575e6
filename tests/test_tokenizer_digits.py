"""SmolLM2's (and StarCoder's) byte-level tokenizer.json: a Digits(individual_digits=true) step before
ByteLevel's GPT-2 regex, and a vocabulary without 21 of the 256 byte tokens. logitlab reads it as
pattern "gpt2_digits" with `missing_bytes`, and gives the ids of `tokenizers`: every digit a piece of
its own (on every code point `tokenizers` calls a digit), a byte the vocabulary lacks dropped before
merging so that its neighbours may merge, on the fast path and the reference path alike; the file
survives logitlab's own format and tokenizer.json; the pattern trains; other shapes are refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
import _byte_tokenizers as kinds  # noqa: E402

from logitlab.tokenizer import Tokenizer  # noqa: E402
from logitlab.tokenizer.patterns import GPT2_DIGITS_PATTERN, digits_unknown_to_tiktoken, pretokenizer  # noqa: E402

EDGE_CASES = ["2024", " 12", "a1b2c3", "x =  10;  y=3.14e-5", "a  1", "\n\n 7\n", "'s1 12th", "١٢٣ ½ Ⅻ ５",
              "x\x04y", "ab\x04ab", "\x13\x14", "\U00046131 \U00080000a", "日本 2024年 🎉1", "", "   ",
              "<|endoftext|>1<|im_start|>user\n42<|im_end|>", "$1,000.00 (25%)"]
ALPHABET = list("ab Z0129 \n\t.,'-$") + ["  ", "١", "½", "Ⅻ", "５", "日本", "🎉", "é", "'s", "\x04", "\x06", "\x1d",
                                         "\U00046131", "\u3000"] + kinds.SMOLLM2_SPECIALS


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    d = tmp_path_factory.mktemp("smollm2")
    theirs = kinds.build("smollm2", d)
    return d, Tokenizer.from_hf(d / "tokenizer.json"), theirs


def test_the_file_reads_as_gpt2_digits_with_missing_bytes(smollm2):
    _, ours, theirs = smollm2
    assert ours.pattern_name == "gpt2_digits" and ours.pattern == GPT2_DIGITS_PATTERN
    assert ours.missing_bytes == kinds.SMOLLM2_MISSING and ours.fast_path_ok
    assert ours.bos_id is None and ours.eot_id == 0 and "missing_bytes=21" in repr(ours)
    assert not any(c.isdigit() and len(t) > 1 for t in theirs.get_vocab() for c in t)  # no digit was ever merged


@pytest.mark.parametrize("text", EDGE_CASES)
def test_ids_equal_tokenizers(smollm2, text):
    _, ours, theirs = smollm2
    want = theirs.encode(text).ids
    assert ours.encode(text) == want and ours.encode(text, add_bos=True) == want
    assert ours.encode(text, fast=False) == want
    if not any(s in text for s in kinds.SMOLLM2_SPECIALS):
        assert ours.encode_ordinary(text) == want and ours.encode_ordinary(text, fast=False) == want


def test_auto_tokenizer_on_a_model_directory(smollm2):
    d, ours, _ = smollm2
    kinds.write_config(d, bos_token="<|endoftext|>", eos_token="<|endoftext|>")  # the class keeps the file's steps
    auto = kinds.auto(d)
    for text in EDGE_CASES:
        assert auto(text)["input_ids"] == ours.encode(text, add_bos=True)


def test_a_missing_byte_is_dropped_and_its_neighbours_merge(smollm2):
    _, ours, theirs = smollm2
    pair = ours.encode("()")     # "(\x04)" is one pre-token; without its 04 byte, "(" and ")" merge
    assert len(pair) == 1 and ours.encode("(\x04)") == ours.encode("(\x04)", fast=False) == pair
    assert pair == theirs.encode("(\x04)").ids
    assert ours.encode("\x04\x06") == [] and ours.decode(ours.encode("x\x13y")) == "xy"
    for fast in (None, False):   # the first byte of U+46131 (F1) is gone; its three others stay
        assert ours.decode(ours.encode("\U00046131", fast=fast)) == "\ufffd" * 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=25))
def test_random_text_both_directions(smollm2, pieces):
    _, ours, theirs = smollm2
    text = "".join(pieces)
    ids = theirs.encode(text).ids
    assert ours.encode(text) == ids
    assert ours.encode(text, fast=False) == ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


def test_digits_are_what_tokenizers_calls_digits_on_every_code_point():
    import regex
    from tokenizers import pre_tokenizers

    # Digits keeping runs whole (the same test of each character) alternates non-digit and digit runs;
    # in slices of 1024 code points, each after an "x", as one string of them all takes seconds
    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    runs = pre_tokenizers.Digits(individual_digits=False)
    digits = "".join(p for i in range(0, len(every), 1024)
                     for p, _ in runs.pre_tokenize_str("x" + every[i:i + 1024])[1::2])
    assert "".join(regex.findall(r"\p{N}", every)) == digits, "regex's \\p{N} and tokenizers' Digits disagree"
    pieces = pretokenizer(GPT2_DIGITS_PATTERN)("x".join(digits))
    assert [p for p in pieces if p != "x"] == list(digits)   # each one alone, known to tiktoken or not


def test_digits_that_tiktoken_does_not_know_take_the_reference_path(smollm2):
    _, ours, theirs = smollm2
    unknown = sorted(digits_unknown_to_tiktoken())
    if not unknown:
        pytest.skip("the installed tiktoken knows every digit the `regex` module knows")
    for c in unknown[:20]:
        text = f"a {c}b, {c}{c}  !{c}"
        assert not ours._fast_takes(text)
        assert ours.encode(text) == theirs.encode(text).ids == ours.encode_ordinary(text)


def test_encode_iterable_cuts_where_the_ids_do_not_change(smollm2):
    _, ours, _ = smollm2
    text = "".join(EDGE_CASES[:12]) * 40 + " 2024  12\n\n 7"
    assert list(ours.encode_iterable([text[i:i + 37] for i in range(0, len(text), 37)], chunk_chars=64)) == \
        ours.encode(text)


def test_the_file_survives_logitlab_json_and_tokenizer_json(smollm2, tmp_path):
    from tokenizers import Tokenizer as HF

    from logitlab.tokenizer.special import add_special_tokens

    _, ours, theirs = smollm2
    text = "x =  10\x04; 日本 2024 <|im_end|>"
    ours.save_hf(tmp_path / "tokenizer.json")
    written = json.loads((tmp_path / "tokenizer.json").read_text())
    assert [s["type"] for s in written["pre_tokenizer"]["pretokenizers"]] == ["Digits", "ByteLevel"]
    assert HF.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == theirs.encode(text).ids
    ours.save(tmp_path / "tok.json")
    data = json.loads((tmp_path / "tok.json").read_text())
    assert data["pattern"] == "gpt2_digits" and data["drop_missing_bytes"] is True
    loaded = Tokenizer.load(tmp_path / "tok.json")
    assert loaded.missing_bytes == ours.missing_bytes and loaded.fingerprint() == ours.fingerprint()
    assert loaded.encode(text) == ours.encode(text)
    grown, added = add_special_tokens(ours, ["<|tool|>"])
    assert grown.missing_bytes == ours.missing_bytes and grown.encode(text) == ours.encode(text)
    with pytest.raises(ValueError, match=r"tiktoken rank file: the vocabulary lacks 21 of the 256 byte tokens"):
        ours.save_tiktoken(tmp_path / "ranks.tiktoken")


def test_a_vocabulary_without_every_byte_needs_drop_missing_bytes(smollm2):
    _, ours, _ = smollm2
    with pytest.raises(ValueError, match=r"lacks 21 byte/merge token\(s\), e.g. b'\\x04' \(drop_missing_bytes=True"):
        Tokenizer(dict(ours._decoder), ours.merges, ours.special_tokens, "gpt2_digits")


def test_gpt2_digits_trains_and_reads_back_in_tokenizers(tmp_path):
    from tokenizers import Tokenizer as HF

    from logitlab.tokenizer.bpe import train_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(kinds.corpus()[:400]), encoding="utf-8")
    tok = train_tokenizer(corpus, 400, ["<|endoftext|>"], pattern="gpt2_digits")
    assert tok.pattern_name == "gpt2_digits" and not tok.missing_bytes
    assert not any(len(t) > 1 and any(chr(b).isdigit() for b in t) for t in tok._encoder)  # digits stay alone
    tok.save_hf(tmp_path / "tokenizer.json")
    theirs = HF.from_file(str(tmp_path / "tokenizer.json"))
    for text in EDGE_CASES:
        assert tok.encode(text) == theirs.encode(text).ids


def test_other_pre_tokenizer_shapes_are_refused_by_name(smollm2, tmp_path):
    d, _, _ = smollm2
    data = json.loads((d / "tokenizer.json").read_text())
    digits, byte_level = data["pre_tokenizer"]["pretokenizers"]
    split = {"type": "Split", "pattern": {"Regex": kinds.CL100K}, "behavior": "Isolated", "invert": False}
    cases = [
        ([{**digits, "individual_digits": False}, byte_level], "Digits with individual_digits=false"),
        ([digits, {**byte_level, "add_prefix_space": True}], "add_prefix_space=True"),
        ([digits, {**byte_level, "use_regex": False}], "unsupported pre_tokenizer"),
        ([byte_level, digits], "unsupported pre_tokenizer"),
        ([split, digits, {**byte_level, "use_regex": False}], "unsupported pre_tokenizer"),
        ([{**split, "behavior": "Removed", "invert": True}, {**byte_level, "use_regex": False}],
         "unsupported pre_tokenizer"),
    ]
    path = tmp_path / "tokenizer.json"
    for steps, message in cases:
        path.write_text(json.dumps({**data, "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps}}))
        with pytest.raises(ValueError, match=message) as caught:
            Tokenizer.from_hf(path)
        assert str(path) in str(caught.value)
    path.write_text(json.dumps({**data, "model": {**data["model"], "unk_token": "<|endoftext|>"}}))
    with pytest.raises(ValueError, match="byte token 'Ą' is missing from the vocab"):
        Tokenizer.from_hf(path)   # tokenizers would put unk_token's id for such a byte
