"""Tokenizer files: logitlab JSON, GPT-2 files, HF tokenizer.json (read by `tokenizers` and
`transformers`), tiktoken rank files; malformed or missing files give errors naming them."""

from __future__ import annotations

import base64
import json

import pytest

from logitlab.tokenizer.bpe import train_tokenizer
from logitlab.tokenizer.core import Tokenizer

EOT = "<|endoftext|>"
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll: Speak, speak!  "
        f"naïve café 中文 🎉 e\u0301 {EOT} x = [1, 22, 333]\n\t\tdone\n")


@pytest.fixture(scope="module")
def trained(shared_data) -> Tokenizer:
    return train_tokenizer(shared_data / "tinyshakespeare.txt", 1200, [EOT], workers=1)


@pytest.fixture(scope="module")
def trained_cl100k(shared_data) -> Tokenizer:
    return train_tokenizer(shared_data / "corpus.en", 900, [EOT, "<|pad|>"], pattern="cl100k", workers=1)


@pytest.fixture(scope="module")
def gpt2(gpt2_files) -> Tokenizer:
    return Tokenizer.from_gpt2_files(*gpt2_files)


def test_logitlab_json_round_trip(trained, tmp_path):
    path = tmp_path / "tokenizer.logitlab.json"
    trained.save(path)
    back = Tokenizer.load(path)
    assert back.vocab == trained.vocab and back.merges == trained.merges
    assert back.special_tokens == trained.special_tokens and back.pattern == trained.pattern
    assert back.fingerprint() == trained.fingerprint() and back.encode(TEXT) == trained.encode(TEXT)
    listing = path.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert len(listing) == trained.vocab_size
    assert listing[32] == "32\t[ ]" and listing[-1] == f"{trained.eot_id}\t[{EOT}]\tspecial"
    assert "\t<- [" in listing[256]


def test_fingerprint_changes_with_contents(trained, trained_cl100k):
    assert trained.fingerprint() != trained_cl100k.fingerprint()
    same = Tokenizer(trained.vocab, trained.merges, special_tokens=[EOT])
    assert same.fingerprint() == trained.fingerprint()
    other = Tokenizer(trained.vocab, trained.merges, special_tokens=[EOT], pattern="cl100k")
    assert other.fingerprint() != trained.fingerprint()


@pytest.mark.parametrize("which", ["trained", "trained_cl100k", "gpt2"])
def test_hf_tokenizer_json_gives_our_ids(which, request, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    tok = request.getfixturevalue(which)
    path = tmp_path / "tokenizer.json"
    tok.save_hf(path)
    want = tok.encode(TEXT)
    assert HFTokenizer.from_file(str(path)).encode(TEXT).ids == want
    fast = PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert fast.encode(TEXT) == want
    assert fast.decode(want) == TEXT
    back = Tokenizer.from_hf(path)
    assert back.vocab == tok.vocab and back.merges == tok.merges and back.pattern == tok.pattern
    assert back.special_tokens == tok.special_tokens


def test_tiktoken_rank_file(trained, tmp_path):
    import tiktoken

    path = tmp_path / "ranks.tiktoken"
    trained.save_tiktoken(path)
    ranks = {}
    for line in path.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    assert len(ranks) == trained.vocab_size - 1
    enc = tiktoken.Encoding("t", pat_str=trained.pattern, mergeable_ranks=ranks, special_tokens=trained.special_tokens)
    assert enc.encode(TEXT, allowed_special="all") == trained.encode(TEXT, fast=False)


def test_gpt2_file_errors(gpt2_files, tmp_path):
    vocab_json, merges_txt = gpt2_files
    with pytest.raises(FileNotFoundError, match="vocab file not found: .*missing.json"):
        Tokenizer.from_gpt2_files(tmp_path / "missing.json", merges_txt)
    with pytest.raises(FileNotFoundError, match="merges file not found"):
        Tokenizer.from_gpt2_files(vocab_json, tmp_path / "missing.txt")
    bad_json = tmp_path / "vocab.json"
    bad_json.write_text("{not json")
    with pytest.raises(ValueError, match="vocab.json: malformed vocab file"):
        Tokenizer.from_gpt2_files(bad_json, merges_txt)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("Ġ t\nh e x\n")
    with pytest.raises(ValueError, match=r"merges.txt:2: malformed merge line 'h e x'"):
        Tokenizer.from_gpt2_files(vocab_json, bad_merges)
    unknown = tmp_path / "merges2.txt"
    unknown.write_text("Ġ t\nzq xy\n")
    with pytest.raises(ValueError, match="merge part 'zq' is not a byte or an earlier merge"):
        Tokenizer.from_gpt2_files(vocab_json, unknown)
    small = tmp_path / "small.json"
    small.write_text(json.dumps({chr(c): i for i, c in enumerate(range(33, 60))}))
    with pytest.raises(ValueError, match="small.json"):
        Tokenizer.from_gpt2_files(small, merges_txt)


def test_logitlab_file_errors(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        Tokenizer.load(tmp_path / "none.json")
    other = tmp_path / "other.json"
    other.write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a logitlab tokenizer file"):
        Tokenizer.load(other)
    path = tmp_path / "t.json"
    trained.save(path)
    data = json.loads(path.read_text())
    data["vocab"]["300"] = "6162"  # edit one token
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="t.json"):
        Tokenizer.load(path)
    del data["merges"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing field 'merges'"):
        Tokenizer.load(path)


def test_constructor_errors():
    vocab = {i: bytes([i]) for i in range(256)}
    with pytest.raises(ValueError, match="lacks 1 byte/merge token"):
        Tokenizer(vocab, [(b"a", b"b")])
    with pytest.raises(ValueError, match="id 257 is missing"):
        Tokenizer({**vocab, 301: b"ab"}, [(b"a", b"b")], special_tokens={EOT: 256})
    with pytest.raises(ValueError, match="neither a byte, a merge result nor a special token"):
        Tokenizer({**vocab, 256: b"zz"}, [])


def test_hf_file_errors(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {}}}))
    with pytest.raises(ValueError, match="model type 'WordPiece' is not BPE"):
        Tokenizer.from_hf(path)
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                                "pre_tokenizer": {"type": "Whitespace"}}))
    with pytest.raises(ValueError, match="unsupported pre_tokenizer"):
        Tokenizer.from_hf(path)
