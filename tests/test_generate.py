"""Tests for generate.py: the sampling functions against worked numbers, sampling in
distribution (chi-square), and the prefill/decode loop against its references (no cache,
each prompt alone, transformers' greedy generate)."""

from __future__ import annotations

import math

import pytest
import torch

from logitlab.generate import (
    SampleConfig, apply_count_penalties, apply_repetition_penalty, bias_vector, make_generator,
    min_p_filter, next_token, process_logits, sample, softmax, top_k_filter, top_p_filter,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.1, -1.0]])


def close(a, b, tol=1e-3):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32).flatten(),
                          torch.tensor(b, dtype=torch.float32), atol=tol), (a, b)


# ---------------------------------------------------------------------------------- pure functions

def test_softmax_worked_example():
    p = softmax(LOGITS)
    close(p, [0.638, 0.235, 0.095, 0.032])
    assert abs(-math.log(p[0, 0].item()) - 0.449) < 1e-3


def test_softmax_is_stable_for_huge_logits():
    p = softmax(torch.tensor([[1000.0, 999.0, -1000.0]]))
    assert torch.isfinite(p).all()
    close(p, [0.731, 0.269, 0.0])


def test_top_k_worked_example():
    close(process_logits(LOGITS, SampleConfig(top_k=2)), [0.731, 0.269, 0, 0])
    close(softmax(top_k_filter(LOGITS, 2)), [0.731, 0.269, 0, 0])


def test_top_p_worked_example():
    close(process_logits(LOGITS, SampleConfig(top_p=0.9)), [0.659, 0.242, 0.099, 0])
    # 0.873 (two tokens) does not reach 0.9, so the third is needed; 0.8 needs two
    close(top_p_filter(softmax(LOGITS), 0.8), [0.731, 0.269, 0, 0])
    # the top token alone always survives
    close(top_p_filter(softmax(LOGITS), 0.01), [1, 0, 0, 0])


def test_temperature_worked_examples():
    close(process_logits(LOGITS, SampleConfig(temperature=0.5)), [0.862, 0.117, 0.019, 0.002])
    close(process_logits(LOGITS, SampleConfig(temperature=2.0)), [0.451, 0.274, 0.174, 0.101])


def test_temperature_zero_is_greedy():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    cfg = SampleConfig(temperature=0)
    close(process_logits(logits, cfg), [0, 1, 0, 1, 0, 0])
    assert next_token(logits, cfg, make_generator(0)).tolist() == [1, 0]


def test_min_p():
    p = softmax(LOGITS)  # [0.638, 0.235, 0.095, 0.032]
    close(min_p_filter(p, 0.2), [0.731, 0.269, 0, 0])  # threshold 0.128
    close(min_p_filter(p, 0.1), [0.659, 0.242, 0.099, 0])  # threshold 0.064
    close(process_logits(LOGITS, SampleConfig(min_p=0.2)), [0.731, 0.269, 0, 0])


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    close(out, [1.0, -2.0, 3.0, -2.0])


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, 3)
    counts = torch.tensor([[0.0, 1.0, 3.0]])
    close(apply_count_penalties(logits, counts, 0.5, 1.0), [0.0, -1.5, -2.5])


def test_logit_bias_and_banned_ids():
    cfg = SampleConfig(temperature=0, banned_ids=(0,), logit_bias={3: 10.0})
    bias = bias_vector(cfg, 4)
    assert bias[0] == float("-inf") and bias[3] == 10.0
    assert next_token(LOGITS, cfg, bias=bias).tolist() == [3]
    p = process_logits(LOGITS, SampleConfig(banned_ids=(0,)), bias=bias_vector(SampleConfig(banned_ids=(0,)), 4))
    assert p[0, 0] == 0
    close(p, [0.0] + softmax(torch.tensor([[1.0, 0.1, -1.0]]))[0].tolist())
    with pytest.raises(ValueError, match="banned_ids.*outside"):
        bias_vector(SampleConfig(banned_ids=(7,)), 4)
    with pytest.raises(ValueError, match="every token"):
        bias_vector(SampleConfig(banned_ids=(0, 1, 2, 3)), 4)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=1.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_ids=(-3,)), "stop_ids"),
])
def test_sample_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SampleConfig(**kwargs)


def test_sample_config_normalises_and_is_frozen():
    cfg = SampleConfig(logit_bias={5: 1, 2: -1}, stop_bytes=("\n\n",), stop_ids=[3])
    assert cfg.logit_bias == ((2, -1.0), (5, 1.0))
    assert cfg.stop_bytes == (b"\n\n",) and cfg.stop_ids == (3,)
    with pytest.raises(Exception):
        cfg.temperature = 2.0  # type: ignore[misc]


def test_sampling_matches_probabilities_chi_square():
    """20,000 seeded draws: empirical frequencies match the processed probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.1, -1.0, 0.5, -0.3]])
    cfg = SampleConfig(temperature=0.8, top_k=5)
    probs = process_logits(logits, cfg)[0]
    n = 20_000
    g = make_generator(1234)
    draws = sample(probs.expand(n, -1).contiguous(), g)
    observed = torch.bincount(draws, minlength=6).double()
    assert observed[probs == 0].sum() == 0  # filtered tokens never drawn
    keep = probs > 0
    expected = probs.double()[keep] * n
    chi2 = (((observed[keep] - expected) ** 2) / expected).sum().item()
    # 4 degrees of freedom: the 0.999 quantile is 18.47
    assert chi2 < 18.47, (chi2, observed, expected)


def test_sampling_is_reproducible_with_a_seed():
    probs = softmax(torch.randn(8, 50))
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    c = sample(probs, make_generator(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
