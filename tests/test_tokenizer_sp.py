"""SentencePiece-style BPE (sentencepiece.py, sp_bpe.py, sp_pipeline.py, sp_files.py) against the
`tokenizers` library and transformers' AutoTokenizer, on tiny files of each kind trained here
(tests/_sp_tokenizers.py): ids and decoded text equal in both directions, on property-based
text (CJK, emoji, whitespace runs, control characters, special tokens inside) and edge cases."""

from __future__ import annotations

import json
import shutil
import string
import warnings

import pytest

pytest.importorskip("tokenizers")
import _sp_tokenizers as kinds  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from logitlab.tokenizer.core import Tokenizer  # noqa: E402
from logitlab.tokenizer.sentencepiece import SentencePieceTokenizer  # noqa: E402
from logitlab.tokenizer.sp_bpe import merge, merge_plain  # noqa: E402

FIXTURES_OK = [HealthCheck.function_scoped_fixture]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=FIXTURES_OK)
MANY = settings(max_examples=1500, deadline=None, suppress_health_check=FIXTURES_OK)
PIECES = ["<s>", "</s>", "<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", " ", "  ", "   ", "\n",
          "\n\n", "\t", "\r\n", "▁", "▁▁", "<0x41>", "<0xE2>", "日本語", "中文", "🎉", "🙂", "👩‍💻", "é",
          "e\u0301", "\x00", "\x1b", "\u200b", "\ufeff", "Hello", " world", "def ", "import os", "self.", "  return"]
TEXTS = st.lists(st.one_of(st.sampled_from(PIECES), st.text(st.characters(codec="utf-8"), max_size=6),
                           st.text(string.ascii_letters + " .,:()", max_size=12)), max_size=10).map("".join)
