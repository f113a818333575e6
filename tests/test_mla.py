"""Multi-head latent attention: the expanded and the absorbed form agree (in a forward and in
decoding), the decode cache holds only the latent and the RoPE key and the absorbed form never
decompresses it, cached decoding equals the full forward, the fields are checked by name, and the
accounting (parameters, cache bytes, attention FLOPs) matches the model that is built."""

from __future__ import annotations

import pytest
import torch

from logitlab.generate import SampleConfig, generate
from logitlab.model import ModelConfig, Transformer, accounting_mla
from logitlab.model import accounting as acc
from logitlab.model.attention import eager_attention
from logitlab.model.cache import KVCache, LatentKV
from logitlab.model.mla import MLA, set_mla_form, softmax_scale

V, R, RQ, DN, DR, DV = 61, 12, 20, 6, 4, 5


def _config(**kw) -> ModelConfig:
    base = dict(vocab_size=V, context_length=48, d_model=24, n_layers=2, n_heads=3, norm="rmsnorm", mlp="swiglu",
                positions="rope", bias=False, d_ff=32, kv_lora_rank=R, q_lora_rank=RQ, qk_rope_head_dim=DR,
                qk_nope_head_dim=DN, v_head_dim=DV, tie_embeddings=False)
    return ModelConfig(**{**base, **kw})


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(_config(**kw)).eval()
    with torch.no_grad():                          # norms away from 1, so a wrong norm shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


LAYOUTS = [dict(), dict(q_lora_rank=None), dict(rope_interleaved=True, qkv_bias=True, bias=True),
           dict(v_head_dim=DN + 3)]


@pytest.mark.parametrize("kw", LAYOUTS)
def test_expanded_and_absorbed_forms_agree(kw):
    model = _model(**kw)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    outs = {}
    for form in ("expanded", "absorbed"):
        set_mla_form(model, form)
        with torch.no_grad():
            outs[form] = model(ids)
    torch.testing.assert_close(outs["absorbed"], outs["expanded"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", LAYOUTS[:2])
def test_cached_decoding_in_either_form_equals_the_full_forward(kw):
    model = _model(**kw)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        set_mla_form(model, "expanded")
        want = model(ids)
        for form in ("auto", "expanded", "absorbed"):
            set_mla_form(model, form)
            cache = KVCache.for_model(model, batch_size=2, max_len=16)
            got = [model(ids[:, :5], cache=cache), model(ids[:, 5:9], cache=cache)]   # a chunk after a cache
            got += [model(ids[:, t:t + 1], cache=cache) for t in range(9, 12)]
            torch.testing.assert_close(torch.cat(got, dim=1), want, atol=2e-5, rtol=1e-5)


def test_one_head_attention_of_the_absorbed_form_masks_as_eager_does():
    """The absorbed form folds the heads into the query axis; with a padding mask and a causal
    mask aligned to the end it equals the eager reference that broadcasts the one key head."""
    layer = _model().blocks[0].attn
    q, k, v = torch.randn(2, 3, 4, 7), torch.randn(2, 1, 9, 7), torch.randn(2, 1, 9, 5)
    pad = torch.ones(2, 1, 4, 9, dtype=torch.bool)
    pad[0, :, :, :3] = False                                        # row 0: three padding slots
    causal = torch.ones(4, 9, dtype=torch.bool).tril(5)
    for mask, is_causal in ((pad & causal, False), (None, False), (None, True)):
        if is_causal:                                               # T == S: the plain causal mask
            k, v = k[:, :, :4], v[:, :, :4]
        want, _ = eager_attention(q, k, v, mask, is_causal, scale=layer.scale)
        torch.testing.assert_close(layer._attend_one_head(q, k, v, mask, is_causal), want, atol=1e-5, rtol=1e-5)


def test_decode_reads_the_latent_without_decompressing_it(monkeypatch):
    """"auto" decodes in the absorbed form: kv_b_proj never runs on the cached latents."""
    model = _model()
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    cache = KVCache.for_model(model, batch_size=1, max_len=12)
    with torch.no_grad():
        model(ids[:, :8], cache=cache)                              # prefill: expanded
        calls = []
        for layer in model.blocks:
            monkeypatch.setattr(layer.attn.kv_b_proj, "forward", lambda x: calls.append(x.shape) or 1 / 0)
        model(ids[:, 8:], cache=cache)                              # decode: absorbed
    assert calls == [] and cache.length == 9


def test_the_cache_holds_only_the_latent_and_the_rope_key():
    model = _model(rope_interleaved=True)
    c = model.config
    cache = KVCache.for_model(model, batch_size=2, max_len=10)
    assert all(isinstance(e, LatentKV) for e in cache.layers) and cache.k == [None, None]
    assert [e.latent.shape for e in cache.layers] == [(2, 1, 10, R + DR)] * 2
    assert cache.nbytes == c.n_layers * 2 * 10 * (R + DR) * 4 == acc.kv_cache_bytes(c, "fp32", 10)["total"] * 2
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids, cache=cache)
        x = model.blocks[0].attn_norm(model.tok_emb(ids))             # layer 0's attention input
        attn = model.blocks[0].attn
        latent, k_rope = attn.kv_a_proj(x).split((R, DR), dim=-1)
        angle = torch.arange(6.0)[:, None] * c.rope_theta ** (-torch.arange(0, DR, 2) / DR)   # (T, Dr/2)
        x0, x1 = k_rope[..., 0::2], k_rope[..., 1::2]                  # interleaved pairs turn
        k_rope = torch.stack((x0 * angle.cos() - x1 * angle.sin(), x1 * angle.cos() + x0 * angle.sin()), -1)
        k_rope = k_rope.flatten(-2)
    row = cache.layers[0].latent[:, 0, :6]                          # (B, T, R + Dr)
    torch.testing.assert_close(row[..., :R], attn.kv_a_norm(latent))
    torch.testing.assert_close(row[..., R:], k_rope)
    assert torch.all(cache.layers[0].latent[:, :, 6:] == 0)
    assert "latent=16" in repr(cache)


def test_speculative_rewind_and_greedy_generate_with_a_latent_cache():
    model = _model()
    cache = KVCache.for_model(model, batch_size=1, max_len=12)
    assert cache.can_rewind and cache.snapshot()["entries"] == {}
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]), cache=cache)
        cache.rewind(2)
        rewound = model(torch.tensor([[5]]), cache=cache)
        fresh = model(torch.tensor([[1, 2, 5]]))[:, -1:]
    torch.testing.assert_close(rewound, fresh, atol=2e-5, rtol=1e-5)
    config = SampleConfig(max_new_tokens=8, temperature=0)
    prompt = [3, 1, 4, 1, 5]
    assert generate(model, prompt, config).tokens == generate(model, prompt, config, use_cache=False).tokens


