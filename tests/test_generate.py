"""Tests for generate.py and sampling.py: the sampling functions (sampling.py, imported through
generate.py's re-exports) against worked numbers, sampling in distribution (chi-square), and the
prefill/decode loop against its references (no cache, each prompt alone, transformers' greedy
generate)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from logitlab.generate.sampling import (
    SampleConfig,
    apply_count_penalties,
    apply_repetition_penalty,
    bias_vector,
    make_generator,
    min_p_filter,
    next_token,
    process_logits,
    sample,
    softmax,
    top_k_filter,
    top_p_filter,
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
    banned = SampleConfig(banned_ids=(0,))
    p = process_logits(LOGITS, banned, bias=bias_vector(banned, 4))
    assert p[0, 0] == 0
    close(p, [0.0] + softmax(torch.tensor([[1.0, 0.1, -1.0]]))[0].tolist())
    with pytest.raises(ValueError, match="banned_ids.*outside"):
        bias_vector(SampleConfig(banned_ids=(7,)), 4)
    with pytest.raises(ValueError, match="every token"):
        bias_vector(SampleConfig(banned_ids=(0, 1, 2, 3)), 4)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=1.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
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


def test_sampling_never_picks_a_zero_probability_token_when_a_draw_is_zero(monkeypatch):
    """exponential_ may return exactly 0; p / 0 must not let a filtered token (p = 0) win."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    assert sample(torch.tensor([[0.0, 0.5, 0.5]])).item() in (1, 2)


