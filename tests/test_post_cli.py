"""The post-training commands end to end on a tiny model: `tokenizer add-special` into padded
slots, `sft` with LoRA and a Hugging Face + PEFT export that AutoTokenizer / PEFT read back with
the same template and logits, and `embedding-diff`."""

from __future__ import annotations

import json

import pytest
import torch

from logitlab.cli.main import main
from logitlab.io.checkpoint import load_for_inference
from logitlab.io.model_dir import TOKENIZER_FILE, save_model
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer
from logitlab.tokenizer.bpe import train_tokenizer

CHATS = [[{"role": "user", "content": f"What does {w} do?"}, {"role": "assistant", "content": f"It {w}s."}]
         for w in ("sort", "sum", "map", "zip", "hash", "iter", "find", "join")]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("post")
    (root / "a.txt").write_text(" ".join(c[0]["content"] + " " + c[1]["content"] for c in CHATS) * 20)
    tok = train_tokenizer(root / "a.txt", 290, ["<|endoftext|>"], workers=1)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=1, n_heads=2,
                      positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, vocab_pad_multiple=64)
    save_model(Transformer(cfg), root / "base")
    tok.save(root / "base" / TOKENIZER_FILE)
    with open(root / "chats.jsonl", "w") as f:
        for c in CHATS * 3:
            f.write(json.dumps({"messages": c}) + "\n")
    return root


def test_add_special_then_sft_with_lora_then_diff(base, capsys):
    root = base
    assert main(["tokenizer", "add-special", str(root / "base"), "--out", str(root / "chat")]) == 0
    assert "used padded rows" in capsys.readouterr().out
    model, tok = load_for_inference(root / "chat")
    assert tok.special_tokens["<|im_end|>"] == model.config.vocab_size - 1
    assert model.tok_emb.weight.shape[0] == 320
    code = main(["sft", str(root / "chat"), "--data", str(root / "chats.jsonl"), "--out",
                 str(root / "run"), "--steps", "3", "--batch-size", "2", "--eval-every", "3", "--device", "cpu",
                 "--lr", "1e-2", "--samples", "1", "--lora-targets", "q_proj,v_proj,o_proj", "--lora-r", "2",
                 "--tensorboard", "false", "--export-hf", str(root / "hf")])
    out = capsys.readouterr().out
    assert code == 0 and "val loss" in out and "sample:" in out
    assert (root / "hf-adapter" / "adapter_config.json").is_file()
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    ids = hf_tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == tok.apply_chat_template(CHATS[0][:1], add_generation_prompt=True)
    assert hf_tok.eos_token == "<|im_end|>"

    code = main(["embedding-diff", str(root / "chat"), str(root / "run"), "--data", str(root / "chats.jsonl"),
                 "--json", "--plot", str(root / "diff.png")])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and (root / "diff.png").stat().st_size > 0
    assert report["total_l2"] == 0.0        # LoRA on attention only: the embedding did not move


def test_add_special_resizes_value_embeddings_and_names_them(base, capsys):
    # a model of the speedrun recipe (value embeddings) with no padded slot: every token table grows
    root, tok = base, load_for_inference(base / "base")[1]
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2, n_heads=2,
                      positions="rope", norm="rmsnorm", mlp="relu2", bias=False, vocab_pad_multiple=1,
                      value_embeddings="alternate")
    save_model(Transformer(cfg), root / "ve")
    tok.save(root / "ve" / TOKENIZER_FILE)
    assert main(["tokenizer", "add-special", str(root / "ve"), "--out", str(root / "ve-chat")]) == 0
    said = " ".join(capsys.readouterr().out.split())          # the console wraps at 80 columns
    assert "resized the embedding, value embeddings and LM head to 292 rows" in said
    model, tok = load_for_inference(root / "ve-chat")
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[tok.special_tokens["<|im_end|>"]]]))).all()


def test_full_sft_from_the_command_line_moves_the_weights(base, capsys):
    root = base
    if not (root / "chat").exists():
        main(["tokenizer", "add-special", str(root / "base"), "--out", str(root / "chat")])
    code = main(["sft", str(root / "chat"), "--data", str(root / "chats.jsonl"), "--out",
                 str(root / "full"), "--steps", "2", "--batch-size", "2", "--device", "cpu", "--samples", "0",
                 "--pack", "false", "--train-on", "last", "--tensorboard", "false"])
    assert code == 0
    before, _ = load_for_inference(root / "chat")
    after, _ = load_for_inference(root / "full")
    assert not torch.equal(before.blocks[0].mlp.down_proj.weight, after.blocks[0].mlp.down_proj.weight)
    code = main(["sft", str(root / "chat"), "--data", str(root / "chats.jsonl"), "--out",
                 str(root / "bad"), "--steps", "1", "--train-special-rows"])
    assert code == 2 and "--train-special-rows is for LoRA" in capsys.readouterr().err


def test_add_special_refuses_both_sources(base, capsys):
    code = main(["tokenizer", "add-special", "--out", str(base / "x.json")])
    assert code == 2 and "exactly one of MODEL" in capsys.readouterr().err
    code = main(["tokenizer", "add-special", "--tokenizer", str(base / "base" / TOKENIZER_FILE),
                 "--tokens", "<|tool|>", "--chat-template", "chatml", "--out", str(base / "t.json")])
    assert code == 0
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer.load(base / "t.json")
    assert "<|tool|>" in tok.special_tokens and tok.chat_template.startswith("{% for message")


def test_chat_uses_the_template_and_stops_at_the_end_of_turn(base, capsys, monkeypatch):
    import io

    import logitlab.tokenizer.chat as chat

    root = base
    if not (root / "chat").exists():
        main(["tokenizer", "add-special", str(root / "base"), "--out", str(root / "chat")])
    rendered = []
    real = chat.fit_history

    def spy(tok, messages, budget):
        rendered.append([dict(m) for m in messages])
        return real(tok, messages, budget)

    monkeypatch.setattr(chat, "fit_history", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("What does sort do?\n/reset\nAnd zip?\n"))
    code = main(["chat", str(root / "chat"), "--max-new-tokens", "4", "--temperature", "0",
                 "--system", "Be brief."])
    out = capsys.readouterr().out
    assert code == 0 and "history cleared" in out
    first, second = rendered                                      # one template rendering per turn
    assert first == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does sort do?"}]
    assert second == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And zip?"}]
