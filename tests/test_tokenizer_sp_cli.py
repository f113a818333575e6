"""A SentencePiece-style tokenizer through the command line and the stages that take a tokenizer:
`tokenizer show` prints "▁" and byte-fallback pieces as they are; a tiny random Llama in a Hugging
Face directory with such a tokenizer.json generates, chats, is inspected, evaluated, served and
exported, with the ids and text transformers gives."""

from __future__ import annotations

import io
import json
import shutil
import warnings

import pytest

pytest.importorskip("tokenizers")
import _sp_tokenizers as kinds  # noqa: E402

from logitlab.cli.main import main  # noqa: E402
from logitlab.tokenizer.core import Tokenizer  # noqa: E402

# TinyLlama's chat layout: turns end with </s>, which the template writes as eos_token
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random 2-layer Llama with a Llama-2-style tokenizer.json and tokenizer_config.json."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("llama")
    theirs = kinds.build("llama", d)
    kinds.write_config(d, "llama", tokenizer_class="LlamaTokenizer", legacy=False, chat_template=TEMPLATE)
    cfg = transformers.LlamaConfig(vocab_size=theirs.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def _auto(directory):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(directory))


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_tokenizer_show_prints_pieces_as_they_are(hf_dir, capsys):
    path = str(hf_dir / "tokenizer.json")
    assert main(["tokenizer", "show", "--tokenizer", path, "Hi 日</s>"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    tok = Tokenizer.from_hf(hf_dir / "tokenizer.json")
    ids = tok.encode("Hi 日</s>")
    assert "'▁" in out and "'<0xE6>'" in out and "e6" in out and "'</s>' special" in out
    assert f"{len(ids)} tokens" in out and "SentencePiece-style BPE" in out and "byte fallback" in out
    assert _json(capsys, ["tokenizer", "encode", "--tokenizer", path, "Hi 日", "--json"]) == tok.encode("Hi 日")
    assert _json(capsys, ["tokenizer", "decode", "--tokenizer", path, "--json", *map(str, ids)]) == \
        {"text": tok.decode(ids)}


def test_tokenizer_convert_writes_each_format(hf_dir, tmp_path, capsys):
    path = str(hf_dir / "tokenizer.json")
    tok = Tokenizer.from_hf(path)
    assert main(["tokenizer", "convert", "--tokenizer", path, "--to", "logitlab",
                 "--out", str(tmp_path / "t.json")]) == 0
    assert Tokenizer.load(tmp_path / "t.json").fingerprint() == tok.fingerprint()
    assert main(["tokenizer", "convert", "--tokenizer", str(tmp_path / "t.json"), "--to", "hf",
                 "--out", str(tmp_path / "tokenizer.json")]) == 0
    from tokenizers import Tokenizer as HF

    assert HF.from_file(str(tmp_path / "tokenizer.json")).encode("a  b 日").ids == tok.encode("a  b 日", add_bos=True)
    capsys.readouterr()
    assert main(["tokenizer", "convert", "--tokenizer", path, "--to", "tiktoken", "--out", str(tmp_path / "r")]) == 2
    assert "no tiktoken rank file" in capsys.readouterr().err


def test_generate_starts_from_bos_and_streams_transformers_text(hf_dir, capsys):
    from logitlab.generate.loop import SampleConfig, generate
    from logitlab.io.hf import load_pretrained

    auto = _auto(hf_dir)
    prompt = "Hello  wörld 日本"
    out = _json(capsys, ["generate", "--hf", str(hf_dir), prompt, "--temperature", "0", "--max-new-tokens", "16",
                         "--banned-ids", "2", "--json"])
    assert out["prompt_ids"] == auto.encode(prompt) and out["prompt_ids"][0] == 1  # <s> first
    expect = generate(load_pretrained(hf_dir), out["prompt_ids"], SampleConfig(temperature=0, max_new_tokens=16,
                                                                               banned_ids=(2,))).tokens[0]
    assert out["ids"] == expect
    before = auto.decode(out["prompt_ids"])
    assert out["text"] == auto.decode(out["prompt_ids"] + out["ids"])[len(before):]  # the continuation's text
    # the empty prompt is <s> alone
    assert _json(capsys, ["generate", "--hf", str(hf_dir), "", "--max-new-tokens", "2", "--json"])["prompt_ids"] == [1]


def test_chat_uses_the_template_and_stops_at_eos(hf_dir, capsys, monkeypatch):
    from logitlab.io.hf import load_tokenizer

    tok, auto = load_tokenizer(hf_dir), _auto(hf_dir)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": " 日本?"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.eot_id == 2 and tok.special_tokens["</s>"] == 2
    # SFT's pieces: the whole chat's ids (each piece alone would start with a "▁" of its own)
    turns = tok.chat_turns(messages[:2])
    assert [i for _, ids in turns for i in ids] == tok.apply_chat_template(messages[:2])
    assert [r for r, _ in turns] == ["user", "generation_prompt", "assistant"]
    assert tok.decode(turns[-1][1]) == "Hello!</s>\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nAgain\n"))
    assert main(["chat", "--hf", str(hf_dir), "--max-new-tokens", "5", "--seed", "0"]) == 0
    assert capsys.readouterr().out.count("tok/s") == 2


def test_inspect_eval_and_serve_prompts_start_from_bos(hf_dir, capsys):
    from logitlab.eval.bpb import evaluate_bpb
    from logitlab.io.hf import load_pretrained, load_tokenizer
    from logitlab.serve.protocol import TextStream, completion_prompts

    tok = load_tokenizer(hf_dir)
    report = _json(capsys, ["inspect", "--hf", str(hf_dir), "Hello world", "--bos", "--json"])
    assert report["ids"] == tok.encode("Hello world", add_bos=True)
    assert completion_prompts({"prompt": ["Hi", ""]}, tok) == [tok.encode("Hi", add_bos=True), [tok.bos_id]]
    ids = tok.encode(" ok 日本 €")
    stream = TextStream(tok)
    assert "".join(stream.feed(i) for i in ids) + stream.finish() == "".join(tok.decode_stream(ids))
    result = evaluate_bpb(load_pretrained(hf_dir), tok, ["Hello world.\n", "日本語"])
    assert result.documents == 2 and result.bits_per_byte > 0


def test_export_round_trip_keeps_the_tokenizer(hf_dir, tmp_path, capsys):
    """HF directory -> logitlab model directory (tokenizer.logitlab.json) -> HF directory again:
    AutoTokenizer reads the written one with the ids of the original."""
    from logitlab.io import checkpoint

    assert main(["convert", "--hf", str(hf_dir), "--out", str(tmp_path / "ours")]) == 0
    back = Tokenizer.load(tmp_path / "ours" / checkpoint.TOKENIZER_FILE)
    assert back.chat_template == TEMPLATE and back.eot_id == 2
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    original, written = _auto(hf_dir), _auto(tmp_path / "hf")
    for text in ["Hello</s>World <s> x", "  lead 日本 🎉", ""]:
        assert written.encode(text) == original.encode(text)
        assert written.decode(original.encode(text)) == original.decode(original.encode(text))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    shutil.rmtree(tmp_path / "hf")
