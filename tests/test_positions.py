"""Position schemes: sinusoidal and ALiBi (with SDPA, the KV cache and sliding windows), RoPE's
two layouts as a permutation of q/k rows, and every RoPE scaling kind against transformers (its
ROPE_INIT_FUNCTIONS, then tiny Llama and Qwen3 models, logits within 1e-5, including dynamic NTK in
cached decoding). No downloads: every model is random and tiny."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from logitlab.model import KVCache, ModelConfig, RopeScaling, Transformer
from logitlab.model import rope_scaling as rs
from logitlab.model.hf_config import config_from_hf, config_to_hf
from logitlab.model.positions import (
    ALiBi,
    SinusoidalPositions,
    alibi_slopes,
    convert_rope_layout,
    rope_layout_permutation,
    sinusoidal_table,
)
from logitlab.model.rope import RotaryEmbedding, apply_rope

TINY = dict(vocab_size=61, context_length=48, d_model=32, n_layers=2, n_heads=4)
LLAMA = dict(norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)


def _ids(T=20, B=2, V=61, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **kw})).eval()


# ------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------

def test_old_rope_scaling_json_reads_as_llama3_and_every_kind_round_trips():
    old = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 8192}
    cfg = ModelConfig.from_dict({**ModelConfig(positions="rope").to_dict(), "rope_scaling": old})
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    kinds = [dict(rope_type="linear", factor=2.0), dict(rope_type="ntk", factor=4.0),
             dict(rope_type="dynamic", factor=2.0, original_context_length=16),
             dict(rope_type="yarn", factor=4.0, original_context_length=16, mscale=0.707, mscale_all_dim=0.707),
             dict(rope_type="longrope", factor=4.0, original_context_length=16, short_factor=[1.0] * 4,
                  long_factor=[1.0, 2.0, 3.0, 4.0])]
    for kind in kinds:
        c = ModelConfig(**TINY, positions="rope", rope_scaling=kind)
        assert ModelConfig.from_dict(c.to_dict()) == c
    yarn = ModelConfig(**TINY, positions="rope", rope_scaling=kinds[3]).rope_scaling
    assert (yarn.beta_fast, yarn.beta_slow, yarn.truncate, yarn.low_freq_factor) == (32.0, 1.0, True, None)


@pytest.mark.parametrize("kw, message", [
    (dict(rope_scaling=dict(rope_type="linear", factor=2.0, beta_fast=8.0)),
     r"rope_scaling.beta_fast=8.0 is not read by rope_type='linear'"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope_type='yarn' needs original_context_length"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0, original_context_length=8, beta_fast=0.5)),
     "0 < beta_slow <= beta_fast"),
    (dict(rope_scaling=dict(rope_type="su", factor=2.0)), "rope_scaling.rope_type must be one of"),
    (dict(rope_scaling=dict(rope_type="longrope", original_context_length=8, short_factor=[1.0] * 3,
                            long_factor=[1.0] * 3)), r"need rotary_dim / 2 = 4 entries, got 3"),
    (dict(positions="learned", rope_interleaved=True), "rope_interleaved=True needs positions='rope'"),
])
def test_bad_position_config_is_named(kw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, "positions": "rope", **kw})


# ------------------------------------------------------------------------------------------
# sinusoidal and ALiBi
# ------------------------------------------------------------------------------------------

def test_sinusoidal_table_formula_no_state_key_and_exact_in_bf16():
    table = sinusoidal_table(10, 8)
    p, i = 7, 2
    assert table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 8)), abs=1e-6)
    assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 8)), abs=1e-6)
    model = _model(positions="sinusoidal")
    assert not any("pos" in k for k in model.state_dict())
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert torch.equal(bf16.pos_emb.table, sinusoidal_table(48, 32).to(torch.bfloat16))
    assert torch.equal(bf16.float().pos_emb.table, sinusoidal_table(48, 32))     # recomputed, not rounded
    with torch.device("meta"):
        meta = Transformer(model.config)
    meta.load_state_dict(model.state_dict(), assign=True)
    meta.rebuild_buffers()
    assert torch.equal(meta(_ids()), model(_ids()))


def test_untabled_sinusoidal_rows_are_the_table_rows_in_every_dtype():
    """Past rope.TABLE_VALUES the table is not stored: each call computes its rows from the
    positions, the table's values bit for bit, in the model's dtype after a cast and a move."""
    tabled, computed = SinusoidalPositions(48, 32), SinusoidalPositions(48, 32, table_values=0)
    assert tabled.tabled and not computed.tabled and not hasattr(computed, "table")
    positions = torch.tensor([[0, 5, 47, 3], [46, 1, 2, 9]])
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        tabled, computed = tabled.to(dtype), computed.to(dtype)
        out = computed(positions)
        assert out.dtype == dtype and torch.equal(out, tabled(positions))
    computed.half().to("cpu")                                   # a move keeps the dtype
    assert computed(positions).dtype == torch.float16


def test_a_huge_context_costs_nothing_until_used():
    """A config that claims 2**24 positions (the bound) builds at once on the CPU: RoPE's and the
    sinusoidal tables would be 1-2 GiB, and no buffer grows with the context; the positions a call
    uses still give the values the formula does. Run under an address-space cap."""
    from _bounded import last_line, run_bounded

    code = """
