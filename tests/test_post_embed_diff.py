"""Embedding diffs: per-row L2 and cosine changes, special tokens apart from ordinary ones, the
special tokens' share of the change, new rows beyond a resized base table, and the LM head when
untied."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from logitlab.inspect.embed_diff import embedding_diff, row_changes, spearman, token_counts
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer


class FakeTok:
    special_tokens = {"<|im_start|>": 60, "<|im_end|>": 61}
    vocab_size = 62

    def token_bytes(self, i):
        return f"t{i}".encode()


def tiny(vocab_size=60, tie=True):
    return Transformer(ModelConfig(vocab_size=vocab_size, context_length=8, d_model=8, n_layers=1, n_heads=2,
                                   vocab_pad_multiple=64, tie_embeddings=tie))


def test_rows_that_moved_are_found_and_specials_listed_first():
    base = tiny()
    tuned = copy.deepcopy(base)
    tuned.config = type(base.config)(**{**base.config.to_dict(), "vocab_size": 62})
    with torch.no_grad():
        tuned.tok_emb.weight[61] += 3.0           # a new special token learned a lot
        tuned.tok_emb.weight[7] *= -1.0           # an ordinary token flipped
        tuned.tok_emb.weight[9] += 0.01
    counts = token_counts([[7, 7, 9, 61], [61]], 62)
    assert counts[7] == 2 and counts[61] == 2 and counts[0] == 0
    out = embedding_diff(base, tuned, FakeTok(), counts, top=2)
    assert out["top_special"][0]["id"] == 61 and out["top_special"][0]["token"] == "t61"
    assert [r["id"] for r in out["top_ordinary"]] == [7, 9]
    assert out["top_ordinary"][0]["cos"] == pytest.approx(-1.0)
    assert out["top_ordinary"][0]["count"] == 2
    l2 = out["l2"]
    assert out["special_share"] == pytest.approx(float(l2[60] + l2[61]) / float(l2.sum()))
    assert out["head"] is None and out["correlation"] is not None


def test_rows_beyond_the_base_table_compare_with_zero():
    l2, cos = row_changes(torch.ones(3, 4), torch.ones(5, 4))
    assert l2[:3].tolist() == [0, 0, 0] and l2[3] == pytest.approx(2.0) and math.isnan(cos[4])


def test_untied_heads_are_compared_too():
    base = tiny(tie=False)
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        tuned.lm_head.weight[3] += 1.0
    out = embedding_diff(base, tuned, top=1)
    assert out["head"]["top_ordinary"][0]["id"] == 3 and out["total_l2"] == 0.0


def test_spearman_matches_a_hand_count():
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1])) == pytest.approx(-1.0)
    assert spearman(torch.tensor([1.0, 1, 1]), torch.tensor([1.0, 2, 3])) is None


def test_ranking_by_relative_change_and_min_count():
    base = tiny()
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        tuned.tok_emb.weight[3] += 0.5 * tuned.tok_emb.weight[3]       # relative change 0.5
        tuned.tok_emb.weight[4] += 0.01                                # small but seen often
        base.tok_emb.weight[5] *= 100.0                                 # a big row moved little relatively
        tuned.tok_emb.weight[5] = base.tok_emb.weight[5] * 1.01
    out = embedding_diff(base, tuned, top=2, by="relative")
    assert out["top_ordinary"][0]["id"] == 3 and out["top_ordinary"][0]["relative"] == pytest.approx(0.5)
    assert embedding_diff(base, tuned, top=1)["top_ordinary"][0]["id"] == 5       # by L2
    counts = torch.zeros(60, dtype=torch.long)
    counts[4] = 9
    assert [r["id"] for r in embedding_diff(base, tuned, counts=counts, min_count=1)["top_ordinary"]] == [4]
    with pytest.raises(ValueError, match="by must be"):
        embedding_diff(base, tuned, by="norm")
