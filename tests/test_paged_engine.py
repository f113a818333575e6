"""The paged engine (serve/paged_engine.py): requests join, leave and grow without anyone being
prefilled again; a shared prefix is computed once; long prompts arrive in chunks between decode
steps; every request's tokens equal generating it alone."""

from __future__ import annotations

import pytest
import torch

from logitlab.generate import SampleConfig, generate
from logitlab.model import ModelConfig, Transformer
from logitlab.serve.engine import DoneEvent, TokenEvent
from logitlab.serve.paged_engine import PagedEngine

GREEDY = SampleConfig(max_new_tokens=8, temperature=0)


class Collect:
    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    @property
    def tokens(self):
        return [e.token for e in self.events if isinstance(e, TokenEvent)]

    @property
    def done(self):
        return self.events[-1] if self.events and isinstance(self.events[-1], DoneEvent) else None


def _model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=60, context_length=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    return Transformer(ModelConfig(**{**cfg, **kw})).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _alone(model, prompt, config):
    return generate(model, prompt, config).tokens[0]


def _drain(engine):
    while engine.step():
        pass


def test_requests_join_leave_and_grow_each_equal_to_generating_it_alone(model):
    e = PagedEngine(model, block_size=4, chunk_tokens=64)
    a, b, c = Collect(), Collect(), Collect()
    sampled = SampleConfig(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=7)
    e.submit([1, 2, 3], SampleConfig(max_new_tokens=20, temperature=0), a)
    for _ in range(3):
        e.step()
    e.submit(list(range(5, 16)), SampleConfig(max_new_tokens=3, temperature=0), b)   # leaves early
    e.submit([40, 41], sampled, c)
    e.step()
    assert len(a.tokens) == 4 and len(b.tokens) == 1 and len(c.tokens) == 1
    _drain(e)
    assert a.tokens == _alone(model, [1, 2, 3], SampleConfig(max_new_tokens=20, temperature=0))
    assert b.tokens == _alone(model, list(range(5, 16)), SampleConfig(max_new_tokens=3, temperature=0))
    assert c.tokens == _alone(model, [40, 41], sampled)
    assert (a.done, b.done, c.done) == (DoneEvent("length"),) * 3
    s = e.stats
    assert s["tokens_recomputed"] == 0 and s["rebuilds"] == 0 and s["shared_steps"] >= 6
    assert s["prefill_tokens"] == 3 + 11 + 2 and s["blocks_in_use"] == 0 and e.running == 0


def test_a_shared_system_prompt_is_prefilled_once(model):
    e = PagedEngine(model, block_size=4)
    system = list(range(1, 21))                                      # five full blocks
    prompts = [system + [30 + i, 31 + i] for i in range(4)]
    outs = [Collect() for _ in prompts]
    for p, out in zip(prompts, outs):                                # all arrive at once
        e.submit(p, GREEDY, out)
    _drain(e)
    for p, out in zip(prompts, outs):
        assert out.tokens == _alone(model, p, GREEDY)
    s = e.stats
    assert s["prefill_tokens"] == 22 + 3 * 2                         # the system prompt once
    assert s["prefix_hits"] == 15 and s["prefix_hit_tokens"] == 60 and s["tokens_recomputed"] == 0
    assert s["blocks_in_use"] == 0 and s["blocks_cached"] >= 5       # kept for the next request
    again = Collect()
    e.submit(system, GREEDY, again)                                  # wholly cached: last id fed again
    _drain(e)
    assert again.tokens == _alone(model, system, GREEDY)
    assert e.stats["tokens_recomputed"] == 1 and e.stats["cow_copies"] == 1


def test_a_long_prompt_arrives_in_chunks_while_a_stream_keeps_producing(model):
    e = PagedEngine(model, block_size=4, chunk_tokens=8)
    runner, late = Collect(), Collect()
    long_cfg = SampleConfig(max_new_tokens=30, temperature=0)
    e.submit([7, 8, 9], long_cfg, runner)
    e.step()
    long_prompt = [(i * 7) % 50 + 1 for i in range(40)]
    e.submit(long_prompt, GREEDY, late)
    for step in range(5):                                            # 40 prompt ids, 8 a step
        before = len(runner.tokens)
        e.step()
        assert len(runner.tokens) == before + 1 and len(late.tokens) == (step == 4)
    assert e.stats["prefill_chunks"] == 1 + 5
    _drain(e)
    assert runner.tokens == _alone(model, [7, 8, 9], long_cfg)
    assert late.tokens == _alone(model, long_prompt, GREEDY)


KINDS = dict(
    hybrid=dict(layer_types=("sliding_attention", "linear_attention", "full_attention"), sliding_window=5,
                attn_sinks=True, n_layers=3),                    # state slots, chunks of equal length
    window=dict(layer_types=("sliding_attention", "full_attention"), sliding_window=5, positions="alibi"),
    moe=dict(n_experts=4, n_experts_per_token=2, mlp="swiglu", norm="rmsnorm", positions="rope"),
)


@pytest.mark.parametrize("kind", list(KINDS))
def test_hybrid_and_moe_models_match_generating_alone(kind):
    model = _model(**KINDS[kind])
    e = PagedEngine(model, block_size=4, chunk_tokens=6)
    prompts = [list(range(1, 14)), [5, 6], list(range(20, 29))]
    outs = [Collect() for _ in prompts]
    for p, out in zip(prompts, outs):
        e.submit(p, GREEDY, out)
    _drain(e)
    for p, out in zip(prompts, outs):
        assert out.tokens == _alone(model, p, GREEDY)
    assert e.stats["tokens_recomputed"] == 0


