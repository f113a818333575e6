"""Modern attention: the gated delta rule's three forms, hybrid stacks (Gated DeltaNet, sliding
windows, gated attention, sinks), their caches, and exact parity with Hugging Face's Qwen3.5,
Mistral (sliding window) and gpt-oss's sink attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitlab.generate import SampleConfig, generate
from logitlab.model import KVCache, ModelConfig, Transformer, get_preset
from logitlab.model import accounting as acc
from logitlab.model.attention import eager_attention
from logitlab.model.deltanet import (
    CHUNK,
    CHUNK_DEFAULT,
    default_chunk,
    gated_delta_rule_chunked,
    gated_delta_rule_reference,
    gated_delta_rule_step,
    l2_normalise,
)

HYBRID = dict(vocab_size=97, context_length=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
              d_ff=48, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, qkv_bias=False,
              linear_n_k_heads=2, linear_n_v_heads=4, linear_k_head_dim=8, linear_v_head_dim=6)


def _config(**changes) -> ModelConfig:
    return ModelConfig(**{**HYBRID, **changes})


def _rule_inputs(B=2, T=21, H=3, Dk=5, Dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalise(torch.randn(B, T, H, Dk, generator=g)) / Dk ** 0.5
    k = l2_normalise(torch.randn(B, T, H, Dk, generator=g))
    v = torch.randn(B, T, H, Dv, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 2                 # log a_t in (-2, 0]
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, Dk, Dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 8, 16, 32, 64, None])
def test_chunked_rule_equals_the_loop(chunk):
    q, k, v, g, beta, state = _rule_inputs()
    for initial in (None, state):
        ref_o, ref_s = gated_delta_rule_reference(q, k, v, g, beta, initial)
        o, s = gated_delta_rule_chunked(q, k, v, g, beta, initial, chunk=chunk)
        torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_rule_gradients_equal_the_loops(chunk):
    """Training runs backward through the chunked form: its gradients must be the loop's."""
    inputs = [t.clone().requires_grad_() for t in _rule_inputs(T=19)]          # float32, as both compute
    weights = torch.randn(2, 19, 3, 4, generator=torch.Generator().manual_seed(1))

    def grads(rule):
        o, s = rule(*inputs[:5], inputs[5], **({"chunk": chunk} if rule is gated_delta_rule_chunked else {}))
        return torch.autograd.grad((o * weights).sum() + s.square().sum(), inputs)

    for got, want in zip(grads(gated_delta_rule_chunked), grads(gated_delta_rule_reference)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_default_chunk_is_fixed_per_device_type():
    """No timing decides it: the same device type always gets the same size, so a run's bits repeat."""
    assert default_chunk(torch.device("cpu")) == CHUNK["cpu"] == default_chunk("cpu")
    assert default_chunk(torch.device("meta")) == CHUNK_DEFAULT
    q, k, v, g, beta, _ = _rule_inputs(T=40)
    o_default, _ = gated_delta_rule_chunked(q, k, v, g, beta)
    o_explicit, _ = gated_delta_rule_chunked(q, k, v, g, beta, chunk=CHUNK["cpu"])
    assert torch.equal(o_default, o_explicit)


def test_step_rule_is_one_position_of_the_loop():
    q, k, v, g, beta, state = _rule_inputs(T=6)
    ref_o, ref_s = gated_delta_rule_reference(q, k, v, g, beta, state)
    s = state.clone()
    outs = [gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s) for t in range(6)]
    torch.testing.assert_close(torch.stack(outs, 1), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)


def test_delta_rule_replaces_what_the_state_recalls():
    """beta = 1, no decay: after writing v for a unit key k, the state recalls exactly v for k."""
    k = torch.tensor([[[[1.0, 0.0, 0.0]]]])                         # (B, T, H, Dk)
    v = torch.tensor([[[[2.0, -1.0]]]])
    state = torch.randn(1, 1, 3, 2)
    o, s = gated_delta_rule_reference(k, k, v, torch.zeros(1, 1, 1), torch.ones(1, 1, 1), state)
    torch.testing.assert_close(torch.einsum("k,kv->v", k[0, 0, 0], s[0, 0]), v[0, 0, 0])
    torch.testing.assert_close(o[0, 0, 0], v[0, 0, 0])


