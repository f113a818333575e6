"""Tests for sampling.py's guards: SampleConfig refuses values that are not finite (or not in
range), a -inf logit bias bans a token, tiny temperatures, and the pure functions refuse rows
that are not a distribution instead of returning id 0 (the argmax of NaN)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from logitlab.generate.sampling import (
    GREEDY_BELOW,
    SampleConfig,
    SamplingError,
    bias_vector,
    make_generator,
    next_token,
    process_logits,
    sample,
)

NAN, INF = float("nan"), float("inf")
LOGITS = torch.tensor([[2.0, 1.0, 0.1, -1.0]])


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", NAN), ("frequency_penalty", INF), ("presence_penalty", INF),
    ("presence_penalty", -INF), ("presence_penalty", NAN), ("temperature", INF),
    ("temperature", 1e39),  # finite in Python, inf in float32
    ("repetition_penalty", INF), ("frequency_penalty", 1e39), ("seed", 2**64), ("max_new_tokens", True),
])
def test_sample_config_refuses_non_finite_values(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {re.escape(repr(value))}$"):
        SampleConfig(**{field: value})


@pytest.mark.parametrize("bias", [NAN, INF])
def test_logit_bias_must_be_finite_or_minus_inf(bias):
    with pytest.raises(ValueError, match=rf"logit_bias for token 5 .* -inf to ban .*got {bias}"):
        SampleConfig(logit_bias={5: bias})


def test_minus_inf_logit_bias_bans_the_token_and_two_huge_biases_are_refused():
    cfg = SampleConfig(temperature=0, logit_bias={0: -INF})
    bias = bias_vector(cfg, 4)
    assert bias[0] == -INF and next_token(LOGITS, cfg, bias=bias).tolist() == [1]
    sampled = SampleConfig(logit_bias={0: -INF}, seed=0)
    p = process_logits(LOGITS, sampled, bias=bias_vector(sampled, 4))
    assert p[0, 0] == 0 and abs(p.sum().item() - 1) < 1e-6
    with pytest.raises(ValueError, match="every token"):
        bias_vector(SampleConfig(logit_bias={0: -INF, 1: -INF}, banned_ids=(2, 3)), 4)
    # each finite, their sum +inf in float32
    with pytest.raises(ValueError, match=r"logit_bias values for token 1 add up to \+inf"):
        bias_vector(SampleConfig(logit_bias=((1, 3e38), (1, 3e38))), 4)


def test_a_temperature_below_float32s_smallest_normal_number_is_greedy():
    assert SampleConfig(temperature=1e-40).greedy and SampleConfig(temperature=0).greedy
    assert not SampleConfig(temperature=GREEDY_BELOW).greedy
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    assert next_token(logits, SampleConfig(temperature=1e-40), make_generator(0)).tolist() == [1, 0]


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-30, 1e-7])
def test_a_top_p_that_float32_rounds_to_zero_keeps_the_top_token(top_p):
    """top_p = 1e-300 is 0 in float32: 'the mass before the top token (0) reaches p' dropped every
    token. The limit of nucleus sampling as p -> 0 is the top token."""
    cfg = SampleConfig(top_p=top_p, seed=0)
    probs = process_logits(LOGITS, cfg)
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert next_token(LOGITS, cfg, make_generator(0)).tolist() == [0]


def test_a_small_temperature_does_not_overflow():
    """logits / T overflows for 50 / 1e-37; shifted by the row's max first it cannot."""
    logits = torch.tensor([[50.0, 40.0, -30.0], [-1.0, 7.0, 7.0]])
    for T in (1e-37, GREEDY_BELOW):
        p = process_logits(logits, SampleConfig(temperature=T))
        assert torch.isfinite(p).all()
        assert p[0].tolist() == [1.0, 0.0, 0.0] and p[1].tolist() == [0.0, 0.5, 0.5]
        ids = next_token(logits.expand(4, 2, 3).reshape(8, 3), SampleConfig(temperature=T), make_generator(1))
        assert ids[0::2].tolist() == [0] * 4 and set(ids[1::2].tolist()) <= {1, 2}


@pytest.mark.parametrize("cfg", [SampleConfig(temperature=0), SampleConfig(temperature=0.7, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_nan_logits_never_give_a_token(cfg):
    bad = torch.tensor([[0.5, 1.0, 2.0], [NAN, 1.0, 2.0]])
    with pytest.raises(SamplingError, match=r"batch row 1: the model's logits contain 1 NaN values of 3") as err:
        next_token(bad, cfg, make_generator(0))
    assert err.value.row == 1 and err.value.step is None
    with pytest.raises(SamplingError, match="batch row 0: the model's logits contain 3 NaN"):
        process_logits(torch.full((1, 3), NAN), cfg)
    with pytest.raises(SamplingError, match=r"step 4 .*contain 1 \+inf values"):
        next_token(torch.tensor([[INF, 1.0, 2.0]]), cfg, step=4)
    with pytest.raises(SamplingError, match="are all -inf"):
        process_logits(torch.full((1, 3), -INF), cfg)
    # -inf on some tokens: they can never be chosen, the others can
    assert next_token(torch.tensor([[-INF, 1.0, 2.0]]), cfg, make_generator(0)).item() in (1, 2)


def test_sample_refuses_probabilities_that_are_not_a_distribution():
    for probs in ([[NAN, 0.5, 0.5]], [[0.0, 0.0, 0.0]], [[0.0, INF, 0.0]], [[-1.0, 0.5, 0.5]]):
        with pytest.raises(SamplingError, match="batch row 1: the probabilities are not a distribution"):
            sample(torch.tensor([[0.2, 0.3, 0.5]] + probs), make_generator(0))


def test_every_token_excluded_or_pushed_to_plus_inf_by_the_penalties():
    counts = torch.full((1, 4), 2.0)  # every token generated twice
    push_down = SampleConfig(temperature=0.5, frequency_penalty=3e38)  # 2 x 3e38 = inf in float32
    with pytest.raises(SamplingError, match="every token is excluded"):
        next_token(LOGITS, push_down, make_generator(0), counts=counts)
    push_up = SampleConfig(temperature=0, frequency_penalty=-3e38)
    with pytest.raises(SamplingError, match=r"penalties turned a logit into NaN or \+inf"):
        next_token(LOGITS, push_up, counts=counts)
    tiny = SampleConfig(repetition_penalty=1e-40)  # 2.0 / 1e-40 = inf
    with pytest.raises(SamplingError, match=r"NaN or \+inf"):
        process_logits(LOGITS, tiny, seen=torch.ones(1, 4, dtype=torch.bool))
    assert math.isfinite(tiny.repetition_penalty)
