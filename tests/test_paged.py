"""The paged KV cache (model/paged.py, model/paged_blocks.py): blocks, hashes, sharing, and a
forward over blocks equal to the contiguous cache's."""

from __future__ import annotations

import pytest
import torch

from logitlab.generate import SampleConfig, generate
from logitlab.model import ModelConfig, Transformer
from logitlab.model.paged import PagedCache, PagedView, run
from logitlab.model.paged_blocks import BlockManager, block_hashes

HYBRID = dict(layer_types=("sliding_attention", "linear_attention", "full_attention"), sliding_window=5,
              attn_sinks=True, n_layers=3)


def _model(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=50, context_length=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    return Transformer(ModelConfig(**{**cfg, **kw})).eval()


# -------------------- the bookkeeping

def test_block_hashes_chain_the_prefix_and_skip_a_partial_block():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    b = block_hashes([9, 2, 3, 4, 5, 6], 3)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]                  # same tokens 4, 5, 6, another prefix
    assert block_hashes([1, 2, 3, 4, 5, 6, 8], 3) == a     # the partial block is not hashed
    assert block_hashes([4, 5, 6], 3, previous=a[0]) == a[1:]


def test_manager_shares_cached_blocks_evicts_lru_and_refuses_when_full():
    m = BlockManager(3, 2)
    x, y = m.allocate(), m.allocate()
    m.register(x, b"x")
    m.register(y, b"y")
    assert not m.writable(x) and m.in_use == 2
    m.release(x)
    m.release(y)                                           # both cached, y used last
    assert m.in_use == 0 and m.available == 3 and list(m.lru) == [x, y]
    assert m.match([b"x", b"z"]) == [x] and m.refs[x] == 1 and m.hits == 1
    z = m.allocate()                                       # the free block first
    w = m.allocate()                                       # then the least recently used cached: y
    assert w == y and m.evictions == 1 and b"y" not in m.by_hash and z not in (x, y)
    with pytest.raises(RuntimeError, match="all 3 blocks"):
        m.allocate()
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    m.release(z)
    with pytest.raises(RuntimeError, match="released more often"):
        m.release(z)


# -------------------- the forward over blocks

def _decode_all(model, cache, prompts, steps):
    """Prefill each prompt (its uncached part) alone, then decode all together -> greedy ids."""
    outs = [[] for _ in prompts]
    with torch.inference_mode():
        seqs = []
        for p, out in zip(prompts, outs):
            seq = cache.start(p)
            ids = p[seq.length:]
            cache.prepare(seq, len(ids))
            out.append(int(run(model, cache.view([seq], [ids]))[0].argmax()))
            seqs.append(seq)
        for _ in range(steps):
            for seq in seqs:
                cache.prepare(seq, 1)
            logits = run(model, cache.view(seqs, [[o[-1]] for o in outs]))             # (B, V)
            for b, out in enumerate(outs):
                out.append(int(logits[b].argmax()))
    return outs, seqs


@pytest.mark.parametrize("gather", ["index", "reference"])
@pytest.mark.parametrize("kind", ["plain", "hybrid", "alibi"])
def test_batched_decode_over_blocks_equals_each_prompt_alone(kind, gather):
    model = _model(**(HYBRID if kind == "hybrid" else dict(positions="alibi") if kind == "alibi" else {}))
    cache = PagedCache(model, n_blocks=40, block_size=4, max_seqs=4, gather=gather)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12], [3, 4]]
    outs, _ = _decode_all(model, cache, prompts, 12)
    for p, out in zip(prompts, outs):
        assert out == generate(model, p, SampleConfig(temperature=0, max_new_tokens=13)).tokens[0]
    assert cache.blocks.hits == (2 if kind != "hybrid" else 0)   # the second prompt shares two blocks


def test_the_two_gathers_return_the_same_keys_and_padding_is_masked():
    model = _model()
    caches = [PagedCache(model, n_blocks=20, block_size=3, gather=g) for g in ("index", "reference")]
    got = []
    for cache in caches:
        seqs = [cache.start([5] * 7), cache.start([6] * 2)]
        for s, n in zip(seqs, (7, 2)):
            cache.prepare(s, n)
        view = cache.view(seqs, [[5] * 7, [6] * 2])                 # right padding of row 1
        k_new = torch.randn(2, 2, 7, 8, generator=torch.Generator().manual_seed(1))
        got.append(view.update(0, k_new, -k_new))
        assert view.attn_mask.tolist() == [[True] * 7, [True] * 2 + [False] * 5]
        assert view.positions[1].tolist() == list(range(7))
    for a, b in zip(*got):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1, :, :2], b[1, :, :2], rtol=0, atol=0)   # real keys of the padded row


def test_a_fully_cached_prompt_copies_its_last_block_before_writing():
    model = _model()
    cache = PagedCache(model, n_blocks=20, block_size=4)
    prompt = list(range(1, 9))                                     # two full blocks
    (first,), (a,) = _decode_all(model, cache, [prompt], 3)
    (second,), (b,) = _decode_all(model, cache, [prompt], 3)
    assert first == second
    assert b.reused == 7 and cache.copies == 1                     # block 2 shared, then copied at position 7
    assert a.table[0] == b.table[0] and a.table[1] != b.table[1]
    cache.finish(a)
    cache.finish(b)
    assert cache.blocks.in_use == 0 and len(cache.blocks.lru) >= 2


def test_bad_gather_and_uneven_rows_with_recurrent_state():
    model = _model(**HYBRID)
    with pytest.raises(ValueError, match="gather"):
        PagedCache(model, 4, gather="fused")
    cache = PagedCache(model, 10, 4, max_seqs=2)
    assert not cache.prefix_caching                                # Gated DeltaNet: off
    s, t = cache.start([1, 2, 3]), cache.start([4])
    cache.prepare(s, 3)
    cache.prepare(t, 1)
    with pytest.raises(ValueError, match="no padding"):
        cache.view([s, t], [[1, 2, 3], [4]])
    with pytest.raises(ValueError, match="every state slot"):
        cache.start([5])


def test_the_index_gather_reuses_one_buffer_for_every_layer_and_step():
    model = _model()
    caches = {g: PagedCache(model, n_blocks=40, block_size=4, gather=g) for g in ("index", "reference")}
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 4]]
    seen = {g: [] for g in caches}
    update = PagedView.update
    for g, cache in caches.items():
        def spy(view, layer, k_new, v_new, g=g):
            k, v = update(view, layer, k_new, v_new)                              # (B, Hkv, S, Dh)
            pad = ~view.attn_mask[:, None, :, None]                               # (B, 1, S, 1)
            seen[g].append((k.masked_fill(pad, 0), v.masked_fill(pad, 0), k.untyped_storage().data_ptr()))
            return k, v                                                           # (copied as returned)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PagedView, "update", spy)
            _decode_all(model, cache, prompts, 4)
    for (k, v, _), (rk, rv, _) in zip(seen["index"], seen["reference"]):
        assert torch.equal(k, rk) and torch.equal(v, rv)            # each layer's keys, as they were returned
    assert set(caches["index"].workspace) == {0, 1}                  # keys and values: one buffer each, all layers
    decode = [ptr for _, _, ptr in seen["index"][2 * len(prompts):]]   # the 4 decode steps of 2 layers
    assert len(set(decode)) <= 2                                      # grown (by doubling) at most once
    assert len(decode) == 8 and not caches["reference"].workspace