@pytest.mark.parametrize("types, extra", [
    (("linear_attention", "full_attention") * 2, {}),
    (("linear_attention", "sliding_attention", "linear_attention", "full_attention"), {"sliding_window": 5}),
    (("sliding_attention",) * 4, {"sliding_window": 3}),
    (None, {"attn_gate": "headwise", "attn_sinks": True}),
])
def test_every_layer_type_reference_cached_and_padded_agree(types, extra):
    torch.manual_seed(0)
    cfg = _config(layer_types=types, attn_gate=extra.pop("attn_gate", "elementwise"), qk_norm=True,
                  norm_zero_centered=True, partial_rotary_factor=0.5, **extra)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 97, (2, 19))
    with torch.no_grad():
        full = model(ids)
        model.attn_impl = "eager"                                    # reference attention + the rule's loop
        torch.testing.assert_close(model(ids), full, atol=1e-5, rtol=1e-5)
        model.attn_impl = "sdpa"
        cache = KVCache.for_model(model, batch_size=2, max_len=32)
        steps = [model(ids[:, :11], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(11, 19)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
        # row 1 left-padded by 3: its logits over the real tokens equal the unpadded run
        short = ids[1:, 3:]
        padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), short), 1)
        mask = torch.ones(2, 19, dtype=torch.bool)
        mask[1, :3] = False
        positions = (torch.arange(19)[None] - torch.tensor([[0], [3]])).clamp(min=0)
        both = model(torch.cat((ids[:1], padded)), attn_mask=mask, positions=positions)
        torch.testing.assert_close(both[1, 3:], model(short)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(both[0], full[0], atol=1e-5, rtol=1e-5)


def test_sliding_window_reads_only_the_last_w_keys_and_its_cache_stops_growing():
    torch.manual_seed(0)
    cfg = _config(layer_types=("sliding_attention",) * 4, sliding_window=4)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        _, weights = model.forward_with_attention(ids)
    w = weights[0][0, 0]                                            # (T, S) of layer 0, head 0
    t, s = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
    assert torch.all(w[(s <= t - 4) | (s > t)] == 0)                 # outside the window: nothing
    assert torch.all(w[(s > t - 4) & (s <= t)] > 0)
    small, large = (KVCache.for_model(model, 1, n).nbytes for n in (16, 64))
    assert small == large                                           # a ring of W slots whatever S_max


def test_gates_scale_the_attention_output():
    torch.manual_seed(0)
    for gate in ("headwise", "elementwise"):
        model = Transformer(_config(attn_gate=gate)).eval()
        attn = model.blocks[0].attn
        x = torch.randn(1, 5, 32)
        with torch.no_grad():
            attn.gate_proj.weight.zero_()                           # sigmoid(0) = 1/2 on every output
            gated, _ = attn(x, None, is_causal=True)
            attn.gate_proj = None
            plain, _ = attn(x, None, is_causal=True)
            bias = attn.o_proj.bias if attn.o_proj.bias is not None else 0
        torch.testing.assert_close(gated - bias, (plain - bias) / 2)
    assert Transformer(_config(attn_gate="headwise")).blocks[0].attn.gate_proj.weight.shape == (4, 32)


def test_sink_logit_takes_attention_from_every_key():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    _, plain = eager_attention(q, k, v, is_causal=True)
    _, sunk = eager_attention(q, k, v, is_causal=True, sinks=torch.tensor([0.0, 30.0]))
    torch.testing.assert_close(plain.sum(-1), torch.ones(1, 2, 4))
    assert torch.all(sunk[0, 0].sum(-1) < 1) and torch.all(sunk[0, 1].sum(-1) < 1e-6)   # 30: nearly all


def test_sinks_equal_gpt_oss_attention():
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    sinks = torch.randn(4)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, 2, False
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    theirs, _ = hf.eager_attention_forward(module, q, k, v, causal, scaling=8 ** -0.5)
    from logitlab.model.attention import repeat_kv
    ours, _ = eager_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True, sinks=sinks)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, atol=1e-6, rtol=1e-6)


