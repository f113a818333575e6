"""The Transformer: causality, tying, cache parity, padding, hidden states, init, errors."""

from __future__ import annotations

import math

import pytest
import torch

from logitlab.model.cache import KVCache
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer

LLAMA_LIKE = dict(positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=61, context_length=32, d_model=32, n_layers=2, n_heads=4)
    base.update(kw)
    return ModelConfig(**base)


def build(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny(**kw)).eval()


VARIANTS = {
    "gpt2": {},
    "llama-gqa": dict(LLAMA_LIKE, n_kv_heads=2),
    "qwen3-qknorm": dict(LLAMA_LIKE, n_kv_heads=1, head_dim=16, qk_norm=True),
    "rope-mha-padded": dict(LLAMA_LIKE, vocab_pad_multiple=64),
    "no-positions-post": dict(positions="none", norm_placement="post"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality_changing_token_t_never_changes_earlier_logits(variant):
    model = build(**VARIANTS[variant])
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        before = model(ids)
        changed = ids.clone()
        changed[:, 7] = (changed[:, 7] + 1) % 61
        after = model(changed)
    assert torch.equal(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize("variant", VARIANTS)
def test_sdpa_and_eager_agree(variant):
    model = build(**VARIANTS[variant])
    ids = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        sdpa = model(ids)
        model.attn_impl = "eager"
        eager = model(ids)
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_kv_cache_prefill_and_decode_equal_full_forward(variant, impl):
    model = build(**VARIANTS[variant])
    model.attn_impl = impl
    ids = torch.randint(0, 61, (2, 14))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, batch_size=2, max_len=20)
        steps = [model(ids[:, :6], cache=cache), model(ids[:, 6:9], cache=cache)]   # prefill + a chunk
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(9, 14)]
    assert cache.length == 14
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa", "qwen3-qknorm"])
def test_left_padding_with_mask_and_positions_equals_each_row_alone(variant):
    model = build(**VARIANTS[variant])
    rows = [torch.randint(0, 61, (n,)) for n in (7, 4, 2)]
    P, B, new = 7, 3, 3
    ids = torch.zeros(B, P, dtype=torch.long)
    attn_mask = torch.zeros(B, P + new, dtype=torch.bool)
    positions = torch.zeros(B, P, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, P - len(r):] = r
        attn_mask[b, P - len(r):] = True
        positions[b, P - len(r):] = torch.arange(len(r))
    attn_mask[:, P:] = True
    nxt = torch.randint(0, 61, (B, new))
    with torch.no_grad():
        cache = KVCache.for_model(model, batch_size=B, max_len=P + new)
        prefill = model(ids, cache=cache, positions=positions, attn_mask=attn_mask)
        decoded = []
        for t in range(new):
            pos = torch.tensor([[len(r) + t] for r in rows])
            decoded.append(model(nxt[:, t:t + 1], cache=cache, positions=pos, attn_mask=attn_mask))
        for b, r in enumerate(rows):
            alone = model(torch.cat([r, nxt[b]])[None])
            torch.testing.assert_close(prefill[b, P - len(r):], alone[0, :len(r)], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.cat(decoded, 1)[b], alone[0, len(r):], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(prefill).all()
        # the same without a cache: mask + positions over the whole padded batch
        model.attn_impl = "eager"
        nocache = model(ids, positions=positions, attn_mask=attn_mask[:, :P])
        torch.testing.assert_close(nocache, prefill, rtol=1e-5, atol=1e-5)


def test_tied_lm_head_is_the_embedding_parameter():
    model = build()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    assert sum(1 for _ in model.parameters()) == len(dict(model.named_parameters()))
    untied = build(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_vocab_padding_leaves_real_logits_unchanged():
    plain = build(**LLAMA_LIKE)
    padded = build(**LLAMA_LIKE, vocab_pad_multiple=64)
    assert padded.tok_emb.weight.shape[0] == 64 and padded.lm_head.weight.shape[0] == 64
    state = plain.state_dict()
    for key in ("tok_emb.weight", "lm_head.weight"):
        extra = torch.randn(3, 32) * 100               # whatever the padded rows hold
        state[key] = torch.cat([state[key], extra])
    padded.load_state_dict(state)
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        out = padded(ids)
        assert out.shape == (2, 9, 61)
        torch.testing.assert_close(out, plain(ids), rtol=1e-6, atol=1e-6)
        logits, hidden = padded.forward_with_hidden(ids)
        assert logits.shape == (2, 9, 61)
    with pytest.raises(ValueError, match="token id 61 is out of range for vocab_size 61"):
        padded(torch.tensor([[1, 61]]))



def test_padded_head_multiplies_only_real_rows_bit_for_bit():
    """The fast head (first V rows of the weight) equals the obvious one (all rows, then slice
    the logits) exactly, fp32 and bf16 autocast, with the same gradients; padded rows get none
    from the head."""
    model = build(**LLAMA_LIKE, vocab_pad_multiple=64).train()
    ids = torch.randint(0, 61, (2, 9))
    for autocast in (False, True):
        outs = []
        for head in (model._head, lambda h: model.lm_head(h)[..., :61]):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                h = model.final_norm(model.forward_features(ids))
                logits = head(h)
            logits.float().logsumexp(-1).mean().backward()
            outs.append((logits, model.lm_head.weight.grad.clone()))
            model.zero_grad(set_to_none=True)
        (fast, g_fast), (slow, g_slow) = outs
        assert fast.is_contiguous() and fast.shape == (2, 9, 61)
        assert torch.equal(fast, slow)
        torch.testing.assert_close(g_fast, g_slow, rtol=0, atol=0)
        assert torch.all(g_fast[61:] == 0)

def test_meta_device_construction_costs_nothing_and_loads_back(tmp_path):
    from logitlab.io.checkpoint import load_model, save_model

    cfg = ModelConfig(vocab_size=128256, context_length=131072, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14336, norm="rmsnorm", mlp="swiglu", positions="rope",
                      rope_scaling={"factor": 8.0}, bias=False, tie_embeddings=False)
    with torch.device("meta"):
        big = Transformer(cfg)
    assert all(p.is_meta for p in big.parameters()) and big.rope.cos.is_meta
    assert sum(p.numel() for p in big.parameters()) == 8_030_261_248

    small = tiny(**dict(VARIANTS["qwen3-qknorm"], tie_embeddings=True))
    with torch.device("meta"):
        empty = Transformer(small)
    empty.to_empty(device="cpu")                       # storage without values; unties the head
    empty.rebuild_buffers()
    empty.init_weights()
    assert empty.lm_head.weight is empty.tok_emb.weight
    assert torch.equal(empty.rope.cos, Transformer(small).rope.cos)

    model = build(**VARIANTS["llama-gqa"])
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m").eval()
    assert not loaded.rope.cos.is_meta and loaded.rope.cos.dtype == torch.float32
    ids = torch.randint(0, 61, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qknorm", "gpt2"])
def test_state_dicts_with_separate_projections_still_load(variant):
    """State dicts written before q/k/v and gate/up became one matrix each hold separate
    q_proj, k_proj, v_proj (and gate_proj, up_proj) keys: checkpoint.upgrade_legacy_state joins
    them into the fused rows (and loading them as they are fails, naming the keys)."""
    from logitlab.io.checkpoint import upgrade_legacy_state

    model = build(**dict(VARIANTS[variant], qkv_bias=True))
    H, Hkv, Dh = model.config.n_heads, model.config.n_kv_heads, model.config.head_dim
    legacy = {}
    for key, t in model.state_dict().items():
        if ".attn.qkv_proj." in key:
            for name, rows in zip(("q_proj", "k_proj", "v_proj"), t.split((H * Dh, Hkv * Dh, Hkv * Dh))):
                legacy[key.replace("qkv_proj", name)] = rows.clone()
        elif ".mlp.gate_up_proj." in key:
            gate, up = t.chunk(2)
            legacy[key.replace("gate_up_proj", "gate_proj")] = gate.clone()
            legacy[key.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            legacy[key] = t.clone()
    fresh = Transformer(model.config).eval()
    with pytest.raises(RuntimeError, match="q_proj"):
        fresh.load_state_dict(legacy)                               # no hidden rewriting on load
    fresh.load_state_dict(upgrade_legacy_state(legacy))             # strict: every key accounted for
    ids = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


def test_hidden_states_follow_the_transformers_convention():
    model = build(**VARIANTS["llama-gqa"])
    ids = torch.randint(0, 61, (2, 5))
    with torch.no_grad():
        logits, hidden = model.forward_with_hidden(ids)
        assert len(hidden) == model.config.n_layers + 1
        assert all(h.shape == (2, 5, 32) for h in hidden)
        torch.testing.assert_close(hidden[0], model.tok_emb(ids))
        x = hidden[0]
        for block in model.blocks:
            x, _ = block(x, model.rope(torch.arange(5)[None]), is_causal=True)
        torch.testing.assert_close(hidden[-1], model.final_norm(x))      # last entry is normed
        torch.testing.assert_close(logits, model.lm_head(hidden[-1]))
        torch.testing.assert_close(model.unembed(x), logits)
        torch.testing.assert_close(logits, model(ids))
        torch.testing.assert_close(model.unembed(model.forward_features(ids)[:, -1:]), logits[:, -1:])


def test_forward_with_attention_returns_causal_weights():
    model = build()
    ids = torch.randint(0, 61, (2, 6))
    with torch.no_grad():
        logits, weights = model.forward_with_attention(ids)
        torch.testing.assert_close(logits, model(ids), rtol=1e-5, atol=1e-5)
    assert len(weights) == 2 and weights[0].shape == (2, 4, 6, 6)
    assert torch.all(weights[1].triu(1) == 0)
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(2, 4, 6))


def test_post_norm_block_is_norm_of_residual_sum():
    model = build(norm_placement="post")
    block = model.blocks[0]
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        h = block.attn_norm(x + block.attn(x, None, is_causal=True)[0])
        expected = block.mlp_norm(h + block.mlp(h))
        torch.testing.assert_close(block(x, None, is_causal=True)[0], expected)


def test_init_recipe_statistics():
    cfg = ModelConfig(vocab_size=512, context_length=64, d_model=256, n_layers=2, n_heads=4,
                      tie_embeddings=False)
    model = Transformer(cfg)
    std = lambda t: float(t.detach().float().std())  # noqa: E731
    assert std(model.blocks[0].attn.o_proj.weight) == pytest.approx(0.02 / math.sqrt(4), rel=0.05)
    assert std(model.blocks[1].mlp.down_proj.weight) == pytest.approx(0.01, rel=0.05)
    assert std(model.blocks[0].attn.qkv_proj.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.tok_emb.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.lm_head.weight) == pytest.approx(0.02, rel=0.05)
    assert torch.all(model.blocks[0].attn.qkv_proj.bias == 0)
    assert torch.all(model.blocks[0].attn_norm.weight == 1) and torch.all(model.final_norm.bias == 0)


def test_bad_inputs_raise_clear_errors():
    model = build()
    with pytest.raises(ValueError, match="token id -1 is out of range for vocab_size 61"):
        model(torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match="token id 99 is out of range"):
        model(torch.tensor([[0, 99]]))
    with pytest.raises(ValueError, match=r"33 positions exceed context_length \(32\)"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = KVCache.for_model(model, 1)
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"30 cached \+ 3 new = 33 positions exceed context_length \(32\)"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_mask"):
        model(torch.zeros(1, 3, dtype=torch.long), attn_mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_impl"):
        model.attn_impl = "flash"
    model.validate_inputs = False
    model(torch.tensor([[0, 5]]))                     # still runs with validation off


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_heads=5), r"d_model \(32\) must be divisible by n_heads \(5\)"),
    (dict(n_kv_heads=3), r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
    (dict(norm="batchnorm"), "norm must be one of .*'batchnorm'"),
    (dict(positions="xpos"), "positions must be one of .*'xpos'"),
    (dict(d_model=0), "d_model must be a positive integer, got 0"),
    (dict(head_dim=7, positions="rope"), r"head_dim \(7\) must be even"),
    (dict(dropout=1.5), r"dropout must be in \[0, 1\), got 1.5"),
])
def test_config_validation_names_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(qk_norm="false"), "qk_norm: expected true or false, got 'false'"),
    (dict(tie_embeddings=1), "tie_embeddings: expected true or false, got 1"),
    (dict(qkv_bias="no"), "qkv_bias: expected true or false or null, got 'no'"),
    (dict(n_kv_heads="1"), "n_kv_heads: expected an integer or null, got '1'"),
    (dict(n_kv_heads=1.0), "n_kv_heads: expected an integer or null, got 1.0"),
    (dict(n_layers=True), "n_layers: expected an integer, got True"),
    (dict(norm_eps="1e-5"), "norm_eps: expected a finite number, got '1e-5'"),
    (dict(norm_eps=math.nan), "norm_eps: expected a finite number, got nan"),
    (dict(rope_theta=math.inf), "rope_theta: expected a finite number, got inf"),
    (dict(dropout=False), "dropout: expected a finite number, got False"),
    (dict(mlp=None), r"mlp must be one of \('gelu', 'swiglu', 'relu2'\), got None"),
    (dict(rope_scaling="yes"), "rope_scaling: expected an object .* or null, got 'yes'"),
    (dict(rope_scaling={"factor": 8.0, "scale": 2}), r"unknown rope_scaling field\(s\) \['scale'\]"),
    (dict(rope_scaling={"original_context_length": 8.5}), "rope_scaling.original_context_length: expected an integer"),
])
def test_config_fields_must_have_their_declared_types(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)


