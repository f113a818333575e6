"""Hook points (model/hooks.py): every activation named on every architecture, the forward unchanged
when no hook is set, reads and writes for one call, the cached activations held to a recomputation
by hand from the weights, and the residual stream as the sum of its parts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from logitlab.model.cache import KVCache
from logitlab.model.config import ModelConfig
from logitlab.model.hooks import EAGER_ONLY, hook_points, hooks, run_with_cache
from logitlab.model.transformer import Transformer

BASE = dict(vocab_size=61, context_length=32, d_model=32, n_layers=2, n_heads=4)
LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False)
LINEAR = dict(linear_n_k_heads=2, linear_n_v_heads=4, linear_k_head_dim=8, linear_v_head_dim=6)
ARCHS = {
    "gpt2": {},
    "llama-gqa": dict(LLAMA, n_kv_heads=2),
    "qwen3-qknorm": dict(LLAMA, n_kv_heads=1, head_dim=16, qk_norm=True),
    "sliding": dict(LLAMA, layer_types=("sliding_attention", "full_attention"), sliding_window=3),
    "sinks-gated": dict(LLAMA, attn_sinks=True, attn_gate="headwise"),
    "hybrid": dict(LLAMA, **LINEAR, layer_types=("linear_attention", "full_attention"), attn_gate="elementwise",
                   norm_zero_centered=True),
    "moe": dict(LLAMA, n_kv_heads=2, n_experts=6, n_experts_per_token=2, moe_d_ff=16, shared_expert_d_ff=16,
                shared_expert_gate=True),
}


def build(arch: str, **kw) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**BASE, **ARCHS[arch], **kw})).eval()
    with torch.no_grad():                                          # sinks and biases away from their zero init
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0, 0.5)
    return model


def ids(B=2, T=9, seed=1) -> torch.Tensor:
    return torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(seed))


def no_taps(model) -> bool:
    return all(m.__dict__.get("_taps") is None for m in model.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_reading_every_point_leaves_the_forward_exact_and_the_model_clean(arch):
    model = build(arch)
    x = ids()
    with torch.no_grad():
        plain = model(x)
    names = [p.name for p in hook_points(model) if p.name.rpartition(".")[2] not in EAGER_ONLY]
    seen = []
    with torch.no_grad(), hooks(model, {n: lambda t, name: seen.append(name) for n in names}):
        hooked = model(x)
    assert torch.equal(hooked, plain)
    assert sorted(seen) == sorted(names)                           # every point reached, once
    assert no_taps(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_residual_stream_is_the_embedding_plus_every_mixer_and_mlp_output(arch):
    model = build(arch)
    logits, cache = run_with_cache(model, ids())
    total = cache["embed"] + cache.get("pos_embed", 0)
    for i in range(model.config.n_layers):
        assert torch.equal(cache[f"blocks.{i}.resid_pre"], total if i == 0 else cache[f"blocks.{i - 1}.resid_post"])
        r = cache[f"blocks.{i}.resid_pre"]
        assert torch.equal(cache[f"blocks.{i}.resid_mid"], r + cache[f"blocks.{i}.attn_out"])
        mid = cache[f"blocks.{i}.resid_mid"]
        assert torch.equal(cache[f"blocks.{i}.resid_post"], mid + cache[f"blocks.{i}.mlp_out"])
        total = total + cache[f"blocks.{i}.attn_out"] + cache[f"blocks.{i}.mlp_out"]
    torch.testing.assert_close(cache[f"blocks.{model.config.n_layers - 1}.resid_post"], total, rtol=0, atol=1e-5)
    assert torch.equal(cache["logits"], logits)
    B, T = 2, 9
    for p in hook_points(model):                                   # the documented leading shape
        if p.what.startswith("(B, T,"):
            assert cache[p.name].shape[:2] == (B, T), p.name


def _ln(x, norm):
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def test_gpt2_activations_equal_a_recomputation_by_hand_from_the_weights():
    model = build("gpt2")
    x = ids()
    B, T = x.shape
    H, Dh = 4, 8
    _, c = run_with_cache(model, x)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    r = model.tok_emb.weight[x] + model.pos_emb.weight[:T]
    close(c["blocks.0.resid_pre"], r)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i, blk in enumerate(model.blocks):
        q, k, v = F.linear(_ln(r, blk.attn_norm), blk.attn.qkv_proj.weight, blk.attn.qkv_proj.bias).view(
            B, T, 3, H, Dh).unbind(2)                             # (B, T, H, Dh) each
        for name, t in (("q", q), ("k", k), ("v", v)):
            close(c[f"blocks.{i}.attn.{name}"], t)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(Dh)
        scores = scores.masked_fill(~causal, float("-inf"))
        close(c[f"blocks.{i}.attn.scores"], scores)
        pattern = scores.softmax(-1)
        close(c[f"blocks.{i}.attn.pattern"], pattern)
        z = torch.einsum("bhts,bshd->bthd", pattern, v)
        close(c[f"blocks.{i}.attn.z"], z)
        attn_out = F.linear(z.reshape(B, T, H * Dh), blk.attn.o_proj.weight, blk.attn.o_proj.bias)
        close(c[f"blocks.{i}.attn_out"], attn_out)
        r = r + attn_out
        pre = F.linear(_ln(r, blk.mlp_norm), blk.mlp.up_proj.weight, blk.mlp.up_proj.bias)
        close(c[f"blocks.{i}.mlp.pre"], pre)
        close(c[f"blocks.{i}.mlp.post"], F.gelu(pre, approximate=model.config.gelu_approximate))
        r = r + F.linear(F.gelu(pre, approximate=model.config.gelu_approximate), blk.mlp.down_proj.weight,
                         blk.mlp.down_proj.bias)
        close(c[f"blocks.{i}.resid_post"], r)
    centred = r - r.mean(-1, keepdim=True)
    scale = 1 / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + model.final_norm.eps)
    close(c["final_norm.scale"], scale)
    close(c["logits"], F.linear(_ln(r, model.final_norm), model.lm_head.weight)[..., :61])


def test_llama_activations_equal_a_recomputation_by_hand_from_the_weights():
    """RoPE, RMSNorm, GQA (Hkv 2 of H 4) and SwiGLU, by hand: q and k rotated, each kv head read by
    two query heads."""
    model = build("llama-gqa")
    x = ids()
    B, T = x.shape
    H, Hkv, Dh = 4, 2, 8
    _, c = run_with_cache(model, x)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    rms = lambda t, n: n.weight * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + n.eps)  # noqa: E731
    inv = 1.0 / (model.config.rope_theta ** (torch.arange(0, Dh, 2).float() / Dh))
    angle = torch.arange(T).float()[:, None] * inv                 # (T, Dh/2)
    cos, sin = angle.cos().repeat(1, 2)[:, None], angle.sin().repeat(1, 2)[:, None]   # (T, 1, Dh)
    rot = lambda t: t * cos + torch.cat((-t[..., Dh // 2:], t[..., :Dh // 2]), -1) * sin  # noqa: E731
    r = model.tok_emb.weight[x]
    for i, blk in enumerate(model.blocks):
        qkv = F.linear(rms(r, blk.attn_norm), blk.attn.qkv_proj.weight)
        q, k, v = qkv.view(B, T, H + 2 * Hkv, Dh).split((H, Hkv, Hkv), dim=2)
        q, k = rot(q), rot(k)
        close(c[f"blocks.{i}.attn.q"], q)
        close(c[f"blocks.{i}.attn.k"], k)
        close(c[f"blocks.{i}.attn.v"], v)
        k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)   # head h reads kv head h // 2
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(Dh)
        pattern = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        close(c[f"blocks.{i}.attn.pattern"], pattern)
        z = torch.einsum("bhts,bshd->bthd", pattern, v)
        close(c[f"blocks.{i}.attn.z"], z)
        r = r + F.linear(z.reshape(B, T, H * Dh), blk.attn.o_proj.weight)
        gate, up = F.linear(rms(r, blk.mlp_norm), blk.mlp.gate_up_proj.weight).chunk(2, -1)
        close(c[f"blocks.{i}.mlp.pre"], gate)
        close(c[f"blocks.{i}.mlp.up"], up)
        r = r + F.linear(F.silu(gate) * up, blk.mlp.down_proj.weight)
        close(c[f"blocks.{i}.resid_post"], r)
    close(c["logits"], F.linear(rms(r, model.final_norm), model.lm_head.weight))


@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa", "sliding", "sinks-gated", "moe"])
def test_a_pattern_hook_runs_that_layer_eager_for_that_call_only(arch):
    model = build(arch)
    x = ids()
    with torch.no_grad():
        plain = model(x)
        eager_logits, weights = model.forward_with_attention(x)
    logits, cache = run_with_cache(model, x, names=["blocks.*.attn.pattern"])
    for i, w in enumerate(weights):                                # the eager path's own weights, bit for bit
        assert torch.equal(cache[f"blocks.{i}.attn.pattern"], w)
    assert torch.equal(logits, eager_logits)
    if not model.config.attn_sinks:                                # a scores hook alone switches too
        _, one = run_with_cache(model, x, names=["blocks.0.attn.scores"])   # block 0: the same input as above
        assert torch.equal(one["blocks.0.attn.scores"].softmax(-1), weights[0])
    with torch.no_grad():
        assert torch.equal(model(x), plain)                        # the SDPA path again after the call
    assert no_taps(model)


def test_scores_and_pattern_are_exact_against_the_cached_q_and_k():
    model = build("llama-gqa")
    _, c = run_with_cache(model, ids(), names=["blocks.0.attn.*"])
    q, k, v = c["blocks.0.attn.q"].transpose(1, 2), c["blocks.0.attn.k"].transpose(1, 2), c["blocks.0.attn.v"]
    k = k.repeat_interleave(2, dim=1)                              # (B, H, T, Dh)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(8)
    T = scores.shape[-1]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    assert torch.equal(c["blocks.0.attn.scores"], scores)
    assert torch.equal(c["blocks.0.attn.pattern"], torch.softmax(scores, -1, dtype=torch.float32))
    z = torch.matmul(c["blocks.0.attn.pattern"], v.repeat_interleave(2, dim=2).transpose(1, 2)).transpose(1, 2)
    assert torch.equal(c["blocks.0.attn.z"], z)


def test_write_hooks_replace_activations_for_the_call_and_are_removed_on_an_error():
    model = build("llama-gqa")
    x = ids()
    zero = lambda t, n: torch.zeros_like(t)                        # noqa: E731
    with torch.no_grad():
        plain = model(x)
        with hooks(model, {"blocks.1.attn_out": zero}):
            ablated = model(x)
            _, inner = run_with_cache(model, x, names=["blocks.1.resid_mid"])   # hooks nest
        _, c = run_with_cache(model, x, names=["blocks.1.resid_pre"])
        r, blk = c["blocks.1.resid_pre"], model.blocks[1]
        by_hand = model.unembed(r + blk.mlp(blk.mlp_norm(r)))      # block 1 without its attention
    assert torch.equal(inner["blocks.1.resid_mid"], r)
    torch.testing.assert_close(ablated, by_hand, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ablated, plain)
    with pytest.raises(RuntimeError, match="boom"):
        with hooks(model, {"blocks.0.mlp_out": lambda t, n: (_ for _ in ()).throw(RuntimeError("boom"))}):
            model(x)
    assert no_taps(model)
    with torch.no_grad():
        assert torch.equal(model(x), plain)


def test_bad_names_and_bad_hooks_are_clear_errors():
    model = build("gpt2")
    with pytest.raises(ValueError, match="no hook point 'blocks.0.resid_pos'.*blocks.0.resid_post"):
        run_with_cache(model, ids(), names=["blocks.0.resid_pos"])
    with pytest.raises(ValueError, match=r"returned \(3,\).*\(2, 9, 32\)"):
        with hooks(model, {"blocks.0.resid_mid": lambda t, n: torch.zeros(3)}):
            model(ids())
    with pytest.raises(ValueError, match="not callable"):
        with hooks(model, {"embed": 3}):
            pass
    assert no_taps(model)


def test_the_gated_deltanet_state_and_gates_read_and_follow_a_cache():
    from logitlab.model.deltanet import gated_delta_rule_reference

    model = build("hybrid")
    x = ids(T=7)
    _, c = run_with_cache(model, x, names=["blocks.0.linear_attn.*"])
    p = "blocks.0.linear_attn."
    o, state = gated_delta_rule_reference(*(c[p + n] for n in ("q", "k", "v", "g", "beta")))
    torch.testing.assert_close(c[p + "o"], o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c[p + "state"], state, rtol=1e-4, atol=1e-5)
    assert ((c[p + "g"] <= 0) & (c[p + "beta"] > 0) & (c[p + "beta"] < 1)).all()
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    with torch.no_grad():
        model(x[:, :6], cache=cache)
    _, step = run_with_cache(model, x[:, 6:], names=[p + "state"], cache=cache)
    torch.testing.assert_close(step[p + "state"], state, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), hooks(model, {p + "state": lambda t, n: torch.zeros_like(t)}):
        model(x[:, :1], cache=cache)                               # a write reaches the cache
    assert torch.count_nonzero(cache.linear_state(0).recurrent) == 0


def test_moe_routing_is_read_and_an_expert_can_be_ablated():
    model = build("moe")
    x = ids()
    _, c = run_with_cache(model, x, names=["blocks.0.mlp.*", "blocks.0.mlp_out"])
    logits, experts, weights = (c[f"blocks.0.mlp.{n}"] for n in ("router_logits", "experts", "weights"))
    assert logits.shape == (2, 9, 6) and experts.shape == weights.shape == (2, 9, 2)
    assert torch.equal(experts, logits.topk(2, dim=-1).indices)    # topk_softmax: the two largest logits
    drop = lambda t, n: torch.zeros_like(t)                        # noqa: E731  every expert's weight 0
    with hooks(model, {"blocks.0.mlp.weights": drop}):
        _, only_shared = run_with_cache(model, x, names=["blocks.0.mlp_out", "blocks.0.resid_mid"])
    mlp = model.blocks[0].mlp
    with torch.no_grad():
        h = model.blocks[0].mlp_norm(only_shared["blocks.0.resid_mid"])
        shared = torch.sigmoid(mlp.shared_gate(h)) * mlp.shared(h)   # the shared expert alone
    torch.testing.assert_close(only_shared["blocks.0.mlp_out"], shared, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(c["blocks.0.mlp_out"], shared)


def test_the_final_norm_scale_read_is_exact_and_a_write_uses_it():
    for arch in ("gpt2", "llama-gqa", "hybrid"):
        model = build(arch)
        x = ids()
        with torch.no_grad():
            plain = model(x)
        logits, c = run_with_cache(model, x, names=["final_norm.scale"])
        assert torch.equal(logits, plain)
        with torch.no_grad(), hooks(model, {"final_norm.scale": lambda t, n: t.clone()}):
            torch.testing.assert_close(model(x), plain, rtol=1e-5, atol=1e-5)
        with torch.no_grad(), hooks(model, {"final_norm.scale": lambda t, n: t * 2}):
            assert not torch.allclose(model(x), plain)


def test_a_cached_decode_step_names_the_new_positions():
    model = build("llama-gqa")
    x = ids(T=8)
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    with torch.no_grad():
        model(x[:, :7], cache=cache)
    _, c = run_with_cache(model, x[:, 7:], names=["blocks.0.attn.k", "blocks.0.attn.pattern", "blocks.0.resid_post"],
                          cache=cache)
    assert c["blocks.0.attn.k"].shape == (2, 1, 2, 8)
    assert c["blocks.0.attn.pattern"].shape == (2, 4, 1, 8)
    assert c["blocks.0.resid_post"].shape == (2, 1, 32)


@pytest.mark.slow
def test_compiled_graph_is_the_same_before_and_after_hooks():
    """The forward with no hook set traces to the same graph, with no break, before any hook was set
    and after a hooks() block was left."""
    model = build("qwen3-qknorm")
    x = ids()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, fullgraph=True)(x)
        run_with_cache(model, x, names=["blocks.*.attn.pattern", "blocks.*.resid_post"])
        torch._dynamo.reset()
        torch.compile(model, backend=capture, fullgraph=True)(x)
    assert len(graphs) == 2 and graphs[0] == graphs[1]
    assert "scaled_dot_product_attention" in graphs[0]             # the fast path, not the eager one
