"""A byte-level tokenizer.json whose post-processor puts a BOS token before the text (Llama 3's
Sequence[ByteLevel, TemplateProcessing("<|begin_of_text|> $A")]): `encode(text, add_bos=True)`
gives the ids of `tokenizers` and transformers' AutoTokenizer (BOS included) and `encode(text)` those
without special tokens; the BOS token survives logitlab's file, tokenizer.json, tokenizer_config.json
and added special tokens; files without one (Qwen's ByteLevel post-processor, none) keep bos_id None;
other post-processors are refused by name; `generate` on a tiny Llama-3-style model starts from it."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
import _byte_tokenizers as kinds  # noqa: E402

from logitlab.tokenizer import Tokenizer  # noqa: E402

EDGE_CASES = ["Hello world", "", " ", "In 2024, 1,234.56 units", "日本語 中文 한국어", "emoji 🎉🙂👍🏽 ok",
              "  two  spaces\n\n\tand tabs  ", "<|begin_of_text|>already there", "x<|eot_id|>\ny",
              "it's 12345678 'll"]
ALPHABET = list("ab Z019 \n\t.,'-") + ["  ", "12", "日本", "🎉", "é", "e\u0301", "'s", "\u00a0"] + kinds.LLAMA3_SPECIALS


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(directory, our Tokenizer, tokenizers.Tokenizer) of a Llama-3-style tokenizer.json."""
    d = tmp_path_factory.mktemp("llama3")
    theirs = kinds.build("llama3", d)
    kinds.write_config(d, bos_token=kinds.BOS, eos_token="<|end_of_text|>", chat_template=kinds.LLAMA3_TEMPLATE)
    return d, Tokenizer.from_hf(d / "tokenizer.json"), theirs


@pytest.mark.parametrize("text", EDGE_CASES)
def test_ids_equal_tokenizers_with_and_without_bos(llama3, text):
    _, ours, theirs = llama3
    assert ours.bos_token == kinds.BOS and ours.bos_id == theirs.token_to_id(kinds.BOS)
    assert ours.encode(text, add_bos=True) == theirs.encode(text).ids                      # special tokens added
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, add_bos=True, fast=False) == ours.encode(text, add_bos=True)  # reference path too
    assert ours.encode_ordinary(text) == ours.encode(text, allowed_special="none")         # no BOS, specials as text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=25))
def test_random_text_both_directions(llama3, pieces):
    _, ours, theirs = llama3
    text = "".join(pieces)
    ids = theirs.encode(text).ids
    assert ours.encode(text, add_bos=True) == ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)