EDGE_CASES = ["", " ", "  ", "\n", "x", " leading", "  two leading", "trailing  ", "a\tb\n\nc\r\n", "日本語のテキスト",
              "€5 ¥ ₿", "🎉🙂👩‍💻", "e\u0301\u0301", "\x00\x01\x7f", "<s>Hello</s>", "Hello</s>World <s> x",
              "<bos>x<eos> <start_of_turn>user\nhi<end_of_turn>", "▁already▁metaspace", "<0x41> not a byte",
              "<unk>", "<<s>>", "     many     spaces     ", "import os\n\ndef f(x):\n    return x  # done\n"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind -> (tokenizer.json path, the `tokenizers` Tokenizer, ours read from it)."""
    root = tmp_path_factory.mktemp("sp")
    out = {}
    for kind in kinds.KINDS:
        theirs = kinds.build(kind, root / kind)
        out[kind] = (root / kind / "tokenizer.json", theirs, Tokenizer.from_hf(root / kind / "tokenizer.json"))
    return out


def _check_encode(theirs, ours, text):
    for add in (False, True):
        want = theirs.encode(text, add_special_tokens=add).ids
        assert ours.encode(text, add_bos=add) == want, (text, add)
        assert ours.encode(text, add_bos=add, fast=False) == want, (text, add)
    theirs.encode_special_tokens = True  # special-token strings as plain text: allowed_special="none"
    try:
        assert ours.encode_ordinary(text) == theirs.encode(text, add_special_tokens=False).ids, text
    finally:
        theirs.encode_special_tokens = False


@pytest.mark.parametrize("kind", kinds.KINDS)
def test_files_of_each_kind_read_as_sentencepiece(files, kind):
    path, theirs, ours = files[kind]
    assert isinstance(ours, SentencePieceTokenizer) and ours.vocab_size == theirs.get_vocab_size()
    assert ours.bos_id == theirs.token_to_id(kinds.BOS[kind]) and ours.eot_id is None  # no tokenizer_config.json
    assert ours.special_tokens == {s: theirs.token_to_id(s) for s in kinds.SPECIALS[kind]}
    assert ours.piece(ours.bos_id + 1) == theirs.id_to_token(ours.bos_id + 1)


@pytest.mark.parametrize("kind", kinds.KINDS)
@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_encode_and_decode_as_tokenizers_does(files, kind, text):
    _, theirs, ours = files[kind]
    _check_encode(theirs, ours, text)
    ids = theirs.encode(text).ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("examples", [SETTINGS, pytest.param(MANY, marks=pytest.mark.slow)], ids=["60", "1500"])
@pytest.mark.parametrize("kind", kinds.KINDS)
def test_encoding_equals_tokenizers_on_unseen_text(files, kind, examples):
    _, theirs, ours = files[kind]

    @examples
    @given(TEXTS)
    def check(text):
        _check_encode(theirs, ours, text)

    check()


@pytest.mark.parametrize("examples", [SETTINGS, pytest.param(MANY, marks=pytest.mark.slow)], ids=["60", "1500"])
@pytest.mark.parametrize("kind", kinds.KINDS)
def test_decoding_equals_tokenizers_on_any_ids(files, kind, examples):
    """Any ids, byte tokens in any order among them (invalid UTF-8 runs become one U+FFFD per
    byte token, as ByteFallback does). decode_stream is the continuation of earlier text: what
    decoding after a first token "a" adds."""
    _, theirs, ours = files[kind]
    V, a = ours.vocab_size, ours.token_to_id("a")
    byte_ids = st.integers(ours.token_to_id("<0x00>"), ours.token_to_id("<0xFF>"))

    @examples
    @given(st.lists(st.one_of(st.integers(0, V - 1), byte_ids), max_size=24))
    def check(ids):
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)
        assert "".join(ours.decode_stream(ids)) == theirs.decode([a, *ids], skip_special_tokens=False)[1:]

    check()


@pytest.mark.parametrize("kind", kinds.KINDS)
def test_token_bytes_are_what_each_piece_adds(files, kind):
    _, _, ours = files[kind]
    space, byte, bos = ours.token_to_id("▁"), ours.token_to_id("<0xE2>"), ours.bos_id
    assert ours.token_bytes(space) == b" " and ours.token_bytes(byte) == b"\xe2"
    assert ours.token_bytes(bos) == kinds.BOS[kind].encode() and ours.is_special(bos)
    ids = ours.encode("x 日本 €")
    assert ours.decode_bytes(ids).decode("utf-8") == "".join(ours.decode_stream(ids))
    assert ours.token_to_id(b"\xe2") == byte and ours.token_to_id("▁") == space
    for bad in (-1, V := ours.vocab_size, 1.0, True, "3"):
        with pytest.raises(ValueError, match="token id"):
            ours.token_bytes(bad)
    with pytest.raises(ValueError, match="at position 1 of the ids"):
        ours.decode([space, V])


def test_merges_one_at_a_time_not_rank_by_rank(tmp_path):
    """SentencePiece-style BPE merges the lowest-rank pair's leftmost occurrence, then looks again:
    with ("ab", "a") ranked before ("a", "b"), "abab" is [aba, b] (byte-level BPE's rule, every
    (a, b) first, would give [ab, ab])."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "aba": 4}
    theirs = HF(models.BPE(vocab=vocab, merges=[("ab", "a"), ("a", "b")], unk_token="<unk>"))
    theirs.decoder = decoders.Fuse()
    theirs.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    assert ours.encode("abab") == theirs.encode("abab").ids == [4, 2]
    assert ours.encode("abzab") == theirs.encode("abzab").ids == [3, 0, 3]  # z: unknown, no byte fallback


@pytest.mark.parametrize("kind", kinds.KINDS)
def test_long_text_is_cut_where_no_token_joins_and_encodes_the_same(files, kind):
    """A whole text is one word to BPE here; it is merged part by part between characters that
    stand side by side in no merge result (Gemma-style pieces hold "▁" inside, and are still cut)."""
    from logitlab.tokenizer.sp_bpe import independent_parts

    _, theirs, ours = files[kind]
    text = "\n".join(kinds.corpus()[:25])
    word = ours.config.pre_tokenize(ours.config.normalize(text), True)[0]
    parts = independent_parts(word, ours.pieces, ours._joined)
    assert "".join(parts) == word and len(parts) > len(text) // 20
    assert ours.encode(text) == ours.encode(text, fast=False) == theirs.encode(text, add_special_tokens=False).ids


@given(st.lists(st.integers(0, 4), max_size=40),
       st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=30, unique=True))
