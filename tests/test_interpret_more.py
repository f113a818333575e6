"""Steering (inspect/steering.py), the tuned lens and early exit (inspect/lenses.py) and linear probes
(inspect/probes.py), each against a recomputation by hand on tiny random models."""

from __future__ import annotations

import pytest
import torch

from logitlab.inspect.lenses import TunedLens, early_exit, lens_bits, load_tuned_lens, save_tuned_lens, train_tuned_lens
from logitlab.inspect.probes import linear_probe
from logitlab.inspect.steering import Steering, load_steering, save_steering, steer, steering_direction
from logitlab.model.cache import KVCache
from logitlab.model.hooks import run_with_cache
from tests.test_hooks import build, ids


def test_the_direction_is_the_difference_of_mean_residual_streams():
    model = build("llama-gqa")
    pos, neg = ids(B=2, T=5, seed=1).tolist(), ids(B=3, T=4, seed=2).tolist()
    v = steering_direction(model, pos, neg, layer=0)
    with torch.no_grad():                                          # hidden[1]: block 0's output
        mean = lambda ps: torch.stack([model.forward_with_hidden(torch.tensor([p]))[1][1][0].mean(0)  # noqa: E731
                                       for p in ps]).mean(0)
        torch.testing.assert_close(v, mean(pos) - mean(neg), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama-gqa", "hybrid"])
def test_steering_adds_the_direction_at_every_position_and_follows_a_cache(arch):
    model = build(arch)
    x = ids(B=1, T=6)
    v = torch.randn(32, generator=torch.Generator().manual_seed(3))
    s = Steering(v, layer=0, scale=2.5)
    _, plain = run_with_cache(model, x, ["blocks.0.resid_post"])
    with steer(model, s):
        logits, steered = run_with_cache(model, x, ["blocks.0.resid_post"])
        cache = KVCache.for_model(model, batch_size=1, max_len=8)
        with torch.no_grad():
            step = torch.cat([model(x[:, :4], cache=cache), model(x[:, 4:5], cache=cache),
                              model(x[:, 5:], cache=cache)], dim=1)
    torch.testing.assert_close(steered["blocks.0.resid_post"], plain["blocks.0.resid_post"] + 2.5 * v)
    torch.testing.assert_close(step, logits, rtol=1e-4, atol=1e-5)   # the decode steps are steered too
    with torch.no_grad():
        assert not torch.allclose(model(x), logits)                 # removed after the block
    assert all(m.__dict__.get("_taps") is None for m in model.modules())


def test_a_steering_file_round_trips_and_bad_ones_are_refused(tmp_path):
    model = build("gpt2")
    v = torch.arange(32, dtype=torch.float32)
    path = save_steering(tmp_path / "d.safetensors", v, 1)
    s = load_steering(path, scale=0.5)
    assert torch.equal(s.direction, v) and s.layer == 1 and s.scale == 0.5
    assert load_steering(path, layer=0).layer == 0
    with pytest.raises(ValueError, match="exists"):
        save_steering(path, v, 1)
    with pytest.raises(ValueError, match="d_model is 32"):
        with steer(model, Steering(torch.zeros(8), 0)):
            pass
    with pytest.raises(ValueError, match=r"outside the model's blocks 0..1"):
        with steer(model, Steering(v, 5)):
            pass
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_steering(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="NaN"):
        Steering(torch.full((32,), float("nan")), 0)


def test_a_fresh_tuned_lens_is_the_logit_lens_and_training_lowers_its_bits(tmp_path):
    model = build("llama-gqa")
    with torch.no_grad():                                          # larger weights: a sharp final distribution
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    windows = ids(B=16, T=12, seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = lens_bits(model, windows, TunedLens(32, 2))
    assert fresh.tuned_lens == pytest.approx(fresh.logit_lens, abs=1e-6)
    with torch.no_grad():                                          # layer 0 by hand: KL(final || lens) in bits
        final = model(windows).float().log_softmax(-1)
        lens0 = model.unembed(model.tok_emb(windows)).float().log_softmax(-1)
        by_hand = float((final.exp() * (final - lens0)).sum(-1).mean() / torch.log(torch.tensor(2.0)))
    assert fresh.logit_lens[0] == pytest.approx(by_hand, rel=1e-5)
    lens = train_tuned_lens(model, windows, steps=30, lr=1e-2)
    bits = lens_bits(model, windows, lens)
    assert sum(bits.tuned_lens) < 0.7 * sum(bits.logit_lens)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # the model untouched
    assert all(p.grad is None for p in model.parameters())
    again = load_tuned_lens(save_tuned_lens(lens, tmp_path / "lens.safetensors"), model)
    assert lens_bits(model, windows, again).tuned_lens == bits.tuned_lens
    with pytest.raises(ValueError, match="not a tuned lens for this model"):
        load_tuned_lens(tmp_path / "lens.safetensors", build("gpt2", n_layers=3))


def test_early_exit_is_the_first_layer_that_agrees_with_the_model():
    model = build("gpt2", n_layers=3)
    x = ids(B=1, T=10)[0]
    out = early_exit(model, x)
    with torch.no_grad():
        logits, hidden = model.forward_with_hidden(x[None])
        tops = [model.unembed(h)[0].argmax(-1) for h in hidden[:-1]] + [logits[0].argmax(-1)]
    for t, layer in enumerate(out.exit_layer):
        agree = [i for i in range(4) if tops[i][t] == tops[-1][t]]
        assert layer == agree[0]
    assert sum(out.share) == pytest.approx(1.0) and out.cumulative[-1] == pytest.approx(1.0)


def test_a_probe_reads_what_is_there_and_its_control_does_not():
    model = build("gpt2")
    prompts = (ids(B=12, T=10, seed=5) % 16).tolist()              # 16 tokens, each seen many times
    labels = [[int(t < 8) for t in p] for p in prompts]             # a property of the token itself
    r = linear_probe(model, prompts, labels, "embed")
    assert r.accuracy > 0.95 and r.control < 0.8 and r.n_test == 30 and r.n_train == 90
    assert 0.3 < r.majority < 0.7
    with pytest.raises(ValueError, match="shape \\(B, T, ...\\)"):
        linear_probe(model, prompts, labels, "blocks.0.attn.pattern")
    with pytest.raises(ValueError, match="has 3 labels"):
        linear_probe(model, prompts[:1], [[1, 0, 1]], "embed")
