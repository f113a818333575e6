"""optim.py: schedule values, clipping, weight-decay groups, AdamW construction."""

from __future__ import annotations

import math

import pytest
import torch

from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.train.optim import (
    WarmupCosine,
    build_adamw,
    clip_grad_norm,
    global_grad_norm_reference,
    lr_at,
    param_group_names,
    param_groups,
)


def test_schedule_values_at_start_end_of_warmup_and_end():
    s = WarmupCosine(max_lr=1e-3, warmup_steps=10, total_steps=110, min_lr=1e-4)
    assert s.lr_at(0) == pytest.approx(1e-4)          # max_lr * 1 / 10: the first step already moves
    assert s.lr_at(9) == pytest.approx(1e-3)          # last warmup step reaches the peak
    assert s.lr_at(10) == pytest.approx(1e-3)         # cosine starts at the peak
    assert s.lr_at(60) == pytest.approx(5.5e-4)       # halfway: (max + min) / 2
    assert s.lr_at(110) == pytest.approx(1e-4)        # the floor at the end
    assert s.lr_at(500) == pytest.approx(1e-4)        # and after it
    lrs = [s.lr_at(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay


def test_schedule_pure_function_matches_formula_and_no_warmup():
    for step in (0, 3, 50, 99, 100):
        p = step / 100
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))
        assert lr_at(step, max_lr=1.0, warmup_steps=0, total_steps=100, min_lr=0.1) == pytest.approx(expected)


def test_schedule_validation_names_fields():
    with pytest.raises(ValueError, match="min_lr"):
        WarmupCosine(max_lr=1e-3, warmup_steps=1, total_steps=10, min_lr=1e-2)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(max_lr=1e-3, warmup_steps=-1, total_steps=10)


def test_schedule_apply_sets_every_group():
    model = Transformer(ModelConfig(vocab_size=32, context_length=8, d_model=16, n_layers=1, n_heads=2))
    opt = build_adamw(model, lr=1.0)
    lr = WarmupCosine(1e-3, 4, 10).apply(opt, 1)
    assert lr == pytest.approx(5e-4) and all(g["lr"] == lr for g in opt.param_groups)


def _params_with_grads(scale: float):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 4), (5,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape) * scale
    return ps


def test_clipping_caps_the_global_norm_and_returns_pre_clip_norm():
    ps = _params_with_grads(10.0)
    before = global_grad_norm_reference(ps)
    assert before > 1.0
    returned = clip_grad_norm(ps, 1.0)
    assert returned == pytest.approx(before, rel=1e-5)
    assert global_grad_norm_reference(ps) == pytest.approx(1.0, rel=1e-4)


def test_clipping_leaves_small_gradients_and_zero_means_measure_only():
    ps = _params_with_grads(0.01)
    grads = [p.grad.clone() for p in ps]
    norm = clip_grad_norm(ps, 1.0)
    assert norm == pytest.approx(global_grad_norm_reference(ps), rel=1e-5)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, ps))
    big = _params_with_grads(10.0)
    assert clip_grad_norm(big, 0) == pytest.approx(global_grad_norm_reference(big), rel=1e-5)
    assert global_grad_norm_reference(big) > 1.0


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_weight_decay_only_on_matrices(positions):
    cfg = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4, positions=positions,
                      norm="layernorm", bias=True, tie_embeddings=True)
    model = Transformer(cfg)
    names = param_group_names(model, 0.1)
    assert "blocks.0.attn.qkv_proj.weight" in names["decay"]
    assert "blocks.1.mlp.down_proj.weight" in names["decay"]
    for n in ("tok_emb.weight", "blocks.0.attn_norm.weight", "blocks.0.attn_norm.bias",
              "blocks.0.attn.qkv_proj.bias", "final_norm.weight"):
        assert n in names["no_decay"], n
    if positions == "learned":
        assert "pos_emb.weight" in names["no_decay"]
    assert all(p.dim() >= 2 for g in param_groups(model, 0.1) if g["weight_decay"] > 0 for p in g["params"])
    # the tied LM head is the embedding Parameter and is listed once
    total = sum(len(g["params"]) for g in param_groups(model, 0.1))
    assert total == len(list(model.parameters()))
    with_emb = param_group_names(model, 0.1, decay_embeddings=True)
    assert "tok_emb.weight" in with_emb["decay"]


def test_build_adamw_groups_and_decay_values():
    model = Transformer(ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=4,
                                    tie_embeddings=False))
    opt = build_adamw(model, lr=1e-3, weight_decay=0.05, betas=(0.8, 0.9))
    assert isinstance(opt, torch.optim.AdamW)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.05]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    names = param_group_names(model, 0.05)
    assert "lm_head.weight" in names["decay"]  # an untied head is an ordinary matrix


def test_build_adamw_uses_the_fused_kernel_on_cpu_and_matches_foreach():
    # no biases: the key bias gets a gradient that is zero up to rounding, which Adam would amplify
    cfg = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=4, bias=False)
    a, b = Transformer(cfg), Transformer(cfg)
    b.load_state_dict(a.state_dict())
    opt = build_adamw(a, lr=1e-2)
    assert opt.defaults["fused"] is True
    params_b = dict(b.named_parameters())
    ref = torch.optim.AdamW([{"params": [params_b[n] for n in names], "weight_decay": g["weight_decay"]}
                             for g, names in zip(opt.param_groups, _group_names(a, opt))],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    assert not ref.param_groups[0]["fused"]
    x = torch.randint(0, 64, (2, 16))
    for _ in range(3):
        for model, o in ((a, opt), (b, ref)):
            o.zero_grad()
            model(x).float().logsumexp(-1).mean().backward()
            o.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def _group_names(model, opt) -> list[list[str]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [[by_id[id(p)] for p in g["params"]] for g in opt.param_groups]
