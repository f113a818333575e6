"""KVCache: preallocated storage, in-place writes, explicit advance, clear errors."""

from __future__ import annotations

import pytest
import torch

from logitlab.model.cache import KVCache
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer


def test_update_writes_in_place_and_returns_views():
    cache = KVCache(n_layers=2, batch_size=2, n_kv_heads=3, max_len=10, head_dim=4)
    storage = cache.k[1].data_ptr()
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    k_all, v_all = cache.update(1, k1, v1)
    assert k_all.shape == (2, 3, 4, 4) and k_all.data_ptr() == storage
    assert torch.equal(k_all, k1) and torch.equal(v_all, v1)
    assert cache.length == 0                       # update never moves length
    cache.advance(4)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    k_all, v_all = cache.update(1, k2, v2)
    assert k_all.shape == (2, 3, 5, 4)
    assert torch.equal(k_all[:, :, :4], k1) and torch.equal(k_all[:, :, 4:], k2)
    assert torch.equal(v_all[:, :, 4:], v2)
    assert cache.k[1].data_ptr() == storage       # no reallocation
    assert torch.all(cache.k[0] == 0)             # other layers untouched


def test_full_cache_and_bad_shapes_raise():
    cache = KVCache(1, 1, 2, max_len=4, head_dim=8)
    cache.update(0, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    cache.advance(3)
    with pytest.raises(ValueError, match=r"max_len \(4\)"):
        cache.update(0, torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    with pytest.raises(ValueError, match="max_len"):
        cache.advance(2)
    with pytest.raises(ValueError, match="Hkv=2"):
        cache.update(0, torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))
    with pytest.raises(ValueError, match="max_len must be a positive integer, got 0"):
        KVCache(1, 1, 2, max_len=0, head_dim=8)


def test_reset_and_nbytes():
    cache = KVCache(3, 2, 2, max_len=5, head_dim=4, dtype=torch.bfloat16)
    assert cache.nbytes == 2 * 3 * 2 * 2 * 5 * 4 * 2
    cache.advance(5)
    cache.reset()
    assert cache.length == 0


def test_for_model_uses_kv_heads_and_model_dtype():
    cfg = ModelConfig(vocab_size=20, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      positions="rope")
    cache = KVCache.for_model(cfg, batch_size=3)
    assert len(cache.k) == 2 and cache.k[0].shape == (3, 2, 16, 8) and cache.dtype == torch.float32
    model = Transformer(cfg).to(torch.bfloat16)
    cache = KVCache.for_model(model, batch_size=1, max_len=8)
    assert cache.k[0].shape == (1, 2, 8, 8) and cache.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"max_len \(17\) exceeds .*context_length \(16\)"):
        KVCache.for_model(cfg, 1, max_len=17)


def test_generation_and_the_server_allocate_the_context_they_use(monkeypatch):
    """Llama 3's 131,072 positions at batch 1 must not reserve the whole context: generate sizes
    its cache to the prompt and the tokens asked for, the server's engine its batch to the rows'
    prompts and budgets (rounded up to CACHE_ROUNDING, room for requests that join)."""
    from logitlab.generate import SampleConfig, generate
    from logitlab.serve.engine import CACHE_ROUNDING, Engine

    cfg = ModelConfig(vocab_size=61, context_length=131072, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    model = Transformer(cfg).eval()
    sizes = []
    build = KVCache.__init__
    monkeypatch.setattr(KVCache, "__init__", lambda self, *a, **kw: sizes.append(a[3]) or build(self, *a, **kw))
    out = generate(model, [1, 2, 3], SampleConfig(max_new_tokens=5, temperature=0))
    assert len(out.tokens[0]) == 5 and sizes == [8]             # 3 prompt + 5 new positions, not 131,072
    events = []
    engine = Engine(model)
    engine.submit([4, 5, 6, 7], SampleConfig(max_new_tokens=6, temperature=0), events.append)
    while engine.step():
        pass
    assert sizes[1:] == [CACHE_ROUNDING] and len(events) == 7  # 6 tokens and the end