@settings(max_examples=200, deadline=None)
def test_heap_merge_equals_plain_merge(ids, pairs):
    table = {pair: (rank, 10 + rank) for rank, pair in enumerate(pairs)}  # new ids never merge again
    table.update({(10 + r, i): (len(pairs) + r, 40 + r) for r, (_, i) in enumerate(pairs)})  # ... except these
    assert merge(ids, table) == merge_plain(ids, table)


@pytest.mark.parametrize("fuse", [True, False])
def test_unknown_characters_without_byte_fallback(tmp_path, fuse):
    theirs = kinds.build("metaspace", tmp_path, byte_fallback=False)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["fuse_unk"] = fuse
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    from tokenizers import Tokenizer as HF

    theirs = HF.from_file(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    for text in ["日本語 x 中文🎉", "ẞẞ ẞ", "a\x00\x00b", "€5"]:
        assert ours.encode(text, add_bos=True) == theirs.encode(text).ids
        ids = theirs.encode(text).ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


def test_normalized_and_non_special_added_tokens(files, tmp_path):
    """An added token with normalized: true is matched in the normalized text ("▁" for its space);
    a non-special one is matched even in untrusted text, as `tokenizers` does."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HF

    path, _, _ = files["llama"]
    theirs = HF.from_file(str(path))
    theirs.add_tokens([AddedToken("as if", normalized=True), AddedToken("<|tool|>", normalized=False)])
    theirs.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    for text in ["as if <|tool|> x", " as if", "was if", "<s>as if</s><|tool|>"]:
        _check_encode(theirs, ours, text)
    assert not ours.is_special(ours.token_to_id("<|tool|>"))


CONFIGS = [  # (kind, tokenizer_config.json settings) as model directories have them
    ("llama", {"tokenizer_class": "PreTrainedTokenizerFast"}),
    ("llama", {"tokenizer_class": "LlamaTokenizer"}),          # transformers 5: Metaspace "first"
    ("llama", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True}),
    ("llama", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}),
    ("metaspace", {"tokenizer_class": "LlamaTokenizerFast", "legacy": False, "add_bos_token": True}),
    ("gemma", {"tokenizer_class": "GemmaTokenizer"}),
    ("gemma", {"tokenizer_class": "LlamaTokenizer"}),
    ("llama", {"tokenizer_class": "LlamaTokenizer", "added_tokens_decoder": {
        "9999": {"content": "<|user|>", "special": False, "normalized": False}}}),
]


def _auto(directory):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("kind,config", CONFIGS, ids=[f"{k}-{json.dumps(c)[:60]}" for k, c in CONFIGS])
def test_a_model_directory_reads_as_autotokenizer_reads_it(files, tmp_path, kind, config):
    """With its tokenizer_config.json, a directory gives AutoTokenizer's ids and text (transformers'
    Llama and Gemma classes rebuild the steps: Llama-2's normalizer becomes a Metaspace)."""
    from logitlab.io.hf import load_tokenizer

    shutil.copy(files[kind][0], tmp_path / "tokenizer.json")
    if "added_tokens_decoder" in config:  # a token after the vocabulary, at the next id
        config["added_tokens_decoder"] = {str(files[kind][2].vocab_size): config["added_tokens_decoder"]["9999"]}
    kinds.write_config(tmp_path, kind, **config)
    auto, ours = _auto(tmp_path), load_tokenizer(tmp_path)
    assert ours.eot_id == auto.eos_token_id and ours.bos_id == auto.bos_token_id

    @settings(max_examples=25, deadline=None)
    @given(st.one_of(st.sampled_from(EDGE_CASES + ["x <|user|> y"]), TEXTS))
    def check(text):
        for add in (True, False):
            ids = auto.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_bos=add) == ids, (text, add)
        assert ours.decode(ids) == auto.decode(ids)

    check()


