"""The decode loop when a model goes wrong mid-generation: NaN logits at a later step raise a
SamplingError naming that step and batch row (eager, compiled greedy step that picks the ids
inside its graph, sampling, penalties, the reference path), and a row that already finished does
not stop the others."""

from __future__ import annotations

import pytest
import torch

from logitlab.generate.loop import SampleConfig, SamplingError, decode_step, generate, prefill
from logitlab.kernels.decode import compiled_decode_step
from logitlab.model.cache import KVCache
from logitlab.model.transformer import ModelConfig, Transformer

# untied embeddings: a NaN row of the input table poisons only the steps that feed that token
CONFIG = ModelConfig(vocab_size=97, context_length=48, d_model=32, n_layers=2, n_heads=4, init_std=0.3,
                     n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False,
                     tie_embeddings=False)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CONFIG).eval()


def poisoned(model, token: int):
    """A copy of `model` whose input embedding of `token` is NaN (the model itself is untouched)."""
    copy = Transformer(CONFIG).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        copy.tok_emb.weight[token] = float("nan")
    return copy


def first_fault(free: list[list[int]], row: int) -> tuple[int, int]:
    """A token that `row` generates at some step s >= 1 and nothing fed before step s + 1 contains
    (no prompt, no earlier token of any row): poisoning it makes step s + 1 of `row` the first NaN."""
    fed = {0} | {t for p in PROMPTS for t in p}  # 0: the id of left padding
    for s in range(1, len(free[row]) - 1):
        token = free[row][s]
        earlier = fed | {t for r, ids in enumerate(free) for t in ids[:s + (r != row)]}
        if token not in earlier:
            return token, s + 1
    raise AssertionError(f"no suitable token in {free}")


CASES = {
    "greedy": (SampleConfig(temperature=0, max_new_tokens=10), False),
    "greedy-compiled": (SampleConfig(temperature=0, max_new_tokens=10), "aot_eager"),
    "sampled": (SampleConfig(temperature=0.8, top_k=20, seed=3, max_new_tokens=10), False),
    "penalised": (SampleConfig(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                               max_new_tokens=10), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("row", [0, 1])
def test_nan_logits_at_a_later_step_raise_naming_the_step_and_row(model, case, row):
    cfg, compile = CASES[case]
    free = generate(model, PROMPTS, cfg).tokens
    token, step = first_fault(free, row)
    bad = poisoned(model, token)
    if compile:
        import torch._dynamo

        torch._dynamo.reset()
    with pytest.raises(SamplingError, match=f"step {step} .*batch row {row}: the model's logits contain .*NaN") as err:
        generate(bad, PROMPTS, cfg, step=compiled_decode_step(bad, compile, step=decode_step) if compile
                 else decode_step)
    assert (err.value.step, err.value.row) == (step, row)
    assert isinstance(err.value, RuntimeError)  # the CLI prints RuntimeErrors as one 'error:' line


def test_the_reference_path_raises_too(model):
    cfg = SampleConfig(temperature=0, max_new_tokens=10)
    free = [generate(model, PROMPTS[0], cfg).tokens[0], []]
    token, step = first_fault(free, 0)
    with pytest.raises(SamplingError, match=f"step {step} .*batch row 0: the model's logits contain .*NaN"):
        generate(poisoned(model, token), PROMPTS[0], cfg, use_cache=False)


def test_a_finished_row_with_nan_logits_does_not_stop_the_others(model):
    """Row 0 ends at end-of-text, whose embedding is NaN: the next step still runs row 0 through the
    model (its logits are NaN), which must neither raise nor feed an invalid id; row 1 goes on."""
    cfg = SampleConfig(temperature=0, max_new_tokens=10)
    free = generate(model, PROMPTS, cfg).tokens
    fed = [0, free[0][0]] + free[1] + sum(PROMPTS, [])
    eot = next(t for t in free[0][1:] if t not in fed)
    got = generate(poisoned(model, eot), PROMPTS, cfg, eot_id=eot)
    assert got.tokens[0] == free[0][:free[0].index(eot) + 1] and got.stop_reasons[0] == "eot"
    assert got.tokens[1] == free[1] and got.stop_reasons[1] == "max_new_tokens"


def test_greedy_decode_step_marks_a_row_with_non_finite_logits(model):
    """decode_step(greedy=True) picks ids inside a compiled graph, so it must flag NaN rows itself
    (-1) rather than return the argmax of NaN; a finite row still gets its argmax."""
    bad = poisoned(model, 13)
    ids = torch.tensor([[3, 1, 4], [9, 2, 6]])
    with torch.inference_mode():
        caches = [KVCache.for_model(CONFIG, 2, 16) for _ in range(2)]
        for cache in caches:
            prefill(bad, ids, cache)
        token = torch.tensor([[13], [5]])  # row 0 feeds the poisoned token
        logits = decode_step(bad, token, caches[0])
        picked = decode_step(bad, token, caches[1], greedy=True)
    assert logits[0].isnan().all() and torch.isfinite(logits[1]).all()
    assert picked.tolist() == [-1, int(logits[1].argmax())]
