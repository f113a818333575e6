"""New special tokens: the tokenizer gains ids after its last one, the model's visible vocabulary
grows into padded rows (no tensor changes shape) or is resized with mean-initialised rows, and an
old checkpoint with the new tokens gives the same logits on old ids."""

from __future__ import annotations

import pytest
import torch

from logitlab.io.model_dir import load_model, save_model
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer
from logitlab.tokenizer.bpe import train_tokenizer
from logitlab.tokenizer.core import Tokenizer
from logitlab.tokenizer.special import add_special_tokens
from logitlab.train.vocab import fit_vocab, free_slots, grow_vocab

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("corpus") / "a.txt"
    path.write_text(TEXT)
    return train_tokenizer(path, 280, ["<|endoftext|>"], workers=1)


def tiny(vocab_size: int, pad: int, tie: bool = True) -> Transformer:
    cfg = ModelConfig(vocab_size=vocab_size, context_length=32, d_model=16, n_layers=1, n_heads=2,
                      vocab_pad_multiple=pad, tie_embeddings=tie, positions="rope", norm="rmsnorm", mlp="swiglu")
    return Transformer(cfg).eval()


def test_add_special_tokens_appends_ids_and_keeps_old_ones(tok):
    new, added = add_special_tokens(tok, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert added == {"<|im_start|>": tok.vocab_size, "<|im_end|>": tok.vocab_size + 1}
    assert new.vocab_size == tok.vocab_size + 2
    assert new.special_tokens["<|endoftext|>"] == tok.eot_id
    assert new.encode(TEXT) == tok.encode(TEXT)
    assert new.encode("<|im_start|>user\nhi<|im_end|>")[0] == added["<|im_start|>"]
    with pytest.raises(ValueError, match="already ordinary token"):
        add_special_tokens(tok, ["def"])
    with pytest.raises(ValueError, match="non-empty"):
        add_special_tokens(tok, [""])


def test_new_tokens_take_padded_slots_without_changing_shapes(tok, tmp_path):
    model = tiny(tok.vocab_size, pad=64)
    assert free_slots(model.config) == 320 - tok.vocab_size
    save_model(model, tmp_path / "old")
    old = load_model(tmp_path / "old").eval()
    shapes = {k: v.shape for k, v in old.state_dict().items()}
    new_tok, added = add_special_tokens(tok, ["<|im_start|>", "<|im_end|>"])
    report = fit_vocab(old, new_tok)
    assert not report["resized"] and report["new_rows"] == list(added.values())
    assert {k: v.shape for k, v in old.state_dict().items()} == shapes
    assert old.config.vocab_size == new_tok.vocab_size
    ids = torch.tensor([tok.encode(TEXT)[:32]])
    with torch.no_grad():
        before, after = model(ids), old(ids)
    assert after.shape[-1] == before.shape[-1] + 2
    torch.testing.assert_close(after[..., :tok.vocab_size], before, rtol=0, atol=0)
    mean = model.tok_emb.weight[:tok.vocab_size].mean(0)
    torch.testing.assert_close(old.tok_emb.weight[new_tok.vocab_size - 1], mean)
    # the grown model round-trips through a model directory
    save_model(old, tmp_path / "new")
    again = load_model(tmp_path / "new").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(torch.tensor([[added["<|im_end|>"]]])),
                                   old(torch.tensor([[added["<|im_end|>"]]])))


@pytest.mark.parametrize("tie", [True, False])
def test_no_free_slots_resizes_with_mean_rows(tok, tie):
    model = tiny(tok.vocab_size, pad=1, tie=tie)
    assert free_slots(model.config) == 0
    ids = torch.tensor([tok.encode(TEXT)[:20]])
    with torch.no_grad():
        before = model(ids)
    with pytest.raises(ValueError, match="resized"):
        grow_vocab(model, tok.vocab_size + 3, init="keep")
    report = grow_vocab(model, tok.vocab_size + 3)
    assert report["resized"] and model.tok_emb.weight.shape[0] == tok.vocab_size + 3
    assert (model.lm_head.weight is model.tok_emb.weight) == tie
    with torch.no_grad():
        after = model(ids)
    torch.testing.assert_close(after[..., :tok.vocab_size], before, rtol=0, atol=0)
    head = model.lm_head.weight
    torch.testing.assert_close(head[-1], head[:tok.vocab_size].mean(0))
    with pytest.raises(ValueError, match="must be an int >="):
        grow_vocab(model, 5)


@pytest.mark.parametrize("pad", [1, 64])
def test_value_embedding_tables_grow_with_the_vocabulary(tok, pad):
    # the speedrun recipe's value embeddings are token tables too: a new id must find a row in them
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=16, n_layers=2, n_heads=2,
                      n_kv_heads=1, vocab_pad_multiple=pad, positions="rope", norm="rmsnorm", mlp="relu2",
                      value_embeddings="alternate")
    model = Transformer(cfg).eval()
    ids = torch.tensor([tok.encode(TEXT)[:20]])
    with torch.no_grad():
        before = model(ids)
    report = grow_vocab(model, tok.vocab_size + 3)
    assert report["resized"] == (pad == 1)
    tables = [ve.embed.weight for ve in model.value_embeds.values()]
    assert tables and all(t.shape == (report["padded_vocab_size"], cfg.n_kv_heads * cfg.head_dim) for t in tables)
    with torch.no_grad():
        after = model(ids)
        new_id = model(torch.cat([ids, torch.tensor([[tok.vocab_size + 2]])], dim=1))
    torch.testing.assert_close(after[..., :tok.vocab_size], before, rtol=0, atol=0)
    assert new_id.shape[-1] == tok.vocab_size + 3 and torch.isfinite(new_id).all()
    for t in tables:
        torch.testing.assert_close(t[tok.vocab_size + 2], t[:tok.vocab_size].mean(0))


def test_chat_template_survives_the_logitlab_file(tok, tmp_path):
    new, _ = add_special_tokens(tok, ["<|im_start|>", "<|im_end|>"])
    new.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    new.save(tmp_path / "t.json")
    back = Tokenizer.load(tmp_path / "t.json")
    assert back.chat_template == new.chat_template and back.special_tokens == new.special_tokens