@pytest.mark.parametrize("kind,config", [("llama", {"tokenizer_class": "LlamaTokenizer"}), ("metaspace", None),
                                         ("gemma", {"tokenizer_class": "GemmaTokenizer"})])
def test_save_hf_and_logitlab_json_read_back_with_equal_ids(files, tmp_path, kind, config):
    from tokenizers import Tokenizer as HF

    from logitlab.io.hf import load_tokenizer
    from logitlab.tokenizer.chat import write_hf_tokenizer_config

    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(files[kind][0], source / "tokenizer.json")
    if config is not None:
        kinds.write_config(source, kind, **config)
    tok = load_tokenizer(source)
    out = tmp_path / "out"
    out.mkdir()
    tok.save_hf(out / "tokenizer.json")
    write_hf_tokenizer_config(tok, out, 128)
    theirs, auto, back = HF.from_file(str(out / "tokenizer.json")), _auto(out), load_tokenizer(out)
    tok.save(tmp_path / "tok.logitlab.json")
    again = Tokenizer.load(tmp_path / "tok.logitlab.json")
    assert isinstance(again, SentencePieceTokenizer) and again.fingerprint() == tok.fingerprint() == back.fingerprint()
    assert again.roles == tok.roles and back.roles == tok.roles and again.eot_id == tok.eot_id
    for text in EDGE_CASES:
        want = tok.encode(text, add_bos=True)
        assert theirs.encode(text).ids == want and auto.encode(text) == want
        assert back.encode(text, add_bos=True) == want and again.encode(text, add_bos=True) == want
        assert auto.decode(want) == tok.decode(want) == again.decode(want)
    listing = (tmp_path / "tok.logitlab.vocab").read_text(encoding="utf-8").splitlines()
    assert len(listing) == tok.vocab_size and listing[tok.bos_id].endswith("\tspecial")
    assert f"{tok.token_to_id('<0xE2>')}\t[<0xE2>]\tbyte e2" in listing
    assert any("\t[▁" in line and "\t<- [" in line for line in listing)


def test_added_special_tokens_take_the_next_ids(files):
    from logitlab.tokenizer.special import add_special_tokens

    tok = files["metaspace"][2]
    new, added = add_special_tokens(tok, ["<|im_start|>", "<|im_end|>", "</s>"])
    assert added == {"<|im_start|>": tok.vocab_size, "<|im_end|>": tok.vocab_size + 1}
    text = "<|im_start|>user\nHi 日本<|im_end|>\n"
    ids = new.encode(text)
    assert ids[0] == tok.vocab_size and ids[-2] == tok.vocab_size + 1 and new.decode(ids) == text
    assert new.encode("Hi 日本</s>") == tok.encode("Hi 日本</s>")


def test_sentencepiece_file_errors_name_the_problem(files, tmp_path):
    data = json.loads(files["llama"][0].read_text())
    path = tmp_path / "tokenizer.json"
    cases = [
        ({"normalizer": {"type": "NFKC"}}, "unsupported normalizer"),
        ({"pre_tokenizer": {"type": "Whitespace"}}, "unsupported pre_tokenizer"),
        ({"decoder": None}, "decoder is null"),
        ({"added_tokens": [{"id": 1, "content": "<s>", "lstrip": True}]}, "lstrip: true"),
        ({"post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}},
                                                                      {"SpecialToken": {"id": "</s>"}}]}},
         "at most one token before the text"),
        ({"model": {**data["model"], "merges": [["▁", "zzz"]]}}, "merge #0"),
        ({"model": {**data["model"], "dropout": 0.1}}, "dropout"),
    ]
    for change, message in cases:
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(ValueError, match=message) as caught:
            Tokenizer.from_hf(path)
        assert str(path) in str(caught.value)
    path.write_text(json.dumps(data))
    kinds.write_config(tmp_path, "llama", add_eos_token=True)
    data["post_processor"] = None
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="add_eos_token"):
        Tokenizer.from_hf(path)
    with pytest.raises(ValueError, match="no tiktoken rank file"):
        files["llama"][2].save_tiktoken(tmp_path / "ranks.tiktoken")
