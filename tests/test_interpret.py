"""The analyses over the hook points: direct logit attribution (inspect/attribution.py) summing to the
logit exactly and held to a recomputation by hand; activation patching (inspect/patching.py) batched
against its one-forward-per-place definition, and attribution patching against it on a linear toy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from logitlab.inspect.attribution import direct_logit_attribution
from logitlab.inspect.patching import (
    activation_patching,
    activation_patching_reference,
    attribution_patching,
    logit_difference,
)
from logitlab.model.hooks import tap
from tests.test_hooks import ARCHS, build, ids


@pytest.mark.parametrize("arch", ARCHS)
def test_attribution_parts_sum_to_the_logit_and_heads_to_their_layer(arch):
    model = build(arch)
    x = ids(B=1)[0]
    for token, other, position in ((5, 7, -1), (3, None, 4)):
        r = direct_logit_attribution(model, x, token, other, position)
        with torch.no_grad():
            row = model(x[None])[0, position].double()
        assert r.logit == pytest.approx(float(row[token] - (row[other] if other is not None else 0)), abs=1e-6)
        assert r.total == pytest.approx(r.logit, abs=1e-5)
        for i in range(model.config.n_layers):
            heads = [v for k, v in r.heads.items() if k.startswith(f"blocks.{i}.attn.")]
            if heads:
                assert sum(heads) == pytest.approx(r.parts[f"blocks.{i}.attn_out"], abs=1e-6)
    assert len(r.parts) == 1 + ("pos_embed" in r.parts) + 2 * model.config.n_layers + ("final_norm.bias" in r.parts)


def test_attribution_of_gpt2_equals_a_recomputation_by_hand():
    """The embedding's share by hand: LayerNorm with its 1/std taken from the full residual stream,
    then the LM head's row."""
    model = build("gpt2")
    x = ids(B=1)[0]
    r = direct_logit_attribution(model, x, 11)
    n = model.final_norm
    with torch.no_grad():
        resid = model.forward_features(x[None])[0, -1].double()   # (D,) the stream the final norm reads
        s = 1 / torch.sqrt(resid.var(unbiased=False) + n.eps)
        emb = model.tok_emb.weight[x[-1]].double()
        u = model.lm_head.weight[11].double()
        by_hand = float(s * ((emb - emb.mean()) * n.weight.double()) @ u)
        bias = float(n.bias.double() @ u)
    assert r.parts["embed"] == pytest.approx(by_hand, abs=1e-6)
    assert r.parts["final_norm.bias"] == pytest.approx(bias, abs=1e-9)


def test_attribution_refuses_post_norm_and_bad_tokens():
    model = build("gpt2", norm_placement="post")
    with pytest.raises(ValueError, match="pre-norm"):
        direct_logit_attribution(model, ids(B=1)[0], 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        direct_logit_attribution(build("gpt2"), ids(B=1)[0], 61)


@pytest.mark.parametrize("arch", ["gpt2", "hybrid", "moe"])
def test_batched_patching_equals_one_forward_per_place(arch):
    model = build(arch)
    x = ids(B=2, T=6)
    metric = logit_difference(5, 7)
    names = ["blocks.*.resid_pre", "blocks.1.mlp_out"]
    fast = activation_patching(model, x[0], x[1], metric, names, batch_size=4)
    ref = activation_patching_reference(model, x[0], x[1], metric, names)
    assert fast.names == ref.names == ["blocks.0.resid_pre", "blocks.1.resid_pre", "blocks.1.mlp_out"]
    assert fast.scores.shape == (3, 6)
    torch.testing.assert_close(fast.scores, ref.scores, rtol=0, atol=1e-5)
    # patching the whole stream at the last position before the last block restores everything
    last = activation_patching(model, x[0], x[1], metric, "blocks.1.resid_post")
    assert last.scores[0, -1].item() == pytest.approx(1.0, abs=1e-4)
    assert last.scores[0, :-1].abs().max().item() < 1e-4    # later positions cannot reach the last


def test_patching_per_head_equals_the_definition():
    model = build("llama-gqa")
    x = ids(B=2, T=5)
    metric = logit_difference(2, 9)
    fast = activation_patching(model, x[0], x[1], metric, "blocks.*.attn.z", per="head")
    ref = activation_patching_reference(model, x[0], x[1], metric, "blocks.*.attn.z", per="head")
    assert fast.scores.shape == (2, 4)
    torch.testing.assert_close(fast.scores, ref.scores, rtol=0, atol=1e-5)


class LinearToy(nn.Module):
    """ids -> logits through linear maps only (a causal running sum for the mixing), so the metric is
    linear in every activation and attribution patching is exact."""

    HOOKS = {"embed": "(B, T, D) embeddings", "mixed": "(B, T, D) running sums", "logits": "(B, T, V)"}
    _taps = None

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix, self.head = nn.Embedding(13, 8), nn.Linear(8, 8), nn.Linear(8, 13)

    def forward(self, ids):
        e = tap(self, "embed", self.emb(ids))
        m = tap(self, "mixed", self.mix(e.cumsum(dim=1)))
        return tap(self, "logits", self.head(m))


def test_attribution_patching_equals_activation_patching_on_a_linear_toy():
    toy = LinearToy()
    clean, corrupt = [1, 2, 3, 4, 5], [1, 7, 3, 9, 5]
    metric = logit_difference(4, 6)
    exact = activation_patching(toy, clean, corrupt, metric, ["embed", "mixed"])
    approx = attribution_patching(toy, clean, corrupt, metric, ["embed", "mixed"])
    torch.testing.assert_close(approx.scores, exact.scores, rtol=1e-5, atol=1e-6)
    assert exact.scores[0, 1].abs() > 0.01 and exact.scores[0, 0] == 0   # changed tokens matter, equal ones not


def test_attribution_patching_approximates_the_exact_sweep_on_a_transformer():
    model = build("gpt2")
    x = ids(B=2, T=6)
    metric = logit_difference(5, 7)
    exact = activation_patching(model, x[0], x[1], metric, "blocks.*.resid_pre")
    approx = attribution_patching(model, x[0], x[1], metric, "blocks.*.resid_pre")
    assert (approx.scores - exact.scores).abs().max() < 0.05


def test_patching_errors_name_the_problem():
    model = build("gpt2")
    x = ids(B=2, T=6)
    metric = logit_difference(5, 7)
    with pytest.raises(ValueError, match="same number of tokens"):
        activation_patching(model, x[0], x[1, :5], metric)
    with pytest.raises(ValueError, match="nothing for a patch to restore"):
        activation_patching(model, x[0], x[0], metric)
    with pytest.raises(ValueError, match="per head needs"):
        activation_patching(model, x[0], x[1], metric, "blocks.0.resid_pre", per="head")
    with pytest.raises(ValueError, match="per must be"):
        activation_patching(model, x[0], x[1], metric, per="layer")
