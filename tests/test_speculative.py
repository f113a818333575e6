"""Speculative decoding: greedy output identical to the target alone (full attention, sliding
windows, Gated DeltaNet states; n-gram and model drafts), the rejection scheme's output
distribution equal to the target's (chi-square tests on a tiny vocabulary, seeded), going back in
the cache, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch

from logitlab.generate import SampleConfig, generate
from logitlab.generate.speculative import NgramDraft, speculative_generate, verify
from logitlab.model import KVCache, ModelConfig, Transformer

BASE = dict(vocab_size=61, context_length=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
            norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
KINDS = {
    "full": {},
    "sliding": {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 6},
    "hybrid": {"layer_types": ("linear_attention", "full_attention"), "head_dim": 8, "linear_n_k_heads": 2,
               "linear_n_v_heads": 4, "linear_k_head_dim": 8, "linear_v_head_dim": 6},
}
# chi-square critical value at significance 0.001 for 7 degrees of freedom (8 categories): a
# fixed threshold with seeded draws, so the test never flakes; the controls below show its power
CHI2_7_999 = 24.322


def _model(kind: str = "full", seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**BASE, **KINDS[kind], **changes})).eval()
    with torch.no_grad():                                    # sharper logits: fewer near-ties
        model.lm_head.weight.mul_(8)
    return model


PROMPT = [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 14, 15, 9, 2, 6]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_output_is_the_targets_own(kind):
    target = _model(kind)
    config = SampleConfig(temperature=0, max_new_tokens=20)
    want = generate(target, PROMPT, config).tokens[0]
    for draft in ("ngram", _model(kind, seed=1), _model("hybrid", seed=2), target):
        got = speculative_generate(target, PROMPT, config, draft=draft, k=3)
        assert got.tokens[0] == want, (kind, type(draft).__name__)
        assert got.stop_reasons == ["max_new_tokens"] and got.decode_tokens == 19
        assert got.drafted >= got.accepted and got.target_passes <= 19
    itself = speculative_generate(target, PROMPT, config, draft=target, k=3)
    assert itself.acceptance_rate == 1.0 and itself.tokens_per_pass > 3.5      # 4 a pass, but the last


def test_stops_come_where_the_plain_loop_stops():
    target = _model()
    plain = generate(target, PROMPT, SampleConfig(temperature=0, max_new_tokens=30)).tokens[0]
    eot, stop = plain[7], tuple(plain[11:13])
    config = SampleConfig(temperature=0, max_new_tokens=30, stop_sequences=(stop,))
    for eot_id in (eot, None):
        want = generate(target, PROMPT, config, eot_id=eot_id)
        got = speculative_generate(target, PROMPT, config, draft="ngram", k=4, eot_id=eot_id)
        assert got.tokens == want.tokens and got.stop_reasons == want.stop_reasons
    short = ModelConfig(**{**BASE, "context_length": len(PROMPT) + 5})
    model = Transformer(short).eval()
    got = speculative_generate(model, PROMPT, SampleConfig(temperature=0, max_new_tokens=30), draft=model, k=4)
    assert len(got.tokens[0]) == 5 and got.stop_reasons == ["context_length"]


def test_ngram_drafts_follow_the_latest_longest_match():
    draft = NgramDraft(max_n=3)
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 0, 2, 3]
    assert draft.propose(seq, 2, None, None) == ([7, 8], None)              # "2 3" last followed by 7 8
    assert draft.propose([5, 6, 7], 3, None, None) == ([], None)             # nothing repeats
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDraft(max_n=1, min_n=2)


def test_settings_it_refuses():
    target = _model()
    with pytest.raises(ValueError, match="does not take repetition_penalty"):
        speculative_generate(target, PROMPT, SampleConfig(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="draft_k must be an integer >= 1"):
        speculative_generate(target, PROMPT, SampleConfig(), k=0)
    other = Transformer(ModelConfig(**{**BASE, "vocab_size": 50}))
    with pytest.raises(ValueError, match="must share the tokenizer"):
        speculative_generate(target, PROMPT, SampleConfig(), draft=other)


@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_a_cache_goes_back_to_an_earlier_length(kind):
    model = _model(kind)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        whole = model(ids, cache=KVCache.for_model(model, 1))[0, -1]
        cache = KVCache.for_model(model, 1)
        model(ids[:, :10], cache=cache)
        mark = None if cache.can_rewind else cache.snapshot()
        model(torch.tensor([[1, 2, 3, 4]]), cache=cache)                      # a rejected draft
        if mark is None:
            cache.rewind(10)
        else:
            with pytest.raises(ValueError, match="full-attention layers only"):
                cache.rewind(10)
            cache.restore(mark)
        again = model(ids[:, 10:], cache=cache)[0, -1]
    assert cache.length == len(PROMPT)
    torch.testing.assert_close(again, whole, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# The distribution: chi-square tests
# --------------------------------------------------------------------------------------------

def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_rejection_scheme_emits_the_targets_distribution():
    """verify() alone, 6,000 rounds: the first emitted token is distributed as the target's p_0,
    whatever the drafter's q (a model draft, and a one-hot n-gram draft); emitting the drafts
    unchecked instead would give q, which the same test rejects."""
    g = torch.Generator().manual_seed(0)
    V, N, config = 8, 6_000, SampleConfig(temperature=1.0)
    p_logits = torch.randn(3, V, generator=g)
    q = torch.softmax(torch.randn(2, V, generator=g) * 2, dim=-1)           # a poor drafter
    p0 = torch.softmax(p_logits[0], -1)
    first, drafted, fixed = torch.zeros(V), torch.zeros(V), torch.zeros(V)
    for _ in range(N):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        a, following = verify(p_logits, drafts, q, config, None, g)
        first[(drafts[:a] + [following])[0]] += 1
        drafted[drafts[0]] += 1
        a, following = verify(p_logits, [5, 1], None, config, None, g)      # n-gram: q one-hot
        fixed[([5, 1][:a] + [following])[0]] += 1
    assert _chi2(first, p0) < CHI2_7_999
    assert _chi2(fixed, p0) < CHI2_7_999
    assert _chi2(drafted, p0) > 10 * CHI2_7_999                             # the control: q is not p


def _marginals(model, prompt: list[int], V: int) -> torch.Tensor:
    """(2, V): the exact distributions of new tokens 2 and 3 at temperature 1, from the model's
    logits over every prefix."""
    with torch.no_grad():
        pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))     # (V*V, 2): t1, t2
        p1 = torch.softmax(model(torch.tensor([prompt]))[0, -1], -1)                        # (V,)
        p2 = torch.softmax(model(torch.tensor([prompt + [x] for x in range(V)]))[:, -1], -1)  # (V, V)
        rows = torch.cat((torch.tensor([prompt]).expand(V * V, len(prompt)), pairs), 1)
        p3 = torch.softmax(model(rows)[:, -1], -1).view(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3                           # (t1, t2, t3)
    return torch.stack((joint.sum((0, 2)), joint.sum((0, 1))))


@pytest.mark.slow
def test_speculative_sampling_has_the_targets_distribution_end_to_end():
    """Whole generations of 3 tokens (k = 2: tokens 2 and 3 come from verified drafts), 3,000
    seeded draws: tokens 2 and 3 are each distributed as the target's exact marginals; the draft
    model's own marginals, the distribution it proposes from, fail the same test."""
    V, prompt = 8, [1, 2, 3]
    target, draft = _model(seed=0, vocab_size=V), _model(seed=1, vocab_size=V)
    config = SampleConfig(temperature=1.0, max_new_tokens=3)
    counts = torch.zeros(2, V)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                                # 3,000 tiny generations: no thread hand-offs
    try:
        for _ in range(3000):
            t = speculative_generate(target, prompt, config, draft=draft, k=2, generator=g).tokens[0]
            counts[0, t[1]] += 1
            counts[1, t[2]] += 1
    finally:
        torch.set_num_threads(threads)
    want, proposed = _marginals(target, prompt, V), _marginals(draft, prompt, V)
    for i in range(2):
        assert _chi2(counts[i], want[i]) < CHI2_7_999
        assert _chi2(counts[i], proposed[i]) > CHI2_7_999