def test_fields_are_checked_by_name():
    with pytest.raises(ValueError, match="needs qk_rope_head_dim"):
        _config(qk_rope_head_dim=None)
    with pytest.raises(ValueError, match="qk_rope_head_dim \\(3\\) must be even"):
        _config(qk_rope_head_dim=3)
    with pytest.raises(ValueError, match="head_dim \\(8\\) must be qk_nope_head_dim \\+ qk_rope_head_dim = 10"):
        _config(head_dim=8)
    with pytest.raises(ValueError, match="needs n_kv_heads=3, got 1"):
        _config(n_kv_heads=1)
    with pytest.raises(ValueError, match="needs qk_norm=False"):
        _config(qk_norm=True)
    with pytest.raises(ValueError, match="v_head_dim=5 is set but kv_lora_rank is null"):
        _config(kv_lora_rank=None, q_lora_rank=None, qk_rope_head_dim=None, qk_nope_head_dim=None)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive integer, got 0"):
        _config(kv_lora_rank=0)
    c = _config(v_head_dim=None)
    assert (c.head_dim, c.v_head_dim, c.rotary_dim, c.is_mla) == (DN + DR, DN, DR, True)
    with pytest.raises(ValueError, match="MLA form must be one of"):
        set_mla_form(_model(), "compressed")
    with pytest.raises(ValueError, match="holds no latent"):
        KVCache(1, 1, 1, 4, 4).update_latent(0, torch.zeros(1, 1, 1, 8))
    with pytest.raises(ValueError, match="multi-head latent attention \\(update_latent\\)"):
        KVCache.for_model(_config(), 1).update(0, torch.zeros(1, 3, 1, 10), torch.zeros(1, 3, 1, 10))


def test_softmax_scale_under_yarn_with_mscale_all_dim():
    from logitlab.model.config import RopeScaling

    assert softmax_scale(_config()) == (DN + DR) ** -0.5
    yarn = RopeScaling(rope_type="yarn", factor=40.0, original_context_length=8, mscale=1.0, mscale_all_dim=1.0)
    assert softmax_scale(_config(rope_scaling=yarn, context_length=320)) == pytest.approx(
        (DN + DR) ** -0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=None)])