def test_config_types_normalise_json_values():
    """An int where a float is declared becomes a float, a rope_scaling dict a RopeScaling."""
    from logitlab.model.config import RopeScaling

    cfg = tiny(norm_eps=1, rope_scaling={"factor": 4, "original_context_length": 16})
    assert type(cfg.norm_eps) is float and cfg.rope_scaling == RopeScaling(4.0, 1.0, 4.0, 16)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_dropout_only_in_training_and_bf16_runs():
    model = build(dropout=0.5)
    ids = torch.randint(0, 61, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids))
        model.train()
        assert not torch.equal(model(ids), model(ids))
    model = build(**VARIANTS["qwen3-qknorm"])
    with torch.no_grad():
        ref = model(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(ids)
        half = model.to(torch.bfloat16)(ids)
    assert auto.dtype == torch.bfloat16 and half.dtype == torch.bfloat16
    torch.testing.assert_close(auto.float(), ref, rtol=0.1, atol=0.1)
    torch.testing.assert_close(half.float(), ref, rtol=0.1, atol=0.1)


def test_backward_reaches_every_parameter():
    model = build(**VARIANTS["qwen3-qknorm"]).train()
    ids = torch.randint(0, 61, (2, 8))
    model(ids).float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_autocast_matches_transformers_bit_for_bit(family):
    """Same op order as transformers (RMSNorm in float32 then cast, RoPE in the residual dtype,
    softmax inside SDPA): under bf16 autocast every hidden state and the logits are identical."""
    transformers = pytest.importorskip("transformers")
    from logitlab.model.families import config_from_hf
    from logitlab.model.keymap import state_dict_from_hf

    common = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    if family == "llama":
        hf_cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0)
        hf = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        hf = transformers.Qwen3ForCausalLM(hf_cfg)
    hf.eval()
    cfg = config_from_hf(hf_cfg.to_dict())
    model = Transformer(cfg).eval()
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), strict=False)
    model.tie_weights()
    ids = torch.randint(0, 61, (2, 11))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = hf(ids, output_hidden_states=True)
        logits, hidden = model.forward_with_hidden(ids)
    assert logits.dtype == ref.logits.dtype == torch.bfloat16
    for ours, theirs in zip(hidden, ref.hidden_states, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(logits, ref.logits)



def test_compiles_as_one_graph_forward_and_backward():
    """torch.compile(model, fullgraph=True) raises on any graph break; aot_eager traces forward
    and backward as inductor would, without the C++ compile, so the test stays fast."""
    torch._dynamo.reset()
    model = build(**dict(VARIANTS["qwen3-qknorm"], vocab_pad_multiple=64)).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 61, (2, 9))
    grads = []
    for run in (compiled, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(ids)
        out.float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    for n, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][n], rtol=1e-3, atol=1e-6, msg=n)


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa", "qwen3-qknorm"])
def test_no_graph_breaks_with_and_without_cache(variant):
    model = build(**VARIANTS[variant])
    ids = torch.randint(0, 61, (2, 6))
    cache = KVCache.for_model(model, batch_size=2, max_len=12)
    with torch.no_grad():
        model(ids, cache=cache)
        for args, kw in (((ids,), {}), ((ids[:, :1],), dict(cache=cache))):
            explained = torch._dynamo.explain(model)(*args, **kw)
            assert explained.graph_break_count == 0, explained.break_reasons
            assert explained.graph_count == 1
