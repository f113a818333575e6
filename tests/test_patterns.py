"""inspect.patterns: attention weights per layer and head, previous-token and induction scores, and
`logitlab inspect --attention-patterns`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from logitlab.inspect import attention_patterns, best_head, induction_scores, previous_token_scores, sink_shares
from logitlab.inspect.patterns import induction_targets
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer

V = 23


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    base = dict(vocab_size=V, context_length=16, d_model=16, n_layers=2, n_heads=2, positions="rope")
    return Transformer(ModelConfig(**{**base, **kw})).eval()


def uniform(model: Transformer) -> Transformer:
    """q and k projections zeroed: every score is 0, so query t spreads 1 / (t + 1) over keys 0..t."""
    with torch.no_grad():
        for block in model.blocks:
            H, Hkv, Dh = block.attn.n_heads, block.attn.n_kv_heads, block.attn.head_dim
            block.attn.qkv_proj.weight[: (H + Hkv) * Dh] = 0
            if block.attn.qkv_proj.bias is not None:
                block.attn.qkv_proj.bias[: (H + Hkv) * Dh] = 0
    return model


def test_patterns_are_the_eager_weights_per_layer_and_head():
    model = tiny(n_kv_heads=1)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    patterns = attention_patterns(model, ids)
    assert sorted(patterns) == [0, 1]
    _, weights = model.forward_with_attention(torch.tensor([ids]))
    for layer, w in patterns.items():
        assert w.shape == (2, 8, 8) and w.dtype == torch.float32
        torch.testing.assert_close(w, weights[layer][0].detach())
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 8))
        assert bool((w.triu(1) == 0).all())                       # causal: no weight on later keys
    assert model.attn_impl == "sdpa"                               # the model's own setting is left alone


def test_zeroed_queries_and_keys_give_the_hand_computed_scores():
    model = uniform(tiny())
    ids = [5, 7, 2, 5, 7, 2]                                       # "5 7 2" twice
    patterns = attention_patterns(model, ids)
    for w in patterns.values():
        expected = torch.tensor([[1 / (t + 1) if s <= t else 0.0 for s in range(6)] for t in range(6)])
        torch.testing.assert_close(w, expected.expand(2, 6, 6))
    prev = sum(1 / (t + 1) for t in range(1, 6)) / 5               # query t reads t - 1 with 1 / (t + 1)
    ind = (1 / 4 + 1 / 5 + 1 / 6) / 3                              # queries 3, 4, 5 read keys 1, 2, 3
    for layer in (0, 1):
        assert all(math.isclose(x, prev, rel_tol=1e-5) for x in previous_token_scores(patterns)[layer])
        assert all(math.isclose(x, ind, rel_tol=1e-5) for x in induction_scores(patterns, ids)[layer])


def test_scores_on_hand_built_patterns():
    T, N = 8, 4
    ids = [0, 1, 2, 3, 0, 1, 2, 3]
    induction = torch.zeros(T, T)
    induction[0, 0] = 1
    for t in range(1, T):                                          # first copy: previous token
        induction[t, t - 1] = 1
    for t in range(N, T):                                          # second copy: after the last occurrence
        induction[t] = 0
        induction[t, t - N + 1] = 1
    previous = torch.zeros(T, T)
    previous[0, 0] = 1
    previous[torch.arange(1, T), torch.arange(T - 1)] = 1
    patterns = {0: torch.stack([previous, induction]), 3: torch.stack([induction, previous])}
    scores = induction_scores(patterns, ids)
    assert scores == {0: [0.0, 1.0], 3: [1.0, 0.0]}
    prev = previous_token_scores(patterns)
    assert prev[0] == [1.0, pytest.approx(3 / 7)]                  # induction's first copy: 3 of 7 queries
    assert best_head(scores) == (0, 1, 1.0)
    assert best_head(prev) == (0, 0, 1.0)
    assert induction_targets(ids) == [(4, 1), (5, 2), (6, 3), (7, 4)]
    assert induction_targets([1, 2, 1, 1]) == [(2, 1), (3, 3)]    # the most recent occurrence; may be t itself


def test_errors_name_what_is_wrong():
    model = tiny()
    with pytest.raises(ValueError, match="at least 2 token ids"):
        attention_patterns(model, [1])
    with pytest.raises(ValueError, match="no token of these 4 ids occurs twice"):
        induction_scores(attention_patterns(model, [1, 2, 3, 4]), [1, 2, 3, 4])
    with pytest.raises(ValueError, match="covers 4 positions but ids has 5"):
        induction_scores(attention_patterns(model, [1, 2, 1, 2]), [1, 2, 1, 2, 1])
    with pytest.raises(ValueError, match=r"expected attention weights \(H, T, T\)"):
        previous_token_scores({0: torch.ones(2, 3, 4)})
    with pytest.raises(ValueError, match="at least one layer"):
        best_head({})


def test_linear_layers_have_no_pattern_and_sink_shares_reads_the_same_weights():
    model = tiny(n_layers=2, layer_types=("linear_attention", "full_attention"), positions="rope",
                 norm="rmsnorm")
    ids = [1, 2, 3, 1, 2, 3]
    patterns = attention_patterns(model, ids)
    assert list(patterns) == [1]
    (share,) = sink_shares(model, ids, k=2)
    assert share.layer == 1
    assert share.first == pytest.approx(patterns[1][:, 1:, 0].mean(dim=1).tolist())


@pytest.fixture
def checkpoint_dir(tmp_path):
    from tests.test_introspect import _checkpoint

    return _checkpoint(tmp_path)


def test_cli_attention_patterns_json_and_grid(checkpoint_dir, capsys):
    from logitlab.cli.main import main

    d, tok = checkpoint_dir
    text = "the cat the cat"
    ids = tok.encode(text)
    assert main(["inspect", str(d), text, "--attention-patterns", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["patterns"]
    assert report["layer"] == 1 and report["heads"] == [0, 1, 2, 3]
    assert len(report["weights"]) == 4 and len(report["weights"][0]) == len(ids)
    assert len(report["induction"]) == 4 and len(report["previous_token"]) == 4
    assert main(["inspect", str(d), text, "--attention-patterns", "0:2"]) == 0
    out = capsys.readouterr().out
    assert "layer 0 head 2" in out and "layer 0 head 1" not in out and "induction" in out
    grid = [line for line in out.splitlines() if line.rstrip().endswith("|") and "|" in line]
    assert len(grid) == len(ids)
    assert grid[0].split("|")[1][1:].strip() == ""                # query 0 reads key 0 only
    for bad, words in (("2", "no such layer"), ("0:9", "heads 0..3"), ("x", "LAYER or LAYER:HEAD")):
        code = None
        try:
            code = main(["inspect", str(d), text, "--attention-patterns", bad])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        assert words in capsys.readouterr().err