def test_accounting_counts_the_layer_that_is_built(kw):
    c = _config(**kw)
    exact, formula = acc.count_parameters(c), acc.formula_count(c)
    attn = MLA(c)
    matrices = sum(p.numel() for p in attn.parameters() if p.dim() == 2)
    assert formula.attention_per_layer == matrices == accounting_mla.attention_formula(c)
    assert exact.attention_per_layer == matrices                    # the latent norms count as norms
    assert exact.norms_per_layer == 2 * c.d_model + R + (c.q_lora_rank or 0)
    assert exact.total - formula.total == sum(acc.explain_difference(c, exact).values())
    assert acc.kv_cache_bytes(c, "bf16", 1)["per_token"] == c.n_layers * (R + DR) * 2


def test_attention_flops_per_key_are_the_products_the_expanded_form_runs():
    from torch.utils.flop_counter import FlopCounterMode

    model = _model()
    set_mla_form(model, "expanded")
    model.attn_impl = "eager"
    T = 10
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, V, (1, T)))
    products = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert products - 2 * T * acc.matmul_params(model.config) == model.config.n_layers * T * T * \
        accounting_mla.flops_per_key(model.config)


def test_cache_comparison_against_mha_and_gqa_of_the_same_heads():
    c = _config(n_heads=16, n_layers=3)
    got = accounting_mla.cache_comparison(c, 2)
    per_head = DN + DR + DV
    assert got["mla_per_token"] == 3 * (R + DR) * 2
    assert got["mha_per_token"] == 3 * 16 * per_head * 2 and got["gqa_per_token"] == 3 * 2 * per_head * 2
    assert got["mha_over_mla"] == pytest.approx(16 * per_head / (R + DR))
    assert accounting_mla.cache_comparison(ModelConfig(vocab_size=8, d_model=8, n_heads=2), 2) is None


def test_int8_quantization_keeps_kv_b_proj_and_both_forms_still_agree():
    from logitlab.quant import QuantConfig, quantize_model

    model = _model()
    report = quantize_model(model, QuantConfig("int8"))
    assert sorted(report.skipped) == ["blocks.0.attn.kv_b_proj", "blocks.1.attn.kv_b_proj"]
    assert "blocks.0.attn.kv_a_proj" in report.layers
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        outs = [set_mla_form(model, form) or model(ids) for form in ("expanded", "absorbed")]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-5)


def test_tensor_parallel_refuses_latent_attention_by_name():
    from logitlab.parallel.tensor import check_tensor_parallel

    with pytest.raises(ValueError, match="multi-head latent attention \\(kv_lora_rank=12\\)"):
        check_tensor_parallel(_config(n_heads=3, vocab_size=60, d_ff=30), 3)


def test_a_serve_request_joins_a_running_batch_of_a_latent_attention_model():
    """The engine copies a request's cache rows into a free slot: here the latent rows."""
    from logitlab.serve.engine import Engine

    model, done = _model(), {}
    e = Engine(model, eot_id=None)
    greedy = SampleConfig(max_new_tokens=12, temperature=0)
    e.submit([1, 2, 3, 4, 5], greedy, lambda ev, k="a": done.setdefault(k, []).append(ev))
    e.submit([7, 8], SampleConfig(max_new_tokens=2, temperature=0), lambda ev: None)
    for _ in range(4):
        e.step()
    e.submit([9, 10, 11], greedy, lambda ev, k="c": done.setdefault(k, []).append(ev))
    while e.step():
        pass
    assert e.stats["inserts"] == 1
    for key, prompt in (("a", [1, 2, 3, 4, 5]), ("c", [9, 10, 11])):
        tokens = [ev.token for ev in done[key] if hasattr(ev, "token")]
        assert tokens == generate(model, prompt, greedy).tokens[0]


def test_lora_adapts_the_output_projection_and_names_what_latent_attention_lacks():
    from logitlab.train.lora import LoRAConfig, apply_lora

    with pytest.raises(ValueError, match="'q_proj' does not exist in a swiglu model with multi-head latent attention "
                                         "\\(targets here: o_proj, down_proj, gate_proj, up_proj, lm_head\\)"):
        apply_lora(_model(), LoRAConfig())
    model = _model()
    assert apply_lora(model, LoRAConfig(targets="o_proj")) == ["blocks.0.attn.o_proj", "blocks.1.attn.o_proj"]


@pytest.mark.parametrize("gather", ["index", "reference"])
def test_the_paged_cache_keeps_latent_rows_in_its_blocks(gather):
    """Batched decoding over blocks (a shared prefix, padding) equals generating each prompt alone."""
    from logitlab.model.paged import PagedCache
    from tests.test_paged import _decode_all

    model = _model()
    cache = PagedCache(model, n_blocks=24, block_size=4, max_seqs=4, gather=gather)
    assert set(cache.k) == {0, 1} and cache.v == {} and cache.k[0].shape == (96, 1, R + DR)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [3, 4]]
    outs, _ = _decode_all(model, cache, prompts, 6)
    for p, out in zip(prompts, outs):
        assert out == generate(model, p, SampleConfig(temperature=0, max_new_tokens=7)).tokens[0]
    assert cache.blocks.hits == 2