def test_sampling_is_reproducible_with_a_seed():
    probs = softmax(torch.randn(8, 50))
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    c = sample(probs, make_generator(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---------------------------------------------------------------------------------- the loop

from logitlab.generate.loop import GenerationResult, generate, generate_reference, stream  # noqa: E402
from logitlab.model.transformer import ModelConfig, Transformer  # noqa: E402


def compiled(model, backend: str = "inductor"):
    """The compiled decode step for `model`, as the CLI builds it for --compile."""
    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import compiled_decode_step

    return compiled_decode_step(model, backend, step=decode_step)


# init_std 0.3 makes the random models' next-token distributions peaked, so greedy choices are
# not decided by float rounding between code paths.
FAMILIES = {
    "gpt2-like": dict(),
    "llama-like": dict(n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False,
                       tie_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, context_length=48, d_model=32, n_layers=2, n_heads=4,
                      init_std=0.3, **FAMILIES[request.param])
    return Transformer(cfg).eval()


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42]]
GREEDY = SampleConfig(temperature=0, max_new_tokens=12)


def test_cached_equals_uncached_greedy(model):
    for p in PROMPTS:
        cached = generate(model, p, GREEDY)
        assert cached.tokens == generate_reference(model, p, GREEDY).tokens
        assert len(cached.tokens[0]) == 12 and cached.stop_reasons == ["max_new_tokens"]


def test_generation_leaves_the_model_trainable_and_grad_mode_alone():
    """The loop runs under torch.inference_mode; nothing of the model is turned into an
    inference tensor, so it trains afterwards, and grad mode is restored, also mid-stream."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, context_length=48, d_model=32, n_layers=2, n_heads=4))
    it = iter(stream(model, PROMPTS[0], SampleConfig(temperature=0.8, seed=1, max_new_tokens=5)))
    next(it)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    list(it)
    generate(model, PROMPTS[1], GREEDY)
    assert not any(p.is_inference() for p in model.parameters())
    model.train()
    model(torch.tensor([PROMPTS[1]])).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cached_equals_uncached_sampling_with_penalties(model):
    cfg = SampleConfig(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, repetition_penalty=1.3,
                       frequency_penalty=0.2, presence_penalty=0.3, seed=11, max_new_tokens=12)
    assert generate(model, PROMPTS[1], cfg).tokens == generate(model, PROMPTS[1], cfg, use_cache=False).tokens


def test_cache_logits_match_full_forward(model):
    """prefill + decode steps give the same last-position logits as the full forward."""
    from logitlab.generate.loop import decode_step, prefill
    from logitlab.model.cache import KVCache

    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        cache = KVCache.for_model(model.config, 1, 16)
        got = [prefill(model, ids[:, :4], cache)]
        for t in range(4, 8):
            got.append(decode_step(model, ids[:, t:t + 1], cache))
        full = model(ids)[0, 3:].float()
    assert torch.allclose(torch.cat(got), full, atol=1e-5)


def test_batch_with_left_padding_equals_each_prompt_alone(model):
    batch = generate(model, PROMPTS, GREEDY)
    alone = [generate(model, p, GREEDY).tokens[0] for p in PROMPTS]
    assert batch.tokens == alone
    assert batch.decode_tokens == 3 * 11


def test_seeded_runs_are_reproducible(model):
    cfg = SampleConfig(temperature=1.0, seed=5, max_new_tokens=16)
    a, b = generate(model, PROMPTS[0], cfg), generate(model, PROMPTS[0], cfg)
    c = generate(model, PROMPTS[0], SampleConfig(temperature=1.0, seed=6, max_new_tokens=16))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stream_yields_the_same_ids_and_fills_the_result(model):
    s = stream(model, PROMPTS[1], GREEDY)
    ids = list(s)
    assert ids == generate(model, PROMPTS[1], GREEDY).tokens[0]
    r = s.result
    assert isinstance(r, GenerationResult) and r.stop_reasons == ["max_new_tokens"]
    assert r.prefill_seconds > 0 and r.decode_seconds > 0 and r.decode_tokens == 11
    assert r.decode_tokens_per_second > 0


@pytest.mark.slow
@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "guarded"])
def test_compiled_decode_step_is_one_graph_with_the_same_tokens(model, monkeypatch, isolate):
    """aot_eager traces exactly what inductor compiles (fullgraph: a graph break would raise),
    without inductor's code generation, so it is fast enough for the default run. "guarded" is
    the path for torch releases without isolate_recompiles (module guards kept)."""
    import torch._dynamo

    import logitlab.kernels.decode as gen

    monkeypatch.setattr(gen, "_ISOLATE", isolate and gen._ISOLATE)
    gen._COMPILED.clear()
    cfg = SampleConfig(temperature=0, max_new_tokens=10)
    torch._dynamo.reset()
    got = generate(model, PROMPTS, cfg, step=compiled(model, "aot_eager")).tokens
    assert got == generate(model, PROMPTS, cfg).tokens


def test_compiled_step_is_kept_per_model_until_its_weights_change(model):
    other = Transformer(model.config).eval()
    compiled_decode_step = compiled
    a = compiled_decode_step(model, "aot_eager")
    assert compiled_decode_step(model, "aot_eager") is a
    assert compiled_decode_step(other, "aot_eager") is not a
    with torch.no_grad():
        other.final_norm.weight.mul_(2.0)             # an in-place write bumps the version
    assert compiled_decode_step(other, "aot_eager") is not compiled_decode_step(model, "aot_eager")
    b = compiled_decode_step(other, "aot_eager")
    with torch.no_grad():
        other.final_norm.weight.mul_(0.5)
    assert compiled_decode_step(other, "aot_eager") is not b


def test_greedy_decode_step_returns_the_argmax_of_its_logits(model):
    """decode_step(greedy=True) picks the next ids itself (inside the graph when compiled);
    they are the argmax of the logits it returns otherwise."""
    from logitlab.generate.loop import decode_step, prefill
    from logitlab.model.cache import KVCache

    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    with torch.inference_mode():
        caches = [KVCache.for_model(model.config, 2, 16) for _ in range(2)]
        for cache in caches:
            prefill(model, ids, cache)
        for t in range(4):
            token = torch.tensor([[t], [t + 7]])
            logits = decode_step(model, token, caches[0])
            picked = decode_step(model, token, caches[1], greedy=True)
            assert picked.shape == (2,) and torch.equal(picked, logits.argmax(dim=-1))


def _count_step_calls(monkeypatch):
    """Counts CompiledStep calls with every guard checked and through `trusted`."""
    import logitlab.kernels.decode as gen

    calls = {"guarded": 0, "trusted": 0}
    guarded, trusted = gen.CompiledStep.__call__, gen.CompiledStep.trusted

    def count(kind, fn):
        def wrapped(self, *args, **kwargs):
            calls[kind] += 1
            return fn(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(gen.CompiledStep, "__call__", count("guarded", guarded))
    monkeypatch.setattr(gen.CompiledStep, "trusted", count("trusted", trusted))
    return calls


@pytest.mark.slow
def test_compiled_greedy_and_trusted_steps_follow_new_batch_sizes_and_dtypes(model, monkeypatch):
    """generate with a compiled step skips dynamo's guards from the third decode step on. Each call
    starts guarded, so a new batch size, padding, a one-token prompt (dynamo specialises a
    cache length of 1) or sampling after greedy never runs a graph compiled for other inputs:
    every run gives the eager tokens. A Stream (user code between steps) keeps the guards."""
    import torch._dynamo

    calls = _count_step_calls(monkeypatch)
    torch._dynamo.reset()
    m = Transformer(model.config).eval()
    m.load_state_dict(model.state_dict())
    sampled = SampleConfig(temperature=0.8, top_k=10, seed=3, max_new_tokens=8)
    runs = [([[42]], GREEDY), (PROMPTS, GREEDY), ([PROMPTS[1]], GREEDY), (PROMPTS, sampled),
            ([[42], [7]], GREEDY), ([[5, 6]], GREEDY)]
    for prompts, cfg in runs:
        assert generate(m, prompts, cfg, step=compiled(m, "aot_eager")).tokens == generate(m, prompts, cfg).tokens
    # 11 (greedy) or 7 (sampled) decode steps per run, of which 2 guarded
    assert calls == {"guarded": 2 * len(runs), "trusted": 5 * 9 + 5}
    streamed = list(stream(m, PROMPTS[1], GREEDY, step=compiled(m, "aot_eager")))
    assert streamed == generate(m, PROMPTS[1], GREEDY).tokens[0]
    assert calls["trusted"] == 5 * 9 + 5
    m64 = m.to(torch.float64)                       # a new dtype: a new compiled step, guarded first
    fast64 = generate(m64, PROMPTS, GREEDY, step=compiled(m64, "aot_eager")).tokens
    assert fast64 == generate(m64, PROMPTS, GREEDY).tokens


def test_frozen_compiled_step_traces_the_weights_as_constants(model):
    """With freezing, CompiledStep turns inductor's global flag on while dynamo traces, so the
    parameters become graph constants (get_attr) instead of graph inputs, which is what lets
    inductor prepack them; without it they are inputs. The flag is restored afterwards."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import CompiledStep
    from logitlab.model.cache import KVCache

    n_params = len(list(model.parameters()))

    def inputs_traced(freezing: bool) -> int:
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        step = CompiledStep(torch.compile(decode_step, backend=capture, dynamic=True, fullgraph=True),
                            freezing=freezing)
        with torch.inference_mode():
            cache = KVCache.for_model(model.config, 1, 16)
            cache.length = 3
            step(model, torch.tensor([[1]]), cache, torch.tensor([[3]]), None, greedy=True)
        assert inductor_config.freezing is False
        return sum(node.op == "placeholder" for node in graphs[0].graph.nodes)

    assert inputs_traced(False) - inputs_traced(True) >= n_params


@pytest.mark.slow
def test_compiled_step_traces_module_floats_as_constants(model):
    """A norm's eps is a constant: traced as a symbolic float (dynamo's default with dynamic shapes
    and the module guards skipped), AOT autograd pins it and restarts the whole trace, a second
    compile attempt. CompiledStep traces with specialize_float, so the backend is called once; the
    global flag is restored afterwards."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import CompiledStep
    from logitlab.model.cache import KVCache

    aot = aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward))

    def attempts(step_class) -> int:
        calls = []

        def backend(gm, example_inputs):                       # AOT autograd, where the restart starts
            calls.append(1)
            return aot(gm, example_inputs)
        torch._dynamo.reset()
        step = step_class(torch.compile(decode_step, backend=backend, dynamic=True, fullgraph=True), freezing=False)
        with torch.inference_mode():
            cache = KVCache.for_model(model.config, 1, 16)
            cache.length = 3
            step(model, torch.tensor([[1]]), cache, torch.tensor([[3]]), None, greedy=True)
        assert dynamo_config.specialize_float is False
        return len(calls)

    class Plain(CompiledStep):                                 # the same step without the flag
        def __call__(self, model, *args, **kwargs):
            return self._fn(model, *args, **kwargs)
    assert attempts(Plain) == 2                                # the restart this avoids
    assert attempts(CompiledStep) == 1


@pytest.mark.slow
def test_decode_autotune_pins_the_template_for_bf16_and_times_on_request(model):
    """autotune None: the C++ GEMM template untimed ("template") for a frozen bf16 step; True /
    "timed": every candidate timed; False: aten's products; the choice filter acts only while a
    pinned step runs, and keeps every choice where no template is offered."""
    from argparse import Namespace

    import torch._inductor.select_algorithm as select_algorithm  # first: the next import is circular alone
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller

    from logitlab.cli.generate import _decode_step
    from logitlab.generate.loop import decode_step
    from logitlab.kernels import decode

    fp32 = Transformer(model.config).eval()
    bf16 = Transformer(model.config).eval().to(torch.bfloat16)
    assert decode.compiled_decode_step(bf16, step=decode_step)._pin is True
    assert decode.compiled_decode_step(bf16, step=decode_step, autotune=True)._pin is False
    assert decode.compiled_decode_step(bf16, step=decode_step, autotune="timed")._pin is False
    assert decode.compiled_decode_step(bf16, step=decode_step, freeze=False)._pin is False  # nothing to pin
    assert decode.compiled_decode_step(fp32, step=decode_step)._pin is False
    assert decode.compiled_decode_step(fp32, step=decode_step, autotune="template")._pin is True
    assert _decode_step(Namespace(compile=True, autotune="template"), fp32)._pin is True
    with pytest.raises(ValueError, match="'fast'"):
        decode.compiled_decode_step(fp32, step=decode_step, autotune="fast")
    # a pinned step and a timed one are different entries of inductor's cache
    digest = decode._compile_options(bf16)["post_grad_custom_post_pass"].uuid()
    assert digest != decode._compile_options(bf16, autotune=True)["post_grad_custom_post_pass"].uuid()
    assert digest == decode._compile_options(bf16, autotune="template")["post_grad_custom_post_pass"].uuid()

    # the filter installs in a fresh process too (no inductor module imported before it)
    fresh = subprocess.run([sys.executable, "-c", "from logitlab.kernels import decode; "
                            "assert decode._install_template_filter() and decode._install_template_filter()"],
                           capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr[-2000:]

    template, aten = object.__new__(CppTemplateCaller), object()
    wrapped = select_algorithm.DataProcessorChoiceCallerWrapper(template, None, None)   # as inductor hands one
    assert decode._template_where_it_applies([aten, template]) == [aten, template]   # not pinning
    with decode.template_pinned():
        assert decode._template_where_it_applies([aten, template]) == [template]
        assert decode._template_where_it_applies([aten, wrapped]) == [wrapped]
        assert decode._template_where_it_applies([aten]) == [aten]
        with decode.template_pinned(False):
            assert decode._template_where_it_applies([aten, template]) == [aten, template]
        assert decode._template_where_it_applies([aten, template]) == [template]
    assert decode._template_where_it_applies([aten, template]) == [aten, template]   # restored


@pytest.mark.slow
def test_pinned_template_step_times_nothing_and_gives_the_same_tokens(model):
    """A step compiled with autotune "template" runs inductor's C++ GEMM template on its frozen
    weights (the template drops the weights it repacked), without timing any candidate, and
    decodes the eager step's tokens."""
    from torch._dynamo.utils import counters

    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import compiled_decode_step

    fresh = Transformer(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    counters.clear()
    cfg = SampleConfig(temperature=0, max_new_tokens=8)
    step = compiled_decode_step(fresh, step=decode_step, autotune="template")
    with torch._inductor.config.patch(force_disable_caches=True):   # compiled here, not read from a cache
        tokens = generate(fresh, PROMPTS, cfg, step=step).tokens
    assert tokens == generate(fresh, PROMPTS, cfg).tokens
    assert counters["inductor"]["select_algorithm_autotune"] == 0
    assert counters["inductor"]["select_algorithm_weight_prune"] > 0


@pytest.mark.slow
def test_compiled_decode_step_gives_the_same_tokens(model):
    cfg = SampleConfig(temperature=0, max_new_tokens=16)
    assert generate(model, PROMPTS, cfg, step=compiled(model)).tokens == generate(model, PROMPTS, cfg).tokens


def test_decode_compile_options_autotune_bf16_and_keep_float32_on_the_packed_gemm(model):
    """CPU decode steps always freeze and prepack; max-autotune only where it was measured to pay
    (bf16 weights) unless asked; a different choice is a different compiled step."""
    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import _compile_options, compiled_decode_step

    fp32 = Transformer(model.config).eval()
    bf16 = Transformer(model.config).eval().to(torch.bfloat16)
    assert _compile_options(fp32)["freezing"] and _compile_options(fp32)["cpp_wrapper"]
    assert "max_autotune" not in _compile_options(fp32)
    assert _compile_options(bf16)["max_autotune"] and _compile_options(fp32, autotune=True)["max_autotune"]
    assert "max_autotune" not in _compile_options(bf16, autotune=False)
    assert compiled_decode_step(fp32, step=decode_step) is compiled_decode_step(fp32, step=decode_step)
    plain = compiled_decode_step(fp32, step=decode_step)
    assert compiled_decode_step(fp32, step=decode_step, autotune=True) is not plain
    from argparse import Namespace

    from logitlab.cli.generate import _decode_step  # --autotune on|off|auto reaches the compiled step
    assert _decode_step(Namespace(compile=True, autotune="on"), fp32) is compiled_decode_step(
        fp32, step=decode_step, autotune=True)
    assert _decode_step(Namespace(compile=True, autotune="auto"), fp32) is compiled_decode_step(fp32, step=decode_step)
    assert _decode_step(Namespace(compile=False, autotune="on"), fp32) is decode_step
    # --freeze off: the weights stay graph inputs (a step inductor's on-disk cache can serve)
    assert _compile_options(fp32, freeze=False)["freezing"] is False and _compile_options(fp32, freeze=None)["freezing"]
    unfrozen = _decode_step(Namespace(compile=True, autotune="auto", freeze="off"), fp32)
    assert unfrozen is compiled_decode_step(fp32, step=decode_step, freeze=False) and unfrozen is not plain
    assert unfrozen._freezing is False and compiled_decode_step(fp32, step=decode_step)._freezing is True



def test_frozen_step_cache_key_carries_the_weights(model):
    """Inductor keys a frozen graph by its weights' shapes only, yet a GEMM template can bake
    repacked copies of the values into it: on a CPU where that happens, another model of the
    same architecture was served the first one's weights (the slow test below, bf16). The frozen options carry a digest
    of the values into the cache key: equal for equal weights, different after any change."""
    import copy

    from logitlab.kernels.decode import _compile_options

    m = Transformer(model.config).eval()
    m.load_state_dict(model.state_dict())
    digest = _compile_options(m)["post_grad_custom_post_pass"]
    assert digest.uuid() == _compile_options(copy.deepcopy(m))["post_grad_custom_post_pass"].uuid()
    with torch.no_grad():
        m.final_norm.weight[0] += 1e-3                   # one value of one small weight
    assert _compile_options(m)["post_grad_custom_post_pass"].uuid() != digest.uuid()
    digest(None)                                         # the pass itself changes nothing
    assert _compile_options(m.to(torch.bfloat16))["post_grad_custom_post_pass"].uuid() != digest.uuid()
    assert "post_grad_custom_post_pass" not in _compile_options(m, freeze=False)

@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_step_with_frozen_weights_follows_weight_changes(model, dtype):
    """On a CPU the decode step compiles with frozen (constant, prepacked) weights: after the
    weights change the compiled step must be rebuilt, not reuse the old constants. (Logits, not
    tokens: bf16 rounding inside fused kernels differs from eager, so near-ties may flip.)"""
    from logitlab.generate.loop import decode_step, prefill
    from logitlab.kernels.decode import _compile_options
    from logitlab.model.cache import KVCache

    m = Transformer(model.config).eval()
    m.load_state_dict(model.state_dict())
    m = m.to(dtype)
    assert _compile_options(m)["freezing"]

    def last_logits(step):
        cache = KVCache.for_model(m, 1, 16)
        with torch.no_grad():
            prefill(m, torch.tensor([PROMPTS[1]]), cache)
            step(m, torch.tensor([[3]]), cache)
            return step(m, torch.tensor([[4]]), cache)

    tol = 1e-4 if dtype == torch.float32 else 0.05
    for _ in range(2):
        eager = last_logits(decode_step)
        fast = last_logits(compiled(m))
        assert torch.allclose(fast, eager, atol=tol * eager.abs().max().item())
        with torch.no_grad():
            m.lm_head.weight.mul_(-1.0)


def test_stop_reasons(model):
    p = PROMPTS[1]
    free = generate(model, p, GREEDY).tokens[0]
    # end-of-text: the 4th greedy token, kept as the last id
    r = generate(model, p, GREEDY, eot_id=free[3])
    first = free.index(free[3])
    assert r.tokens[0] == free[:first + 1] and r.stop_reasons == ["eot"]
    r = generate(model, p, SampleConfig(temperature=0, max_new_tokens=12, stop_ids=(free[5],)))
    assert r.stop_reasons == ["stop_id"] and r.tokens[0][-1] == free[5]
    seq = tuple(free[6:8])
    r = generate(model, p, SampleConfig(temperature=0, max_new_tokens=12, stop_sequences=(seq,)))
    assert r.stop_reasons == ["stop_sequence"] and tuple(r.tokens[0][-2:]) == seq
    # byte strings: each token is two bytes, the stop string straddles tokens 7 and 8
    table = [bytes([65 + i % 26, 97 + i % 26]) for i in range(97)]
    stop = table[free[7]][1:] + table[free[8]][:1]
    r = generate(model, p, SampleConfig(temperature=0, max_new_tokens=12, stop_bytes=(stop,)),
                 token_bytes=table)
    generated = b"".join(table[t] for t in r.tokens[0])
    assert r.stop_reasons == ["stop_sequence"] and stop in generated and stop not in generated[:-2]
    with pytest.raises(ValueError, match="token_bytes"):
        generate(model, p, SampleConfig(stop_bytes=(b"x",)))
    # context: 48 positions, a 40-token prompt leaves room for 8 new tokens
    r = generate(model, list(range(40)), GREEDY)
    assert len(r.tokens[0]) == 8 and r.stop_reasons == ["context_length"]
    with pytest.raises(ValueError, match="no room"):
        generate(model, list(range(48)), GREEDY)
    with pytest.raises(ValueError, match="token id 97"):
        generate(model, [1, 97], GREEDY)


def test_batch_rows_stop_independently(model):
    alone = [generate(model, p, GREEDY).tokens[0] for p in PROMPTS]
    eot = alone[0][2]
    r = generate(model, PROMPTS, GREEDY, eot_id=eot)
    for row, ids in zip(r.tokens, alone):
        expect = ids[:ids.index(eot) + 1] if eot in ids else ids
        assert row == expect
    assert r.stop_reasons[0] == "eot"


# ---------------------------------------------------------------------------------- the peer

def _hf_configs():
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=101, initializer_range=0.3, bos_token_id=None, eos_token_id=None)
    return {
        "gpt2": transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=4, **common),
        "llama": transformers.LlamaConfig(max_position_embeddings=64, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          pad_token_id=None, **common),
        "qwen3": transformers.Qwen3Config(max_position_embeddings=64, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, pad_token_id=None, **common),
    }


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_greedy_equals_transformers_generate(family, tmp_path):
    """A random transformers model saved to disk, loaded into logitlab: greedy generation agrees
    with transformers' generate(do_sample=False) token for token."""
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("logitlab.io.hf", reason="logitlab.hf (Hugging Face import) is not available")
    torch.manual_seed(0)
    peer = transformers.AutoModelForCausalLM.from_config(_hf_configs()[family]).eval()
    peer.save_pretrained(tmp_path)
    ours = hf.load_pretrained(tmp_path)
    prompt = [5, 17, 3, 88, 42]
    expected = peer.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                             do_sample=False, max_new_tokens=24, pad_token_id=0)[0, 5:].tolist()
    got = generate(ours, prompt, SampleConfig(temperature=0, max_new_tokens=24)).tokens[0]
    assert got == expected
    # a left-padded batch, as transformers pads it (attention_mask zeros at the front)
    batch = [[5, 17, 3, 88, 42], [9, 60, 2]]
    ids = torch.tensor([batch[0], [0, 0] + batch[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    expected = peer.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                             pad_token_id=0)[:, 5:].tolist()
    assert generate(ours, batch, SampleConfig(temperature=0, max_new_tokens=12)).tokens == expected


# ---------------------------------------------------------------------------------- the CLI

MERGES = [(b"t", b"h"), (b"th", b"e"), (b" ", b"c"), (b" c", b"a"), (b" ca", b"t"), (b"e", b"l"),
          (b"el", b"l"), (b"ell", b"o"), (b"H", b"ello"), (b" ", b"w"), (b"o", b"r")]


def small_tokenizer():
    """256 bytes + a few merges + <|endoftext|>: fast to build, save and load."""
    from logitlab.tokenizer.core import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in MERGES:
        vocab[len(vocab)] = a + b
    return Tokenizer(vocab, MERGES, special_tokens=["<|endoftext|>"])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random GPT-2 in a Hugging Face directory with a tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("logitlab.io.hf", reason="logitlab.hf (Hugging Face import) is not available")
    tok = small_tokenizer()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                                  initializer_range=0.3, eos_token_id=tok.eot_id, bos_token_id=tok.eot_id)
    d = tmp_path_factory.mktemp("hf")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tok.save_hf(d / "tokenizer.json")
    return d


def _cli_json(capsys, argv):
    import json

    from logitlab.cli.main import main

    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_generate_streams_and_stops(hf_dir, capsys):
    from logitlab.cli.main import main
    from logitlab.io.hf import load_pretrained
    from logitlab.tokenizer.core import Tokenizer

    out = _cli_json(capsys, ["generate", str(hf_dir), "Hello, world", "--temperature", "0",
                             "--max-new-tokens", "12", "--json"])
    model = load_pretrained(hf_dir)
    tok = Tokenizer.from_hf(hf_dir / "tokenizer.json")
    ids = tok.encode("Hello, world")
    assert out["prompt_ids"] == ids
    expect = generate(model, ids, SampleConfig(temperature=0, max_new_tokens=12), eot_id=tok.eot_id).tokens[0]
    assert out["ids"] == expect and out["text"] == tok.decode(expect)
    assert out["stop_reason"] in ("max_new_tokens", "eot") and out["decode_tokens_per_second"] > 0
    # ASCII only (bytes 128-255 banned), then a stop string from the middle: the text ends before it
    ascii_only = ["--banned-ids", ",".join(str(i) for i in range(128, 256))]
    base = ["generate", str(hf_dir), "Hello, world", "--temperature", "0", "--max-new-tokens", "12",
            "--json"] + ascii_only
    text = _cli_json(capsys, base)["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out2 = _cli_json(capsys, base + ["--stop", stop])
    assert out2["stop_reason"] == "stop_sequence" and out2["text"] == text[:text.index(stop)]
    # end-of-text (forced by a logit bias) ends generation and is not printed
    out3 = _cli_json(capsys, base + ["--logit-bias", f"{tok.eot_id}=100"])
    assert out3["stop_reason"] == "eot" and out3["ids"] == [tok.eot_id] and out3["text"] == ""
    # an empty prompt starts from end-of-text
    assert _cli_json(capsys, base[:2] + [""] + base[3:])["prompt_ids"] == [tok.eot_id]
    # streaming mode prints the prompt, the text and the timings line
    assert main(["generate", str(hf_dir), "Hi", "--max-new-tokens", "4", "--seed", "3"]) == 0
    printed = capsys.readouterr()  # the text on stdout, the timings line on stderr
    assert printed.out.startswith("Hi") and "tok/s" in printed.err and "stop: max_new_tokens" in printed.err


def test_cli_checkpoint_dir_and_chat(hf_dir, tmp_path, capsys, monkeypatch):
    import io

    from logitlab.cli.main import main
    from logitlab.io import checkpoint
    from logitlab.io.hf import load_pretrained

    d = tmp_path / "model"
    checkpoint.save_model(load_pretrained(hf_dir), d)
    small_tokenizer().save(d / checkpoint.TOKENIZER_FILE)
    argv = ["Hello, world", "--temperature", "0", "--max-new-tokens", "6", "--json"]
    a = _cli_json(capsys, ["generate", str(d)] + argv)
    b = _cli_json(capsys, ["generate", str(hf_dir)] + argv)
    assert a["ids"] == b["ids"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n/reset\nAgain\n"))
    assert main(["chat", str(d), "--max-new-tokens", "5", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("you> ") == 4 and out.count("tok/s") == 2
    assert main(["generate", str(tmp_path), "x"]) == 2  # no model there: a clean error


def test_stream_text_holds_back_split_characters_and_stop_strings():
    from logitlab.cli.generate import stream_text
    from logitlab.generate.stops import StopHoldBack

    tok = small_tokenizer()
    ids = tok.encode("héllo wörld")
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)  # é is split
    pieces = list(stream_text(tok, ids))
    assert "".join(pieces) == "héllo wörld" and not any("\ufffd" in p for p in pieces)
    assert list(stream_text(tok, tok.encode("the cat sat"), stops=(b"cat",))) and \
        "".join(stream_text(tok, tok.encode("the cat sat"), stops=(b"cat",))) == "the "
    assert "".join(stream_text(tok, tok.encode("a<|endoftext|>b"), hidden_ids=[tok.eot_id])) == "ab"
    hold = StopHoldBack(["\n\n"])
    assert hold.feed("a\n") == "a" and hold.feed("b") == "\nb" and hold.feed("c\n") == "c"
    assert hold.feed("\nd") == "" and hold.done and hold.flush() == ""


def test_cli_hf_dir_with_gpt2_vocab_files(tmp_path, gpt2_files, capsys):
    """--hf with vocab.json + merges.txt instead of tokenizer.json (GPT-2's own layout)."""
    import shutil

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("logitlab.io.hf", reason="logitlab.hf (Hugging Face import) is not available")
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    for f in gpt2_files:
        shutil.copy(f, tmp_path / f.name)
    out = _cli_json(capsys, ["generate", str(tmp_path), "Hello, world", "--temperature", "0",
                             "--max-new-tokens", "3", "--json"])
    assert out["prompt_ids"] == [15496, 11, 995]  # GPT-2's own ids for "Hello, world"
    assert len(out["ids"]) <= 3


@pytest.mark.parametrize("flags, named", [
    (["--frequency-penalty", "nan"], "frequency_penalty must be a finite number, got nan"),
    (["--presence-penalty", "inf"], "presence_penalty must be a finite number, got inf"),
    (["--logit-bias", "5=nan"], "logit_bias for token 5 must be a finite number, or -inf"),
    (["--logit-bias", "5=inf", "--logit-bias", "6=inf"], "logit_bias for token 5 must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    (["--seed", str(2**70)], "seed must be None or an integer"),
])
def test_cli_refuses_non_finite_sampling_controls(hf_dir, capsys, flags, named):
    from logitlab.cli.main import main

    assert main(["generate", str(hf_dir), "Hello", "--json"] + flags) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"error: {named}" in " ".join(captured.err.split())


def test_cli_tiny_temperature_is_greedy(hf_dir, capsys):
    base = ["generate", str(hf_dir), "Hello, world", "--max-new-tokens", "6", "--json", "--temperature"]
    assert _cli_json(capsys, base + ["1e-40"])["ids"] == _cli_json(capsys, base + ["0"])["ids"]


def test_cli_generate_and_chat_stop_with_one_error_line_on_non_finite_logits(tmp_path, capsys, monkeypatch):
    """A final norm of 3e38 (finite, so the checkpoint loads) overflows the logits to inf / NaN:
    exit code 2 and one error naming the step and row, on a line of its own."""
    import io

    from logitlab.cli.main import main
    from logitlab.io import checkpoint

    tok = small_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2,
                                    n_heads=4))
    with torch.no_grad():
        model.final_norm.weight.fill_(3e38)
    d = tmp_path / "m"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    for argv in (["Hello"], ["Hello", "--json"], ["Hello", "--temperature", "0"]):
        assert main(["generate", str(d), "--max-new-tokens", "4"] + argv) == 2
        captured = capsys.readouterr()
        err = " ".join(captured.err.split())
        assert captured.out in ("", "Hello\n") and captured.err.count("error:") == 1
        assert "cannot choose the next token at step 0 (new token 1) of batch row 0: the model's logits" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n"))
    assert main(["chat", str(d), "--max-new-tokens", "4"]) == 2
    assert "the model's logits contain" in " ".join(capsys.readouterr().err.split())


def test_cli_ordinary_keeps_special_token_text_as_text(hf_dir, capsys, monkeypatch):
    import io

    import logitlab.generate.loop as gen
    from logitlab.cli.main import main
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer.from_hf(hf_dir / "tokenizer.json")
    prompt = "Hello<|endoftext|>world"
    base = ["generate", str(hf_dir), prompt, "--temperature", "0", "--max-new-tokens", "2", "--json"]
    parsed = _cli_json(capsys, base)["prompt_ids"]
    assert parsed == tok.encode(prompt) and tok.eot_id in parsed  # the default: special tokens parsed
    plain = _cli_json(capsys, base + ["--ordinary"])["prompt_ids"]
    assert plain == tok.encode_ordinary(prompt) and tok.eot_id not in plain
    # chat: the transcript is plain text by default (and with --ordinary), parsed with --no-ordinary
    prompts, real = [], gen.stream

    def recording(model, ids, *args, **kwargs):
        prompts.append(list(ids))
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(gen, "stream", recording)
    for flags in ([], ["--ordinary"], ["--no-ordinary"]):
        monkeypatch.setattr("sys.stdin", io.StringIO(prompt + "\n"))
        assert main(["chat", str(hf_dir), "--max-new-tokens", "2", "--seed", "0"] + flags) == 0
    assert [tok.eot_id in ids for ids in prompts] == [False, False, True]


def test_cli_help_says_how_special_token_text_is_read(capsys, monkeypatch):
    from logitlab.cli.main import main

    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps (and splits at hyphens) to this width
    for command, says in (("generate", "Special-token text in PROMPT such as <|endoftext|> becomes its id; "
                                       "--ordinary keeps it as text"),
                          ("chat", "What you type is plain text: special-token text such as <|endoftext|> "
                                   "stays text (--no-ordinary turns it into the special token's id)")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert says in capsys.readouterr().out


def test_generation_does_not_change_the_model_it_is_given(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = (model.validate_inputs, model.training)
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args: seen.append(m.validate_inputs))
    try:
        generate(model, PROMPTS, GREEDY)
    finally:
        handle.remove()
    assert seen and all(seen)             # never switched off, not even during a step
    assert (model.validate_inputs, model.training) == flags
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_generate_footer_goes_to_stderr_and_explains_the_first_token(hf_dir, capsys):
    from logitlab.cli.main import main

    assert main(["generate", str(hf_dir), "Hello, world", "--max-new-tokens", "5", "--seed", "0",
                 "--logit-bias", f"{small_tokenizer().eot_id}=-inf"]) == 0
    captured = capsys.readouterr()
    assert "tok/s" not in captured.out and "prefill" not in captured.out  # `> out.txt` holds only the text
    err = " ".join(captured.err.split())
    n = len(small_tokenizer().encode("Hello, world"))
    assert f"prompt {n} tokens" in err and "5 new tokens = 1 from the prefill + 4 decoded" in err
    assert "stop: max_new_tokens" in err


def test_cli_stop_ids_do_not_swallow_the_prompt(hf_dir, capsys):
    import argparse

    from logitlab.cli.generate import register, sample_config

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["generate", "d", "--stop-ids", "10", "def parse("])
    assert args.prompt == "def parse(" and sample_config(args).stop_ids == (10,)
    args = parser.parse_args(["generate", "d", "--stop-ids", "10,13", "--stop-ids", "7", "x"])
    assert args.prompt == "x" and sample_config(args).stop_ids == (10, 13, 7)
    out = _cli_json(capsys, ["generate", str(hf_dir), "--stop-ids", "10", "Hello", "--temperature",
                             "0", "--max-new-tokens", "3", "--json"])
    assert out["prompt"] == "Hello"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "d", "--stop-ids", "ten", "x"])
    assert "argument --stop-ids: must be token ids separated by commas" in capsys.readouterr().err


def test_cli_prompt_escapes_like_stop(hf_dir, capsys):
    from logitlab.cli.generate import _unescape

    assert _unescape(r"a\nb\tc\\n") == "a\nb\tc\\n"
    out = _cli_json(capsys, ["generate", str(hf_dir), r"Hello\nworld", "--temperature", "0",
                             "--max-new-tokens", "2", "--json"])
    assert out["prompt"] == "Hello\nworld" and out["prompt_ids"] == small_tokenizer().encode("Hello\nworld")


def test_cli_prompt_is_dim_in_a_terminal_and_plain_when_piped(monkeypatch, capsys):
    import io

    from rich.console import Console

    from logitlab.cli.generate import _write_prompt

    term = io.StringIO()
    _write_prompt(Console(file=term, force_terminal=True, color_system="standard"), "def f(")
    assert "\x1b[2m" in term.getvalue() and "def f(" in term.getvalue()  # dim
    _write_prompt(Console(file=io.StringIO(), force_terminal=False), "def f(")
    assert capsys.readouterr().out == "def f("  # plain, no escape codes