import sys, torch
from logitlab.model import ModelConfig, Transformer
for positions in ("rope", "sinusoidal"):
    cfg = ModelConfig(vocab_size=61, context_length=2**24, d_model=32, n_layers=1, n_heads=2, positions=positions,
                      rope_scaling=dict(rope_type="yarn", factor=4.0, original_context_length=2**22)
                      if positions == "rope" else None)
    model = Transformer(cfg)
    assert sum(b.numel() for b in model.buffers()) < 1000, [(n, b.shape) for n, b in model.named_buffers()]
    ids, pos = torch.tensor([[3, 4]]), torch.tensor([[0, 2**24 - 1]])
    assert model(ids, positions=pos).isfinite().all()
    if positions == "sinusoidal":
        angle = (2**24 - 1) * 10000.0 ** (-torch.arange(0, 32, 2).float() / 32)
        assert torch.allclose(model.pos_emb(pos)[0, 1, 0::2], angle.sin(), atol=1e-6)
print("ok")
"""
    proc = run_bounded(code, limit=3 * 2**30)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", last_line(proc)


def test_alibi_slopes_follow_press_et_al():
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    six = alibi_slopes(6)                          # 4 geometric ones, then every other of 8
    expected = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    assert torch.allclose(six, torch.tensor(expected))
    bias = ALiBi(2).bias(torch.arange(3), torch.arange(3), is_causal=True)        # (1, H, T, S)
    assert bias.shape == (1, 2, 3, 3) and bias[0, 0, 2, 0] == -2 * 2 ** -4 and bias[0, 1, 1, 0] == -(2 ** -8)
    assert torch.isinf(bias[0, :, 0, 1]).all()


def test_alibi_model_sdpa_eager_cache_and_padding_agree():
    model = _model(positions="alibi")
    ids = _ids(20)
    full = model(ids)
    model.attn_impl = "eager"
    assert (model(ids) - full).abs().max() < 1e-5
    model.attn_impl = "sdpa"
    cache = KVCache.for_model(model, batch_size=2, max_len=20)
    steps = [model(ids[:, :12], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(12, 20)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5
    # left padding: row 0 padded by 3 slots sees the same distances as alone
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids[:1, :17]), dim=1)
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[:, :3] = False
    alone = model(ids[:1, :17])
    assert (model(padded, attn_mask=mask)[:, 3:] - alone).abs().max() < 1e-5
    weights = model.forward_with_attention(ids)[1][0]                             # (B, H, T, S)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 20)) and (weights.triu(1) == 0).all()


def test_alibi_with_sliding_windows_decodes_as_the_full_forward():
    model = _model(positions="alibi", layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    ids = _ids(16)
    full = model(ids)
    cache = KVCache.for_model(model, batch_size=2, max_len=16)
    steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(6, 16)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5


def test_alibi_bias_is_what_the_logits_see():
    """One head, keys equal: the eager weights are softmax(-m * distance) exactly."""
    attn = _model(positions="alibi", n_layers=1).blocks[0].attn
    bias = attn.alibi.bias(torch.arange(4), torch.arange(4), is_causal=True)
    m = alibi_slopes(4)
    expected = torch.softmax(-m[:, None] * torch.tensor([3.0, 2.0, 1.0, 0.0]), dim=-1)     # last query row
    assert torch.allclose(torch.softmax(bias[0, :, 3], dim=-1), expected)


# ------------------------------------------------------------------------------------------
# RoPE layouts
# ------------------------------------------------------------------------------------------

def test_interleaved_rope_is_pairwise_complex_rotation():
    Dh, T = 8, 5
    rope = RotaryEmbedding(Dh, 16, 10000.0, interleaved=True)
    x = torch.randn(1, T, 2, Dh)
    out = apply_rope(x, *rope(torch.arange(T)[None]), interleaved=True)
    freqs = 10000.0 ** (-torch.arange(0, Dh, 2).float() / Dh)
    turn = torch.polar(torch.ones(T, Dh // 2), torch.arange(T).float()[:, None] * freqs)          # (T, Dh/2)
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn[None, :, None])
    assert torch.allclose(out, expected.flatten(-2), atol=1e-6)


@pytest.mark.parametrize("kw", [{}, dict(qk_norm=True, n_kv_heads=2, qkv_bias=True), dict(partial_rotary_factor=0.5)])
def test_layout_conversion_is_a_permutation_of_q_k_rows(kw):
    meta = _model(positions="rope", rope_interleaved=True, **LLAMA, **kw)
    with torch.no_grad():
        for p in meta.parameters():
            p.add_(0.1 * torch.randn_like(p))                      # norm weights matter too
    state, config = convert_rope_layout(meta.state_dict(), meta.config, to="half")
    assert not config.rope_interleaved
    half = Transformer(config).eval()
    half.load_state_dict(state)
    ids = _ids()
    assert (half(ids) - meta(ids)).abs().max() < 1e-5
    unpermuted = Transformer(config).eval()
    unpermuted.load_state_dict(meta.state_dict())                  # the same rows, the wrong layout
    assert (unpermuted(ids) - meta(ids)).abs().max() > 1e-3
    back, _ = convert_rope_layout(state, config, to="interleaved")
    assert all(torch.equal(back[k], v) for k, v in meta.state_dict().items())
    perm = rope_layout_permutation(8, 4, to="half")
    assert perm.tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    if not kw:                                                     # a Llama: written only once converted
        with pytest.raises(ValueError, match="convert_rope_layout"):
            config_to_hf(meta.config)
        assert config_to_hf(config)["architectures"] == ["LlamaForCausalLM"]


# ------------------------------------------------------------------------------------------
# RoPE scaling against transformers
# ------------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HF_SMALL = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
                      "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                 "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]},
}


def _hf_config(kind: str, arch="llama", max_pos=64, **kw):
    cls = transformers.Qwen3Config if arch == "qwen3" else transformers.LlamaConfig
    extra = dict(head_dim=16) if arch == "qwen3" else {}
    max_pos = 16 if kind == "dynamic" else max_pos
    return cls(**HF_SMALL, **extra, max_position_embeddings=max_pos, rope_theta=500.0,
               rope_scaling=copy.deepcopy(SCALINGS[kind]), **kw)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 12, 40])
def test_inverse_frequencies_match_rope_init_functions(kind, seq_len):
    hf = _hf_config(kind)
    ours = config_from_hf(hf.to_dict())
    assert ours.rope_scaling.rope_type == SCALINGS[kind]["rope_type"]
    theirs, their_scale = ROPE_INIT_FUNCTIONS[SCALINGS[kind]["rope_type"]](hf, "cpu", seq_len=seq_len)
    inv, scale = rs.rope_frequencies(ours.rotary_dim, ours.rope_theta, ours.rope_scaling, seq_len)
    assert torch.allclose(inv, theirs, rtol=1e-6, atol=0) and scale == pytest.approx(their_scale, rel=1e-12)


def _pair(kind: str, arch="llama"):
    """A random transformers model with this rope_scaling and the same weights in logitlab."""
    from logitlab.model.keymap import state_dict_from_hf

    torch.manual_seed(0)
    hf = _hf_config(kind, arch)
    hf._attn_implementation = "eager"
    theirs = transformers.AutoModelForCausalLM.from_config(hf).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ours = Transformer(config_from_hf(hf.to_dict())).eval()
    ours.load_state_dict(state_dict_from_hf(theirs.state_dict(), ours.config))
    return ours, theirs


@pytest.mark.parametrize("kind, arch", [(k, "llama") for k in sorted(SCALINGS)] + [("yarn", "qwen3"),
                                                                                     ("dynamic", "qwen3")])
def test_logits_match_transformers_below_and_above_the_original_length(kind, arch):
    ours, theirs = _pair(kind, arch)
    for T in (12, 30):                                             # original length 16
        ids = _ids(T)
        with torch.no_grad():
            fresh = copy.deepcopy(theirs)                          # dynamic NTK keeps state between calls
            assert (ours(ids) - fresh(input_ids=ids).logits).abs().max() < 1e-5, T


@pytest.mark.parametrize("kind", ["none", "yarn", "dynamic", "longrope"])   # static kinds share one path
def test_untabled_rope_computes_the_table_values_bit_for_bit(kind):
    """A RoPE whose table would pass rope.TABLE_VALUES computes each call's rows from the positions:
    the same cos/sin bit for bit (below and above a scaling's original length), so the same logits
    in one forward and in cached decoding."""
    hf = _hf_config(kind if kind != "none" else "linear").to_dict() | ({"rope_scaling": None} if kind == "none" else {})
    ours = Transformer(config_from_hf(hf)).eval()
    c = ours.config
    computed = copy.deepcopy(ours)
    computed.rope = RotaryEmbedding(c.rotary_dim, c.context_length, c.rope_theta, c.rope_scaling, table_values=0)
    assert ours.rope.tabled and not computed.rope.tabled and not hasattr(computed.rope, "cos")
    positions = torch.tensor([[0, 3, 15, 16, 17, c.context_length - 1]])
    for a, b in zip(ours.rope(positions), computed.rope(positions)):
        assert torch.equal(a, b)
    ids = _ids(24)
    with torch.no_grad():
        assert torch.equal(ours(ids), computed(ids))
        for model in (ours, computed):
            cache = KVCache.for_model(model, batch_size=2, max_len=24)
            model(ids[:, :14], cache=cache)                        # decoding crosses the original length 16
            model.decoded = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(14, 24)], dim=1)
    assert torch.equal(ours.decoded, computed.decoded)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_run_time_kinds_match_transformers_in_cached_decoding(kind):
    """Prefill 10 tokens, decode one at a time to 30: the tables grow with the sequence past the
    original length 16, and keys cached under an older base keep their rotation on both sides."""
    ours, theirs = _pair(kind)
    ids = _ids(30)
    cache = KVCache.for_model(ours, batch_size=2, max_len=30)
    with torch.no_grad():
        out = theirs(input_ids=ids[:, :10], use_cache=True)
        past, ref = out.past_key_values, [out.logits]
        got = [ours(ids[:, :10], cache=cache)]
        for t in range(10, 30):
            out = theirs(input_ids=ids[:, t:t + 1], cache=past, use_cache=True)
            past = out.past_key_values
            ref.append(out.logits)
            got.append(ours(ids[:, t:t + 1], cache=cache))
    assert (torch.cat(got, 1) - torch.cat(ref, 1)).abs().max() < 1e-5
    if kind == "dynamic":   # and that differs from one forward over all 30 (the base of step 30 everywhere)
        assert (torch.cat(got, 1)[:, 16:] - ours(ids)[:, 16:]).abs().max() > 1e-4


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_hf_config_round_trip_keeps_the_scaling(kind):
    ours = config_from_hf(_hf_config(kind).to_dict())
    again = config_from_hf(config_to_hf(ours))
    assert again.rope_scaling == ours.rope_scaling and again.context_length == ours.context_length
    if kind == "dynamic":                                          # accepted to original x factor
        assert ours.context_length == 32 and ours.rope_scaling.original_context_length == 16


def test_static_ntk_exports_as_the_equivalent_base():
    cfg = ModelConfig(**TINY, **LLAMA, n_kv_heads=2, positions="rope", rope_theta=500.0,
                      rope_scaling=dict(rope_type="ntk", factor=4.0))
    hf = config_to_hf(cfg)
    assert hf["rope_scaling"] is None and hf["rope_theta"] == pytest.approx(500.0 * 4.0 ** (8 / 6))
    plain = dataclasses.replace(cfg, rope_scaling=None, rope_theta=hf["rope_theta"])
    assert torch.equal(Transformer(cfg).rope.cos, Transformer(plain).rope.cos)
    with pytest.raises(ValueError, match="unsupported feature rope_scaling.rope_type='proportional'"):
        config_from_hf({**config_to_hf(cfg), "rope_scaling": {"rope_type": "proportional", "factor": 2.0}})


def test_extrapolation_bench_runs_every_scheme_and_scaling(tmp_path):
    from bench import extrapolation

    result = extrapolation.run(steps=2, T=8, lengths=[8, 16], data=tmp_path / "absent.txt",
                               schemes=("learned", "rope", "alibi"), eval_tokens=64, finetune=2)
    rows = {(r["positions"], r["scaling"]): r["ppl"] for r in result["rows"]}
    tuned = {("rope", f"{kind} + 2 steps at 16") for kind in ("linear", "yarn")}
    assert set(rows) == {("learned", "none"), ("alibi", "none")} | {("rope", s) for s in extrapolation.ROPE_SCALINGS} \
        | tuned
    assert rows[("learned", "none")][16] is None and 1 < rows[("learned", "none")][8] < 256
    assert all(v is not None and 1 < v < 1000 for k, ppl in rows.items() if k[0] != "learned" for v in ppl.values())
    assert rows[("rope", "none")][8] == rows[("rope", "yarn")][8]            # no scaling at the trained length
    assert "| rope | yarn |" in extrapolation.render(result)


def test_long_context_bench_measures_both_impls_and_predicts_the_crossover():
    from bench import long_context

    result = long_context.run([16, 32], repeats=1, memory=False)   # memory: child processes, below in-process
    assert [(r["T"], r["impl"]) for r in result["rows"]] == [(16, "sdpa"), (16, "eager"), (32, "sdpa"), (32, "eager")]
    assert all(r["forward_tok_s"] > 0 and r["train_tok_s"] > 0 for r in result["rows"])
    assert long_context.peak_rise_mib(32, "eager") >= 0
    shares = [r["attention_flop_share"] for r in result["rows"] if r["impl"] == "sdpa"]
    assert 0 < shares[0] < shares[1] < 1                            # the quadratic term's share grows with T
    # D = 256, F = 768, H * Dh = 256: attention's 2 T H Dh per layer equals the MLP's 6 D F at T = 3 D F / (H Dh) = 2304
    assert result["predicted"]["attention_equals_mlp"] == 2304
    assert "FLOP model: attention overtakes the MLP at T = 2304" in long_context.render(result)


def test_passkey_examples_hide_the_key_at_the_depth_and_score_it(tmp_path):
    from bench import passkey

    hay = torch.tensor(list(b"abcdefghij" * 20))
    g = torch.Generator().manual_seed(0)
    ids, key = passkey.example(hay, 64, 0.0, g)
    text = bytes(ids.tolist())
    digits = bytes(key.tolist())
    assert len(ids) == 64 and text.startswith(b" pass key #" + digits + b".") and text.endswith(b"? #" + digits)
    deep = bytes(passkey.example(hay, 64, 1.0, g)[0].tolist())
    assert deep.index(b" pass key #") == 64 - 17 - 17                       # just before the question
    assert deep.count(b"#") == 2                                            # the marker: needle and question only
    with pytest.raises(ValueError, match="at least 34 bytes"):
        passkey.example(hay, 20, 0.5, g)
    filler = bytes(passkey.repeated_filler(300).tolist())
    assert filler.startswith(passkey.FILLER) and len(filler) == 300 and b"#" not in filler
    result = passkey.run(steps=2, T=40, lengths=[40, 80], schemes=("rope",), n=2)
    assert result["filler"] == "repeated"
    assert [(r["positions"], r["scaling"]) for r in result["rows"]] == [("rope", "none"), ("rope", "yarn")]
    assert all(0 <= whole <= digit <= 1 for r in result["rows"] for acc in r["accuracy"].values()
               for whole, digit in acc)
    assert "length \\ depth" in passkey.render(result)
    passkey.heat_map(result, tmp_path / "pk.png")
    assert (tmp_path / "pk.png").read_bytes()[:4] == b"\x89PNG"
    text_result = passkey.run(steps=1, T=40, lengths=[40], schemes=("alibi",), n=1, data=tmp_path / "absent",
                              filler="text")
    assert text_result["filler"] == "text" and len(text_result["rows"]) == 1


@pytest.mark.slow
def test_long_context_demo_quick_runs_every_step(tmp_path, capsys):
    from bench import long_context_demo

    long_context_demo.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| rope | yarn |" in out and "| learned | none | " in out and "| rope-ft-yarn | none |" in out
    for name in ("rope", "schemes", "finetune", "curves"):
        assert (tmp_path / f"long-context-{name}.png").read_bytes()[:4] == b"\x89PNG"
    run = json.loads((tmp_path / "rope-ft-yarn" / "run.json").read_text())
    assert run["model"]["context_length"] == 1024 and run["model"]["rope_scaling"]["rope_type"] == "yarn"