def test_auto_tokenizer_on_a_model_directory_puts_the_bos_first(llama3):
    d, ours, _ = llama3
    auto = kinds.auto(d)
    for text in EDGE_CASES:
        assert auto(text)["input_ids"] == ours.encode(text, add_bos=True)
    messages = [{"role": "user", "content": "Hi 2024"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": " 日本?"}]
    want = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == want  # one BOS, from the template
    assert want.count(ours.bos_id) == 1


def test_the_bos_survives_every_file(llama3, tmp_path):
    from tokenizers import Tokenizer as HF

    from logitlab.tokenizer.chat import write_hf_tokenizer_config

    _, ours, _ = llama3
    text = "Hello 2024 日本<|eot_id|>"
    ours.save_hf(tmp_path / "tokenizer.json")                      # tokenizers reads it back, BOS included
    assert HF.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == ours.encode(text, add_bos=True)
    config = write_hf_tokenizer_config(ours, tmp_path, 128)         # and transformers, from a directory
    written = json.loads(config.read_text())
    assert written["bos_token"] == kinds.BOS and "add_bos_token" not in written
    assert kinds.auto(tmp_path)(text)["input_ids"] == ours.encode(text, add_bos=True)
    again = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    assert again.bos_token == kinds.BOS and again.fingerprint() == ours.fingerprint()
    ours.save(tmp_path / "tok.json")                                # logitlab's own file
    assert json.loads((tmp_path / "tok.json").read_text())["bos_token"] == kinds.BOS
    loaded = Tokenizer.load(tmp_path / "tok.json")
    assert loaded.bos_id == ours.bos_id and loaded.encode(text, add_bos=True) == ours.encode(text, add_bos=True)


def test_the_fingerprint_holds_the_bos_only_when_set(llama3):
    _, ours, _ = llama3
    plain = Tokenizer(dict(ours._decoder), ours.merges, ours.special_tokens, ours.pattern)
    assert plain.bos_id is None and plain.encode("hi", add_bos=True) == plain.encode("hi")
    assert plain.fingerprint() != ours.fingerprint()
    canon = {"pattern": plain.pattern, "vocab": sorted((i, t.hex()) for i, t in plain._decoder.items()),
             "merges": [[a.hex(), b.hex()] for a, b in plain.merges],
             "special_tokens": sorted(plain.special_tokens.items())}   # what files without a BOS were signed with
    assert plain.fingerprint() == hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()[:16]


def test_added_special_tokens_keep_the_bos(llama3):
    from logitlab.tokenizer.special import add_special_tokens

    _, ours, _ = llama3
    grown, added = add_special_tokens(ours, ["<|tool|>"])
    assert grown.bos_id == ours.bos_id
    assert grown.encode("hi<|tool|>", add_bos=True) == ours.encode("hi", add_bos=True) + [added["<|tool|>"]]


BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


@pytest.mark.parametrize("post", [None, BYTE_LEVEL, {"type": "Sequence", "processors": [BYTE_LEVEL]},
                                  {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                                   "pair": [], "special_tokens": {}}])
def test_files_without_a_bos_keep_none(tmp_path, post):
    from tokenizers import Tokenizer as HF

    theirs = kinds.build("qwen", tmp_path)            # Qwen2.5's: a ByteLevel post-processor
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["post_processor"] = post
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    ours = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    theirs = HF.from_file(str(tmp_path / "tokenizer.json"))
    assert ours.bos_token is None and ours.bos_id is None
    text = "Hi 2024 café<|im_end|>"
    assert ours.encode(text, add_bos=True) == ours.encode(text) == theirs.encode(text).ids
    ours.save_hf(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["post_processor"] is None


def test_other_post_processors_are_refused_by_name(llama3, tmp_path):
    d, ours, _ = llama3
    data = json.loads((d / "tokenizer.json").read_text())
    bos, eot = ours.bos_id, ours.special_tokens["<|eot_id|>"]
    template = data["post_processor"]["processors"][1]
    cases = [
        ({"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]}, "unsupported post_processor"),
        ({"type": "BertProcessing", "sep": ["[SEP]", 1], "cls": ["[CLS]", 0]}, "unsupported post_processor"),
        ({**template, "single": template["single"] + [{"SpecialToken": {"id": "<|eot_id|>", "type_id": 0}}]},
         "at most one token before the text and none after"),
        ({"type": "Sequence", "processors": [template, template]}, "unsupported post_processor"),
        ({**template, "special_tokens": {kinds.BOS: {"id": kinds.BOS, "ids": [eot], "tokens": [kinds.BOS]}}},
         rf"gives '<\|begin_of_text\|>' the ids \[{eot}\], but it is token {bos}"),
        ({**template, "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, template["single"][1]],
          "special_tokens": {}}, "puts '<s>' before the text, but it is not an added token"),
    ]
    path = tmp_path / "tokenizer.json"
    for post, message in cases:
        path.write_text(json.dumps({**data, "post_processor": post}))
        with pytest.raises(ValueError, match=message) as caught:
            Tokenizer.from_hf(path)
        assert str(path) in str(caught.value)
    with pytest.raises(ValueError, match="bos_token '<s>' is not one of the special tokens"):
        Tokenizer(dict(ours._decoder), ours.merges, ours.special_tokens, ours.pattern, bos_token="<s>")


@pytest.mark.slow
def test_generate_on_a_tiny_llama3_model_starts_from_the_bos(llama3, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from logitlab.cli.main import main

    d, ours, _ = llama3
    cfg = transformers.LlamaConfig(vocab_size=ours.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, bos_token_id=ours.bos_id,
                                   eos_token_id=ours.special_tokens["<|end_of_text|>"])
    model_dir = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((d / name).read_bytes())
    prompt = "Hello 2024 日本"
    assert main(["generate", str(model_dir), prompt, "--max-new-tokens", "2", "--temperature", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"][0] == ours.bos_id
    assert out["prompt_ids"] == kinds.auto(model_dir).encode(prompt) == ours.encode(prompt, add_bos=True)
