"""Growing a model's visible vocabulary for new special tokens: into padded rows, or by a resize.

vocab.py owns the model's half of adding special tokens (the tokenizer's half is
logitlab.tokenizer.special). A model built with `vocab_pad_multiple` > 1 has
`padded_vocab_size - vocab_size` rows in its embedding table and LM head that no id reaches and
no logit shows (transformer.py multiplies only the head's first V rows). New tokens take those
slots: `config.vocab_size` grows, no tensor changes shape, and the new rows are set by the init
rule. When there are not enough free slots the two tables are resized explicitly (to the new
vocabulary rounded up to vocab_pad_multiple) and the report says so.

Init rules for the new rows (embedding, the value-embedding tables when the model has them, and,
when untied, LM head):

* "mean" (default): the mean of the existing visible rows, the common recipe (Hewitt 2021,
  "Initializing new word embeddings for pretrained language models"): a new token's logit is then
  the mean of the old logits, so it neither dominates nor vanishes from the softmax before SFT
  teaches it, and its embedding lies inside the cloud of trained ones;
* "keep": padded slots keep what they hold (the pretraining initialisation, shrunk by weight
  decay); not allowed for a resize, whose new rows hold nothing yet.

Old ids keep their rows bit for bit, so an old checkpoint gives the same logits on old ids over
the old vocabulary's columns; only new columns are added to the softmax.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

INIT_RULES = ("mean", "keep")


def free_slots(config) -> int:
    """Rows of the embedding and LM head that no id uses yet (padded_vocab_size - vocab_size)."""
    return config.padded_vocab_size - config.vocab_size


@torch.no_grad()
def grow_vocab(model, vocab_size: int, init: str = "mean") -> dict:
    """Make `model` (a Transformer, changed in place) accept ids 0..vocab_size-1.

    -> {"old_vocab_size", "vocab_size", "padded_vocab_size", "resized": bool, "init", "new_rows"}.
    vocab_size below the model's is a ValueError (ids would be lost), as is an unknown rule."""
    config = model.config
    old = config.vocab_size
    if init not in INIT_RULES:
        raise ValueError(f"init must be one of {INIT_RULES}, got {init!r}")
    if not isinstance(vocab_size, int) or vocab_size < old:
        raise ValueError(f"vocab_size ({vocab_size!r}) must be an int >= the model's vocab_size ({old})")
    resized = vocab_size > config.padded_vocab_size
    if resized and init == "keep":
        raise ValueError(f"vocab_size {vocab_size} exceeds the {config.padded_vocab_size} rows the model has, "
                         f"so the tables must be resized and their new rows initialised: use init='mean'")
    new_config = dataclasses.replace(config, vocab_size=vocab_size)
    if resized:
        _resize_tables(model, new_config.padded_vocab_size)
    model.config = new_config
    if init == "mean" and vocab_size > old:
        tables = [model.tok_emb.weight, *_value_tables(model)]
        if not config.tie_embeddings:
            tables.append(model.lm_head.weight)
        for weight in tables:                                  # (V_padded, D) or (V_padded, Hkv*Dh)
            weight[old:vocab_size] = weight[:old].float().mean(dim=0).to(weight.dtype)
    return {"old_vocab_size": old, "vocab_size": vocab_size, "padded_vocab_size": new_config.padded_vocab_size,
            "resized": resized, "init": init, "new_rows": list(range(old, vocab_size))}


def _value_tables(model) -> list:
    """The (V_padded, Hkv*Dh) tables of the value embeddings (ModelConfig.value_embeddings), if any:
    token tables like the embedding, so they grow with it."""
    return [ve.embed.weight for ve in (model.value_embeds or {}).values()]


def _grown_embedding(old: nn.Embedding, rows: int) -> nn.Embedding:
    """A (rows, width) table holding `old`'s rows; the rest zero until initialised."""
    n, width = old.weight.shape
    new = nn.Embedding(rows, width, device=old.weight.device, dtype=old.weight.dtype)
    new.weight.zero_()
    new.weight[:n] = old.weight
    new.weight.requires_grad_(old.weight.requires_grad)
    return new


def _resize_tables(model, rows: int) -> None:
    """New (rows, D) embedding and LM head, and (rows, Hkv*Dh) value-embedding tables, holding the
    old rows; the rest zero until initialised."""
    old_emb = model.tok_emb.weight                             # (V_padded_old, D)
    n, D = old_emb.shape
    model.tok_emb = _grown_embedding(model.tok_emb, rows)
    for ve in (model.value_embeds or {}).values():
        ve.embed = _grown_embedding(ve.embed, rows)
    if model.config.tie_embeddings:
        model.lm_head = nn.Linear(D, rows, bias=False, device=old_emb.device, dtype=old_emb.dtype)
        model.lm_head.weight = model.tok_emb.weight
        return
    old_head = model.lm_head.weight
    head = nn.Linear(D, rows, bias=False, device=old_head.device, dtype=old_head.dtype)
    head.weight.zero_()
    head.weight[:n] = old_head
    head.weight.requires_grad_(old_head.requires_grad)
    model.lm_head = head


def fit_vocab(model, tokenizer, init: str = "mean") -> dict:
    """Grow `model` to every id of `tokenizer` (e.g. one that tokenizer.special.add_special_tokens
    returned): grow_vocab to tokenizer.vocab_size when that is larger. -> grow_vocab's report."""
    return grow_vocab(model, max(model.config.vocab_size, tokenizer.vocab_size), init)
