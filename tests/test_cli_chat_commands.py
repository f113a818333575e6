"""The chat REPL's commands besides /reset and /help (driven through stdin; the real terminal is
tests/test_chat_repl.py's): /temperature and /top-p change the next replies' sampling, /show
prints the exact text the model reads next, /save writes the conversation to a new file."""

from __future__ import annotations

import io
import json

import pytest
import torch

from logitlab.cli.main import main


def _model_dir(tmp_path, specials=("<|endoftext|>",)):
    from logitlab.io.model_dir import TOKENIZER_FILE, save_model
    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.tokenizer.core import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [], special_tokens=list(specials))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=96, d_model=16, n_layers=1,
                                    n_heads=2, positions="rope"))
    d = tmp_path / "model"
    save_model(model, d)
    tok.save(d / TOKENIZER_FILE)
    return d


def _chat(monkeypatch, capsys, model, lines: list[str]) -> str:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    banned = ",".join(str(i) for i in range(256) if i < 32 or i >= 127)
    assert main(["chat", str(model), "--max-new-tokens", "4", "--banned-ids", banned, "--seed", "0"]) == 0
    return capsys.readouterr().out


def test_commands_of_a_transcript_chat(tmp_path, monkeypatch, capsys):
    model, saved = _model_dir(tmp_path), tmp_path / "chat.txt"
    out = _chat(monkeypatch, capsys, model, ["/temperature 0", "/top-p 0.5", "hello", "/show", f"/save {saved}",
                                             f"/save {saved}", "/temperature -1", "/top-p", "/bogus"])
    assert "temperature = 0.0" in out and "top_p = 0.5" in out
    assert "User: hello\nAssistant:" in out                    # /show: the transcript the model reads
    assert saved.read_text().startswith("User: hello\nAssistant:")
    assert f"saved the transcript to {saved}" in out
    assert f"error: {saved} exists; /save writes a new file" in out
    assert "error: temperature must be a finite number >= 0, got -1.0" in out
    assert out.count("unknown command") == 2                   # /top-p without a value, and /bogus


def test_commands_of_a_templated_chat(tmp_path, monkeypatch, capsys):
    model = _model_dir(tmp_path, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    saved = tmp_path / "chat.jsonl"
    out = _chat(monkeypatch, capsys, model, ["hi", "/show", f"/save {saved}"])
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" in out
    messages = json.loads(saved.read_text())["messages"]
    assert messages[0] == {"role": "user", "content": "hi"} and messages[1]["role"] == "assistant"


@pytest.mark.parametrize("line, said", [("/save", "unknown command '/save' (or its value is missing)"),
                                        ("/temperature x", "error: /temperature needs a number, got 'x'")])
def test_a_bad_command_is_one_line_and_the_chat_goes_on(tmp_path, monkeypatch, capsys, line, said):
    out = _chat(monkeypatch, capsys, _model_dir(tmp_path), [line, "/help"])
    assert said in out and "list these commands" in out
