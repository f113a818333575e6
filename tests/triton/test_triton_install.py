"""kernels.triton_install: a model with the Triton attention installed gives the plain model's
logits and gradients, with and without a KV cache, and remove() gives the model back as it was."""

from __future__ import annotations

import pytest
import torch

from logitlab.kernels import triton_install
from logitlab.model.cache import KVCache
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer


def tiny(device, **overrides):
    fields = dict(vocab_size=97, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  norm="rmsnorm", mlp="swiglu", positions="rope")
    fields.update(overrides)
    torch.manual_seed(0)
    return Transformer(ModelConfig(**fields)).to(device)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls that reach the kernel (so a silent fall-back to SDPA would fail a test)."""
    seen = []
    kernel = triton_install.flash_attention

    def counted(q, k, v, causal=False):
        seen.append((tuple(q.shape), tuple(k.shape), causal))
        return kernel(q, k, v, causal)

    monkeypatch.setattr(triton_install, "flash_attention", counted)
    return seen


def logits_and_grads(model, ids):
    logits = model(ids)
    loss = logits.float().square().mean()
    return logits.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("overrides", [{}, {"qk_norm": True, "n_kv_heads": 4},
                                       {"positions": "learned", "n_kv_heads": 1}])
def test_installed_model_equals_the_plain_model(device, calls, overrides):
    model = tiny(device, **overrides)
    ids = torch.randint(0, 97, (2, 21), device=device)
    want, want_grads = logits_and_grads(model, ids)
    handle = triton_install.install(model)
    assert handle.modules == 2
    got, got_grads = logits_and_grads(model, ids)
    assert len(calls) == 2 and all(c[2] for c in calls)           # both layers, causal, by the kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    handle.remove()
    assert all(type(b.attn).__name__ == "Attention" for b in model.blocks)
    torch.testing.assert_close(model(ids), want, rtol=0, atol=0)


def test_cached_prefill_and_decode_equal_the_plain_model(device, calls):
    model = tiny(device)
    ids = torch.randint(0, 97, (1, 12), device=device)

    def run():
        cache = KVCache.for_model(model.config, batch_size=1, max_len=16)
        with torch.no_grad():
            first = model(ids[:, :9], cache=cache)                 # prefill from position 0: causal
            steps = [model(ids[:, i:i + 1], cache=cache) for i in range(9, 12)]   # decode: T = 1
        return torch.cat([first, *steps], dim=1)

    want = run()
    handle = triton_install.install(model)
    got = run()
    handle.remove()
    assert [c[2] for c in calls] == [True] * 2 + [False] * 6       # prefill causal, decode steps not
    assert calls[-1][:2] == ((1, 4, 1, 16), (1, 2, 12, 16))        # one query against 12 cached keys
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_masks_and_weights_keep_their_own_route(device, calls):
    model = tiny(device)
    ids = torch.randint(0, 97, (2, 10), device=device)
    pad = torch.ones(2, 10, dtype=torch.bool, device=device)
    pad[1, :3] = False                                             # a left-padded row
    with torch.no_grad():
        want_masked, (want_h, want_w) = model(ids, attn_mask=pad), model.forward_with_attention(ids)
        handle = triton_install.install(model)
        got_masked, (got_h, got_w) = model(ids, attn_mask=pad), model.forward_with_attention(ids)
    handle.remove()
    assert calls == []                                             # SDPA with the mask; eager for weights
    torch.testing.assert_close(got_masked, want_masked, rtol=0, atol=0)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(got_w[0], want_w[0], rtol=0, atol=0)


def test_install_twice_and_refusals(device):
    model = tiny(device)
    first = triton_install.install(model)
    second = triton_install.install(model)
    assert (first.modules, second.modules) == (2, 0)
    first.remove()
    with pytest.raises(ValueError, match="head_dim 12 is not supported"):
        triton_install.install(tiny(device, d_model=48, n_heads=4))
    with pytest.raises(ValueError, match="no logitlab Attention"):
        triton_install.install(torch.nn.Linear(3, 3).to(device))
