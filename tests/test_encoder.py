"""Encoder against decoder: ModelConfig.attention, the bidirectional mask in both attention paths,
the masked-LM objective (train.loss.mlm_mask), and the refusals (KV cache, generation, HF export)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from logitlab.generate import generate, stream
from logitlab.model.cache import KVCache
from logitlab.model.config import ModelConfig
from logitlab.model.families import config_to_hf
from logitlab.model.transformer import Transformer
from logitlab.train.loss import IGNORE_INDEX, cross_entropy, mlm_loss, mlm_mask

V = 29


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, context_length=16, d_model=32, n_layers=2, n_heads=4)
    return ModelConfig(**{**base, **kw})


def build(attention: str, **kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny(attention=attention, **kw)).eval()


ROPE = dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2)


# --- the field ------------------------------------------------------------------------------

def test_default_is_causal_and_round_trips_through_json():
    assert ModelConfig().attention == "causal"
    cfg = tiny(attention="bidirectional")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in tiny().to_dict().items() if k != "attention"}   # a config from before the field
    assert ModelConfig.from_dict(old).attention == "causal"


@pytest.mark.parametrize("kw, words", [
    (dict(attention="encoder"), "attention must be one of ('causal', 'bidirectional'), got 'encoder'"),
    (dict(attention=True), "attention must be one of"),
    (dict(attention="bidirectional", layer_types=("full_attention", "sliding_attention"), sliding_window=4),
     "needs every layer to be full_attention, but layer_types has sliding_attention"),
    (dict(attention="bidirectional", layer_types=("linear_attention", "full_attention")),
     "layer_types has linear_attention"),
    (dict(attention="bidirectional", positions="alibi"), "does not support positions='alibi'"),
])
def test_invalid_attention_configs_are_refused_by_name(kw, words):
    with pytest.raises(ValueError) as err:
        tiny(**kw)
    assert words in str(err.value)


# --- the mask -------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, ROPE], ids=["gpt2", "rope-gqa"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_bidirectional_output_depends_on_later_tokens_and_causal_does_not(impl, extra):
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))
    later = ids.clone()
    later[:, 7] = (later[:, 7] + 1) % V                            # change one later token
    for attention in ("causal", "bidirectional"):
        model = build(attention, **extra)
        model.attn_impl = impl
        with torch.no_grad():
            a, b = model(ids), model(later)                        # (B, T, V)
        change = (a[:, :7] - b[:, :7]).abs().amax(dim=-1)          # (B, 7): every position before 7
        if attention == "causal":
            assert torch.equal(a[:, :7], b[:, :7])
        else:
            assert bool((change > 1e-6).all()), change


def test_sdpa_and_eager_agree_for_the_encoder_with_and_without_padding():
    model = build("bidirectional", **ROPE)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :3] = False                                            # row 1 left-padded
    with torch.no_grad():
        for attn_mask in (None, keep):
            model.attn_impl = "sdpa"
            fast = model(ids, attn_mask=attn_mask)
            model.attn_impl = "eager"
            slow = model(ids, attn_mask=attn_mask)
            torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_encoder_weights_are_all_ones_and_padding_still_masks_keys():
    model = build("bidirectional")
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(3))
    keep = torch.tensor([[False, False, True, True, True]])
    with torch.no_grad():
        _, full = model.forward_with_attention(ids)                # L tensors (B, H, T, S)
        _, padded = model.forward_with_attention(ids, attn_mask=keep)
    assert all(bool((w > 0).all()) for w in full)
    for w in padded:
        real = w[0, :, 2:]                                         # (H, 3, S): the real queries
        assert bool((real[..., :2] == 0).all()) and bool((real[..., 2:] > 0).all())
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    # a padded row gives the real positions the same outputs as the unpadded sequence
    with torch.no_grad():
        short = model(ids[:, 2:], positions=torch.arange(3))
        long = model(ids, attn_mask=keep, positions=torch.tensor([[0, 0, 0, 1, 2]]))
    torch.testing.assert_close(short, long[:, 2:], atol=1e-5, rtol=1e-5)


def test_an_encoders_attention_ignores_is_causal_from_callers_that_run_blocks_themselves():
    # the pipeline stages and other callers of Block pass is_causal=True for plain attention
    block = build("bidirectional").blocks[0]
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        told, _ = block(x, None, is_causal=True)
        plain, _ = block(x, None, is_causal=False)
        causal, _ = build("causal").blocks[0](x, None, is_causal=True)
    torch.testing.assert_close(told, plain)
    assert not torch.allclose(told[:, 0], causal[:, 0])


def test_state_dicts_are_identical_so_weights_load_both_ways():
    causal, encoder = build("causal", **ROPE), build("bidirectional", **ROPE)
    a, b = causal.state_dict(), encoder.state_dict()
    assert list(a) == list(b) and all(a[k].shape == b[k].shape for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)                 # same seed, same init
    torch.manual_seed(5)
    other = Transformer(tiny(attention="bidirectional", **ROPE)).eval()
    causal.load_state_dict(other.state_dict())                     # encoder -> decoder
    encoder.load_state_dict(causal.state_dict())                   # and back
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(encoder(ids), other(ids))
        assert not torch.allclose(causal(ids), encoder(ids))
    # one layer: the last query reads every key under both masks, so there the two agree
    one = [build(a, n_layers=1, **ROPE) for a in ("causal", "bidirectional")]
    one[1].load_state_dict(one[0].state_dict())
    with torch.no_grad():
        torch.testing.assert_close(one[0](ids)[:, -1], one[1](ids)[:, -1], atol=1e-5, rtol=1e-5)


# --- refusals -------------------------------------------------------------------------------

def test_kv_cache_is_refused_for_the_encoder():
    model = build("bidirectional")
    cache = KVCache.for_model(model, batch_size=1, max_len=8)
    with pytest.raises(ValueError, match="KV cache needs causal attention.*attention='bidirectional'"):
        model(torch.tensor([[1, 2, 3]]), cache=cache)


def test_generation_refuses_an_encoder_naming_the_field():
    model = build("bidirectional")
    for run in (lambda: generate(model, [1, 2, 3]), lambda: generate(model, [1, 2], use_cache=False),
                lambda: stream(model, [1, 2, 3])):
        with pytest.raises(ValueError, match=r"attention='bidirectional'"):
            run()
    assert len(generate(build("causal"), [1, 2, 3]).tokens[0]) > 0   # the decoder still generates


def test_hugging_face_export_refuses_an_encoder_and_writes_nothing(tmp_path):
    from logitlab.io.hf import save_pretrained

    for extra in ({}, dict(ROPE, bias=False, tie_embeddings=False)):
        assert config_to_hf(tiny(**extra))                         # the causal twin exports
        with pytest.raises(ValueError, match="attention='bidirectional' cannot be exported"):
            config_to_hf(tiny(attention="bidirectional", **extra))
    with pytest.raises(ValueError, match="attention='bidirectional'"):
        save_pretrained(build("bidirectional"), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_a_logitlab_model_directory_keeps_the_field(tmp_path):
    from logitlab.io.model_dir import read_model_config, save_model

    save_model(build("bidirectional"), tmp_path / "m")
    assert read_model_config(tmp_path / "m").attention == "bidirectional"


# --- the masked-LM objective ----------------------------------------------------------------

def test_mlm_mask_chooses_the_fraction_and_replaces_80_10_10():
    ids = torch.randint(0, V - 1, (64, 50), generator=torch.Generator().manual_seed(7))
    inputs, targets = mlm_mask(ids, mask_id=V - 1, vocab_size=V, fraction=0.2,
                               generator=torch.Generator().manual_seed(8))
    chosen = targets != IGNORE_INDEX
    assert chosen.sum(dim=1).tolist() == [10] * 64                 # round(0.2 * 50) per row
    assert torch.equal(targets[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])              # unchosen positions untouched
    masked = (inputs == V - 1) & chosen
    kept = (inputs == ids) & chosen
    n = int(chosen.sum())
    assert abs(int(masked.sum()) / n - 0.8) < 0.05
    assert abs(int(kept.sum()) / n - 0.1 - 0.1 / V) < 0.04         # 10% kept, plus random draws of the same id
    assert not bool(((inputs == V - 1) & ~chosen).any())


def test_mlm_mask_is_deterministic_given_a_generator_and_respects_maskable():
    ids = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(9))
    first = mlm_mask(ids, 0, V, generator=torch.Generator().manual_seed(4))
    again = mlm_mask(ids, 0, V, generator=torch.Generator().manual_seed(4))
    other = mlm_mask(ids, 0, V, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not all(torch.equal(x, y) for x, y in zip(first, other))
    maskable = torch.zeros(3, 12, dtype=torch.bool)
    maskable[:, 4:8] = True
    _, targets = mlm_mask(ids, 0, V, fraction=0.5, maskable=maskable, generator=torch.Generator().manual_seed(4))
    chosen = targets != IGNORE_INDEX
    assert not bool((chosen & ~maskable).any()) and chosen.sum(dim=1).tolist() == [2, 2, 2]
    _, targets = mlm_mask(ids[:, :3], 0, V, fraction=0.01, generator=torch.Generator().manual_seed(4))
    assert (targets != IGNORE_INDEX).sum(dim=1).tolist() == [1, 1, 1]   # at least one per row


def test_mlm_loss_counts_only_masked_positions_and_equals_a_hand_computation():
    model = build("bidirectional")
    ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(10))
    inputs, targets = mlm_mask(ids, 0, V, fraction=0.25, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logits = model(inputs)                                     # (B, T, V)
        loss = cross_entropy(logits, targets)
    terms = []
    for b in range(2):
        for t in range(8):
            if targets[b, t] != IGNORE_INDEX:
                row = logits[b, t].double()
                terms.append(float(row.logsumexp(0) - row[ids[b, t]]))
    assert len(terms) == 4
    assert math.isclose(float(loss), sum(terms) / len(terms), rel_tol=1e-5)
    with torch.no_grad():
        same = mlm_loss(model, ids, 0, fraction=0.25, generator=torch.Generator().manual_seed(11))
    assert math.isclose(float(same), float(loss), rel_tol=1e-6)  # mlm_mask + cross_entropy in one call
    # the gradient reaches the logits of masked positions only
    logits = model(inputs)
    logits.retain_grad()
    cross_entropy(logits, targets).backward()
    touched = logits.grad.abs().amax(dim=-1) > 0                   # (B, T)
    assert torch.equal(touched, targets != IGNORE_INDEX)


@pytest.mark.parametrize("kw, words", [
    (dict(mask_id=V), "mask_id 29 is outside the vocabulary 0..28"),
    (dict(fraction=0.0), "fraction must be in (0, 1]"),
    (dict(mask_share=0.9, random_share=0.2), "must be >= 0 with a sum <= 1"),
    (dict(maskable=torch.zeros(2, 4, dtype=torch.bool)), "row 0 has no maskable position"),
    (dict(maskable=torch.ones(2, 3, dtype=torch.bool)), "maskable must be bool of shape (2, 4)"),
])
def test_mlm_mask_refuses_bad_arguments(kw, words):
    args = {"mask_id": 0, "vocab_size": V, **kw}
    with pytest.raises(ValueError) as err:
        mlm_mask(torch.zeros(2, 4, dtype=torch.long), **args)
    assert words in str(err.value)
    with pytest.raises(ValueError, match="shape \\(B, T\\)"):
        mlm_mask(torch.zeros(4, dtype=torch.long), 0, V)


def test_one_mlm_step_lowers_the_loss_of_the_masked_positions():
    model = build("bidirectional").train()
    ids = torch.randint(1, V, (8, 12), generator=torch.Generator().manual_seed(12))
    inputs, targets = mlm_mask(ids, 0, V, generator=torch.Generator().manual_seed(13))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = cross_entropy(model(inputs), targets)
    before.backward()
    opt.step()
    with torch.no_grad():
        after = cross_entropy(model(inputs), targets)
    assert float(after) < float(before.detach())
    assert dataclasses.replace(model.config, attention="causal") == tiny()


def test_flop_count_of_an_encoder_reads_every_key():
    """A causal query reads T/2 keys on average, an encoder's all T: twice the attention FLOPs."""
    from logitlab.model import accounting

    causal = accounting.flops_per_token(tiny(), context=16)
    encoder = accounting.flops_per_token(tiny(attention="bidirectional"), context=16)
    assert encoder["dense"] == causal["dense"]
    assert encoder["attention"] == 2 * causal["attention"]


def test_sft_refuses_an_encoder():
    from logitlab.data.sft import PackedInputs
    from logitlab.train.sft import forward_packed

    ids = torch.zeros(1, 4, dtype=torch.long)
    inputs = PackedInputs(ids=ids, segments=torch.zeros_like(ids), positions=torch.arange(4)[None])
    with pytest.raises(ValueError, match="attention='bidirectional'"):
        forward_packed(build("bidirectional"), inputs)