def test_partial_rotary_turns_only_the_first_dimensions():
    from logitlab.model.rope import RotaryEmbedding, apply_rope

    rope = RotaryEmbedding(4, 16, 10000.0)                          # R = 4 of Dh = 16
    x = torch.randn(1, 6, 2, 16)
    y = apply_rope(x, *rope(torch.arange(6)[None]))
    torch.testing.assert_close(y[..., 4:], x[..., 4:])
    torch.testing.assert_close(y[:, 0], x[:, 0])                    # position 0: no turn
    assert not torch.allclose(y[:, 1:, :, :4], x[:, 1:, :, :4])
    with pytest.raises(ValueError, match="must be even"):
        _config(partial_rotary_factor=0.4)                          # int(8 * 0.4) = 3 dimensions
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        _config(partial_rotary_factor=0.0)


def test_partial_rotary_traces_as_one_graph():
    """torch.compile(fullgraph=True) of a partial rotation (`train --compile` of a Qwen3.5 model):
    the pass-through part is cast without a call dynamo cannot put in a graph (torch.result_type)."""
    from logitlab.model.rope import RotaryEmbedding, apply_rope

    rope = RotaryEmbedding(4, 16, 10000.0)
    x = torch.randn(1, 6, 2, 16)
    cos, sin = rope(torch.arange(6)[None])
    compiled = torch.compile(apply_rope, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, cos, sin), apply_rope(x, cos, sin), rtol=0, atol=0)


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="layer_types has 3 entries but n_layers is 4"):
        _config(layer_types=("full_attention",) * 2 + ("linear_attention",))
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        _config(layer_types=("sliding_attention",) * 4)
    with pytest.raises(ValueError, match="no layer is sliding_attention"):
        _config(sliding_window=8)
    with pytest.raises(ValueError, match="layer_types: expected a list of items each one of 'full_attention'"):
        _config(layer_types=("full_attention", "chunked", "full_attention", "full_attention"))
    with pytest.raises(ValueError, match="linear_n_v_heads \\(3\\) must be divisible"):
        _config(layer_types=("linear_attention",) * 4, linear_n_v_heads=3)
    assert _config(layer_types=("full_attention",) * 4).layer_types is None   # the default, stored as such


# --------------------------------------------------------------------------------------------
# Hugging Face parity
# --------------------------------------------------------------------------------------------

def _hf_qwen3_5(types, tied, seed=0, rope=None):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    extra = {} if rope is None else {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, **rope}}
    cfg = Qwen3_5TextConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=len(types),
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                            max_position_embeddings=128, tie_word_embeddings=tied, layer_types=list(types), **extra)
    model = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():                                           # norms and decays away from their init
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("types, tied", [
    (("linear_attention", "linear_attention", "linear_attention", "full_attention"), False),
    (("full_attention", "linear_attention", "full_attention"), True),
    (("linear_attention", "full_attention"), True),
])
def test_qwen3_5_loads_with_exact_logits_and_greedy_tokens(tmp_path, types, tied):
    from transformers import AutoModelForCausalLM

    from logitlab.io.hf import load_pretrained, save_pretrained

    theirs = _hf_qwen3_5(types, tied)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", verify=True).eval()
    assert ours.config.layer_kinds == types and ours.config.tie_embeddings == tied
    ids = torch.randint(0, 120, (2, 70))                            # two chunks of the chunked rule
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)
        prompt = ids[:1, :9]
        want = theirs.generate(prompt, max_new_tokens=12, do_sample=False)[0, 9:].tolist()
    assert generate(ours, prompt[0].tolist(), SampleConfig(max_new_tokens=12, temperature=0)).tokens[0] == want
    save_pretrained(ours, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 2.0},
])
def test_qwen3_5_rope_scaling_maps_both_ways_with_exact_logits(tmp_path, rope):
    """Qwen3.5's nested rope_parameters with a scaling (and its partial rotary factor): the same
    logits as transformers past the original length, and an export that transformers reads back."""
    from transformers import AutoModelForCausalLM

    from logitlab.io.hf import load_pretrained, save_pretrained

    theirs = _hf_qwen3_5(("linear_attention", "full_attention"), True, rope=rope)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert ours.config.rope_scaling.rope_type == rope["rope_type"] and ours.config.partial_rotary_factor == 0.25
    ids = torch.randint(0, 120, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)
    save_pretrained(ours, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.rope_parameters["rope_type"] == rope["rope_type"]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)