def test_the_paged_engine_serves_a_latent_attention_model():
    from logitlab.serve.paged_engine import PagedEngine

    model, done = _model(), {}
    e = PagedEngine(model, block_size=4, chunk_tokens=6)
    prompts = [list(range(1, 14)), [5, 6], list(range(1, 9)) + [30]]
    greedy = SampleConfig(max_new_tokens=6, temperature=0)
    for i, p in enumerate(prompts):
        e.submit(p, greedy, lambda ev, i=i: done.setdefault(i, []).append(ev))
    while e.step():
        pass
    for i, p in enumerate(prompts):
        assert [ev.token for ev in done[i] if hasattr(ev, "token")] == generate(model, p, greedy).tokens[0]
    assert e.stats["tokens_recomputed"] == 0


def test_attention_patterns_are_the_same_in_both_forms():
    """inspect reads the pattern (forward_with_attention): each form gives the same probabilities."""
    model = _model()
    ids = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(6))
    patterns = {}
    with torch.no_grad():
        for form in ("expanded", "absorbed"):
            set_mla_form(model, form)
            logits, patterns[form] = model.forward_with_attention(ids)
            torch.testing.assert_close(logits, model(ids), atol=2e-5, rtol=1e-5)
    for a, b in zip(patterns["expanded"], patterns["absorbed"]):
        assert a.shape == (1, 3, 7, 7)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.sum(-1), torch.ones(1, 3, 7))


def test_training_reaches_every_projection_and_norm():
    import torch.nn.functional as F

    model = _model().train()
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(7))
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    attn = dict(model.blocks[0].attn.named_parameters())
    assert sorted(attn) == ["kv_a_norm.weight", "kv_a_proj.weight", "kv_b_proj.weight", "o_proj.weight",
                            "q_a_norm.weight", "q_a_proj.weight", "q_b_proj.weight"]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attn.values())


@pytest.mark.slow
def test_compiled_decode_step_is_one_graph_through_the_absorbed_form():
    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import compiled_decode_step

    model = _model()
    cfg = SampleConfig(max_new_tokens=6, temperature=0)
    want = generate(model, [[1, 2, 3, 4], [5, 6, 7, 8]], cfg).tokens
    step = compiled_decode_step(model, "aot_eager", step=decode_step)
    assert generate(model, [[1, 2, 3, 4], [5, 6, 7, 8]], cfg, step=step).tokens == want


def test_hook_points_read_the_latent_and_patch_the_heads_in_both_forms():
    from logitlab.model.hooks import hook_points, hooks, run_with_cache

    model = _model()
    names = [p.name for p in hook_points(model) if p.module == "blocks.0.attn"]
    assert names == [f"blocks.0.attn.{n}" for n in ("q", "latent", "scores", "pattern", "z")]
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(8))
    seen = {}
    for form in ("expanded", "absorbed"):
        set_mla_form(model, form)
        cache = KVCache.for_model(model, batch_size=1, max_len=8)
        logits, acts = run_with_cache(model, ids, ["blocks.0.attn.*"], cache=cache)
        assert acts["blocks.0.attn.latent"].shape == (1, 6, R + DR) and acts["blocks.0.attn.q"].shape == (1, 6, 3, 10)
        torch.testing.assert_close(acts["blocks.0.attn.latent"], cache.layers[0].latent[:, 0, :6])
        torch.testing.assert_close(acts["blocks.0.attn.pattern"].sum(-1), torch.ones(1, 3, 6))
        seen[form] = acts
        with torch.no_grad(), hooks(model, {"blocks.1.attn.z": lambda z, name: torch.zeros_like(z)}):
            patched = model(ids)                                    # layer 1's heads silenced
            silenced = model.blocks[1].attn.o_proj.weight.clone()
            model.blocks[1].attn.o_proj.weight.zero_()
            want = model(ids)
            model.blocks[1].attn.o_proj.weight.copy_(silenced)
        torch.testing.assert_close(patched, want)
        assert not torch.allclose(patched, logits)
    for name in ("blocks.0.attn.pattern", "blocks.0.attn.z", "blocks.0.attn.q", "blocks.0.attn.scores"):
        torch.testing.assert_close(seen["absorbed"][name], seen["expanded"][name], atol=1e-5, rtol=1e-5)