def test_the_pool_budget_queues_requests_and_bad_settings_are_named(model):
    small = _model(context_length=28)
    e = PagedEngine(small, block_size=4, cache_blocks=8)               # 7 blocks hold the context, + 1
    outs = [Collect() for _ in range(3)]
    for i, out in enumerate(outs):
        e.submit([i + 1] * 10, SampleConfig(max_new_tokens=10, temperature=0), out)   # 5 + 1 blocks each
    e.step()
    assert e.running == 1 and e.waiting == 2
    _drain(e)
    for i, out in enumerate(outs):
        assert out.tokens == _alone(small, [i + 1] * 10, SampleConfig(max_new_tokens=10, temperature=0))
    assert e.stats["evictions"] > 0 and e.stats["blocks_total"] == 8       # older cached blocks made room
    with pytest.raises(ValueError, match=r"cache_blocks \(7\) must hold one request of the whole context: at least 8"):
        PagedEngine(small, block_size=4, cache_blocks=7)
    with pytest.raises(ValueError, match="block_size"):
        PagedEngine(model, block_size=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        PagedEngine(model, chunk_tokens=True)


def test_cancelled_requests_free_their_blocks_and_errors_fail_every_row(model):
    e = PagedEngine(model, block_size=4)
    a, b = Collect(), Collect()
    ra = e.submit([1, 2, 3, 4, 5], SampleConfig(max_new_tokens=30, temperature=0), a)
    e.submit([6, 7], SampleConfig(max_new_tokens=30, temperature=0), b)
    e.step()
    e.cancel(ra)
    e.step()
    assert a.done == DoneEvent("cancelled") and e.running == 1 and e.stats["cancelled"] == 1
    e._fail_all("boom")
    assert b.done == DoneEvent("error", "boom") and e.running == 0 and e.cache.blocks.in_use == 0


def test_cli_serve_chooses_the_engine_and_names_bad_flags(tmp_path, capsys):
    pytest.importorskip("starlette")
    from logitlab.cli.main import build_parser, main
    from logitlab.cli.serve import build_app
    from logitlab.io import checkpoint
    from logitlab.serve.engine import Engine
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])
    d = tmp_path / "m"
    checkpoint.save_model(_model(vocab_size=tok.vocab_size), d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    args = ["serve", str(d), "--port", "0"]
    paged_args = build_parser().parse_args(args + ["--block-size", "8", "--cache-blocks", "50"])
    paged = build_app(paged_args).state.served.engine
    assert isinstance(paged, PagedEngine) and paged.stats["blocks_total"] == 50 and paged.stats["block_size"] == 8
    assert paged.cache.prefix_caching
    plain = build_app(build_parser().parse_args(args + ["--no-prefix-cache"])).state.served.engine
    assert not plain.cache.prefix_caching
    old = build_app(build_parser().parse_args(args + ["--engine", "contiguous"])).state.served.engine
    assert type(old) is Engine
    assert main(args + ["--chunk-tokens", "0"]) == 2 and "--chunk-tokens must be >= 1" in capsys.readouterr().err
    assert main(args + ["--engine", "paged", "--draft", "ngram"]) == 2
    assert "--draft needs --engine contiguous" in capsys.readouterr().err


@pytest.mark.parametrize("threads", [1, 2])
def test_the_batched_choice_gives_each_request_what_choosing_it_alone_gives(model, threads):
    configs = [GREEDY, GREEDY, SampleConfig(max_new_tokens=1, temperature=0), GREEDY,
               SampleConfig(max_new_tokens=8, temperature=0, logit_bias=((3, 2.0),)),
               SampleConfig(max_new_tokens=8, temperature=0.9, seed=3), GREEDY]
    logits = torch.randn(len(configs), 60, generator=torch.Generator().manual_seed(0))     # (B, V)
    logits[1, [4, 9]] = 50.0                                       # a tie: the first of them, as pick takes
    logits[3, 7] = float("nan")                                    # no distribution: an error event
    logits[6, 5] = 40.0                                            # the end-of-text id: finish "stop"
    runs, alone = [], []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batched in (True, False):
            e = PagedEngine(model, eot_id=5)
            outs = [Collect() for _ in configs]
            reqs = [e.submit([1, 2], c, out, top_logprobs=2 * (b == 0))
                    for b, (c, out) in enumerate(zip(configs, outs))]
            one = e._choose_one
            e._choose_one = lambda r, row: alone.append(reqs.index(r)) or one(r, row)
            if batched:
                produced = e._choose_rows(reqs, logits)
            else:
                produced = sum(e._choose_one(r, logits[b:b + 1]) for b, r in enumerate(reqs))
            runs.append((produced, [out.events for out in outs], [r.generated for r in reqs]))
    finally:
        torch.set_num_threads(before)
    assert runs[0] == runs[1]                                      # tokens, log-probabilities, bit for bit
    assert alone[:4] == [0, 3, 4, 5]     # batched: alternatives, the NaN row, the bias, sampling alone
    produced, events, generated = runs[0]
    assert produced == 6 and generated[1] == [4] and generated[6] == [5] and len(events[0][0].top) == 2
    assert events[3][0].finish_reason == "error" and events[2][-1] == DoneEvent("length")
    assert events[6][-1] == DoneEvent("stop")