# --------------------------------------------------------------------------------------------
# The server's engine: a request alone is decoded speculatively
# --------------------------------------------------------------------------------------------

def _drive(engine, requests: list) -> None:
    for _ in range(500):
        if all(r.finished for r in requests):
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_a_request_alone_in_the_engine_is_decoded_speculatively():
    from logitlab.serve.engine import Engine, TokenEvent

    target = _model()
    config = SampleConfig(temperature=0, max_new_tokens=16)
    want = generate(target, PROMPT, config).tokens[0]
    other = PROMPT[::-1]
    want_other = generate(target, other, config).tokens[0]
    engine = Engine(target, speculative=("ngram", 3))
    events: list = []
    first = engine.submit(PROMPT, config, events.append, top_logprobs=2)
    _drive(engine, [first])
    assert first.generated == want and engine.stats["speculative_rounds"] >= 1
    assert engine.stats["rebuilds"] == 0 and engine.stats["decodes"] == 0
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    with torch.no_grad():                                   # each event's log-probability is the target's
        lp = torch.log_softmax(target(torch.tensor([PROMPT + want[:-1]]))[0, len(PROMPT) - 1:].float(), -1)
    torch.testing.assert_close(torch.tensor([e.logprob for e in tokens]), lp[torch.arange(16), want],
                               atol=1e-4, rtol=1e-4)
    # a second request arriving mid-way: the first goes back to the batch, both come out right
    again, late = [], []
    a = engine.submit(PROMPT, config, again.append)
    engine.step()
    engine.step()
    b = engine.submit(other, config, late.append)
    _drive(engine, [a, b])
    assert a.generated == want and b.generated == want_other and engine.stats["rebuilds"] >= 1