def test_text_part_of_an_image_text_checkpoint_loads(tmp_path):
    import json

    from safetensors.torch import save_file

    from logitlab.io.hf import load_pretrained

    theirs = _hf_qwen3_5(("linear_attention", "full_attention"), tied=False)
    text = json.loads(theirs.config.to_json_string())
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
             for k, v in theirs.state_dict().items()}
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)   # the vision tower: not loaded
    state["mtp.fc.weight"] = torch.zeros(4, 4)                       # the multi-token head: not loaded
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text}))
    save_file(state, tmp_path / "model.safetensors")
    ours = load_pretrained(tmp_path).eval()
    ids = torch.randint(0, 120, (1, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)


def test_mistral_sliding_window_loads_and_exports_exactly(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    from logitlab.io.hf import load_pretrained, save_pretrained

    torch.manual_seed(0)
    theirs = MistralForCausalLM(MistralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=5)).eval()
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", verify=True).eval()
    assert ours.config.layer_kinds == ("sliding_attention",) * 2 and ours.config.sliding_window == 5
    ids = torch.randint(0, 100, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)
        want = theirs.generate(ids[:1, :4], max_new_tokens=10, do_sample=False)[0, 4:].tolist()
    assert generate(ours, ids[0, :4].tolist(), SampleConfig(max_new_tokens=10, temperature=0)).tokens[0] == want
    save_pretrained(ours, tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.sliding_window == 5
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# StreamingLLM
# --------------------------------------------------------------------------------------------

def test_streaming_generation_runs_past_the_context_with_bounded_memory():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, context_length=32, d_model=32, n_layers=2, n_heads=4, norm="rmsnorm",
                      mlp="swiglu", positions="rope", bias=False)
    model = Transformer(cfg).eval()
    prompt = [1, 2, 3, 4, 5]
    greedy = SampleConfig(max_new_tokens=20, temperature=0)
    # before anything is evicted it is the ordinary cache
    assert generate(model, prompt, greedy, streaming=(4, 24)).tokens == generate(model, prompt, greedy).tokens
    long = generate(model, prompt, SampleConfig(max_new_tokens=90, temperature=0), streaming=(4, 12))
    assert len(long.tokens[0]) == 90 and long.stop_reasons == ["max_new_tokens"]   # 95 > context 32
    cache = KVCache.for_model(model, 1, stream=(4, 12))
    with torch.no_grad():
        for t in range(40):
            model(torch.tensor([[t % 50]]), cache=cache)
            assert cache.length == min(t + 1, 16)
    assert cache.seen == 40 and cache.k[0].shape[2] == 16
    with pytest.raises(ValueError, match="one length"):
        generate(model, [[1, 2], [3]], greedy, streaming=(4, 12))
    # a step reads sink + window cached positions and the new one: all must fit the context
    long = generate(model, prompt, SampleConfig(max_new_tokens=40, temperature=0), streaming=(4, 27))
    assert len(long.tokens[0]) == 40
    with pytest.raises(ValueError, match=r"sink \+ window \(32\) must be less than the model's context_length"):
        generate(model, prompt, greedy, streaming=(4, 28))


def test_streaming_keys_are_rotated_at_their_slot_in_the_cache():
    """After eviction the next query sees key j at position j of the cache: the logits equal an
    attention written out by hand over the kept raw keys, rotated at 0 .. S-1."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=30, context_length=16, d_model=16, n_layers=1, n_heads=2, norm="rmsnorm",
                      mlp="swiglu", positions="rope", bias=False)
    model = Transformer(cfg).eval()
    cache = KVCache.for_model(model, 1, stream=(2, 3))
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6, 7, 8, 9]]), cache=cache)  # 7 positions, 5 kept
        raw_k, raw_v = cache.k[0].clone(), cache.v[0].clone()
        token = torch.tensor([[11]])
        got = model(token, cache=cache)
        block = model.blocks[0]
        x = model.tok_emb(token)
        q, k, v = block.attn._project(block.attn_norm(x), None)
        k_all, v_all = torch.cat((raw_k, k), 2), torch.cat((raw_v, v), 2)
        from logitlab.model.rope import apply_rope
        cos, sin = model.rope(torch.arange(6)[None])
        q = apply_rope(q.transpose(1, 2), cos[:, 5:], sin[:, 5:]).transpose(1, 2)
        k_all = apply_rope(k_all.transpose(1, 2), cos, sin).transpose(1, 2)
        out, _ = eager_attention(q, k_all, v_all)
        h = x + block.attn.o_proj(out.transpose(1, 2).reshape(1, 1, 16))
        h = h + block.mlp(block.mlp_norm(h))
        torch.testing.assert_close(got, model.unembed(h), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Families and accounting
# --------------------------------------------------------------------------------------------

def test_qwen3_5_presets_count_the_published_shares():
    small, nine = acc.count_parameters(get_preset("qwen3.5-0.8b")), acc.count_parameters(get_preset("qwen3.5-9b"))
    assert small.tied and small.embeddings == 248320 * 1024 == 254_279_680
    assert 0.32 < small.embeddings / small.total < 0.35                 # the tied V x D table: about a third
    assert not nine.tied and nine.lm_head == 248320 * 4096 == 1_017_118_720
    assert 0.11 < nine.lm_head / nine.total < 0.12                      # the untied head: about 11%
    assert 0.22 < (nine.lm_head + nine.embeddings) / nine.total < 0.23  # with the embedding: about 22%
    assert small.n_linear_layers == 18 and small.linear_items == {
        "in_proj_qkv": 1024 * (2 * 16 * 128 + 16 * 128), "in_proj_z": 1024 * 16 * 128, "in_proj_b": 1024 * 16,
        "in_proj_a": 1024 * 16, "conv1d": (2 * 16 * 128 + 16 * 128) * 4, "dt_bias": 16, "A_log": 16,
        "norm": 128, "out_proj": 16 * 128 * 1024}


def test_hybrid_cache_holds_a_fixed_state_and_flops_count_it():
    cfg = get_preset("qwen3.5-0.8b")
    kv = acc.kv_cache_bytes(cfg, "bf16", tokens=32768)
    assert kv["per_token"] == 6 * 2 * 2 * 256 * 2                      # 6 full layers, Hkv 2, Dh 256, bf16
    assert kv["fixed"] == 18 * (16 * 128 * 128 * 4 + (2 * 16 * 128 + 16 * 128) * 3 * 2)
    assert kv["total"] < kv["full_attention_equivalent"] / 3
    flops = acc.flops_per_token(cfg, 4096)
    assert flops["linear_state"] == 6 * 16 * 128 * 128 * 18
    assert flops["attention"] == 6 * 4 * 2048 * 8 * 256                # only the 6 attention layers see T
    built = Transformer(get_preset("qwen3.5-tiny"))
    cache = KVCache.for_model(built, 1, 256)
    kv_tiny = acc.kv_cache_bytes(built.config, "fp32", tokens=256)
    assert cache.nbytes == kv_tiny["total"]


def test_qwen3_5_preset_configs_round_trip_through_hugging_face():
    from transformers import Qwen3_5TextConfig

    from logitlab.model.families import config_from_hf, config_to_hf

    for name in ("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-tiny"):
        cfg = get_preset(name)
        hf = config_to_hf(cfg)
        assert config_from_hf(hf) == dataclasses.replace(cfg, vocab_pad_multiple=1, init_std=cfg.init_std)
        theirs = Qwen3_5TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
        assert theirs.layer_types == list(cfg.layer_kinds)


def test_a_tiny_hybrid_trains():
    torch.manual_seed(0)
    model = Transformer(get_preset("qwen3.5-tiny", context_length=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 64, (4, 33))
    losses = []
    for _ in range(15):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


# --------------------------------------------------------------------------------------------
# Seeing inside
# --------------------------------------------------------------------------------------------

def test_sink_shares_and_the_linear_trace():
    from logitlab.inspect import linear_trace, sink_shares

    torch.manual_seed(0)
    model = Transformer(_config(layer_types=("linear_attention", "full_attention") * 2, attn_gate="elementwise"))
    model.eval()
    ids = list(range(1, 13))
    shares = sink_shares(model, ids, k=3)
    assert [s.layer for s in shares] == [1, 3]                     # attention layers only
    with torch.no_grad():
        _, weights = model.forward_with_attention(torch.tensor([ids]))
    w = weights[1][0]
    torch.testing.assert_close(torch.tensor(shares[0].first), w[:, 1:, 0].mean(1))
    assert all(0 < a <= b <= 1 for a, b in zip(shares[0].first, shares[0].first_k))
    traces = linear_trace(model, ids)
    assert [t.layer for t in traces] == [0, 2]
    trace = traces[0]
    assert len(trace.decay) == 12 and len(trace.decay[0]) == 4     # T positions x Hv heads
    assert all(0 < a <= 1 for row in trace.decay for a in row) and all(0 < b < 1 for row in trace.beta for b in row)
    # the state norm after the last position is the norm of the rule's final state
    layer = model.blocks[0].linear_attn
    records: list = []
    with torch.no_grad():
        model._run(torch.tensor([ids]), None, None, None, records=records)
    r = records[0]
    _, final = gated_delta_rule_reference(r["q"], r["k"], r["v"], r["g"], r["beta"])
    assert layer is not None
    torch.testing.assert_close(torch.tensor(trace.state_norm[-1]), final[0].flatten(1).norm(dim=-1))
    with pytest.raises(ValueError, match="k \\(12\\) must be smaller"):
        sink_shares(model, ids, k=12)


def test_inspect_shows_sinks_and_the_linear_state(tmp_path, capsys):
    import json

    from logitlab.cli.main import main
    from logitlab.io.model_dir import TOKENIZER_FILE, save_model
    from logitlab.tokenizer.bpe import train_tokenizer

    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    tok = train_tokenizer(tmp_path / "a.txt", 280, ["<|endoftext|>"], workers=1)
    torch.manual_seed(0)
    cfg = _config(vocab_size=tok.vocab_size, layer_types=("linear_attention", "full_attention") * 2,
                  attn_gate="elementwise")
    save_model(Transformer(cfg), tmp_path / "m")
    tok.save(tmp_path / "m" / TOKENIZER_FILE)
    text = "def f(x):\\n    return x"
    assert main(["inspect", str(tmp_path / "m"), text, "--sinks", "2", "--linear"]) == 0
    out = capsys.readouterr().out
    assert "on positions 0..1" in out and "Gated DeltaNet layer 0" in out and "decay exp(g)" in out
    assert main(["inspect", str(tmp_path / "m"), text, "--sinks", "--linear", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["layer"] for s in report["sinks"]] == [1, 3] and report["sinks"][0]["k"] == 4
    assert [t["layer"] for t in report["linear"]] == [0, 2]
    plain = _config(vocab_size=tok.vocab_size)
    save_model(Transformer(plain), tmp_path / "p")
    tok.save(tmp_path / "p" / TOKENIZER_FILE)
    assert main(["inspect", str(tmp_path / "p"), text, "--linear"]) == 2
    assert "no Gated DeltaNet" in capsys.readouterr().err
