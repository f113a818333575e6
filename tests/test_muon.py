"""muon.py: the orthogonalisation against an SVD, the update's blocks, MuonAdamW's AdamW part against
torch's AdamW, its state_dict round trip; optim.py's role groups and the warmup-stable-decay schedule."""

from __future__ import annotations

import math

import pytest
import torch

from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.train.muon import (
    POLAR_EXPRESS,
    QUINTIC,
    MuonAdamW,
    muon_update,
    orthogonalize,
    polynomial_of_singular_values,
    row_blocks,
)
from logitlab.train.optim import (
    WarmupCosine,
    WarmupStableDecay,
    build_adamw,
    param_roles,
    role_groups,
    wsd_lr_at,
)


def _matrix(rows: int, cols: int, condition: float = 20.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (rows, cols) matrix U diag(s) V^T with singular values from 1 down to 1/condition,
    scaled by 7 -> (G, U V^T)."""
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(condition), k, dtype=torch.float64)
    return (7.0 * U @ torch.diag(s) @ V.T).float(), U @ V.T


@pytest.mark.parametrize("method", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 16), (16, 40), (32, 32)])
def test_orthogonalize_is_the_polynomial_of_the_singular_values(method, shape):
    """The matrix iteration equals its scalar polynomial applied to the SVD's singular values: the
    same singular vectors, each singular value mapped by p."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    got = orthogonalize(G, 5, method)
    assert got.dtype == torch.float32 and got.shape == shape
    torch.testing.assert_close(got.double(), polynomial_of_singular_values(G, 5, method), rtol=0, atol=2e-5)


@pytest.mark.parametrize("method, low, high, distance", [("quintic", 0.65, 1.25, 0.25),
                                                         ("polar_express", 0.85, 1.15, 0.1)])
@pytest.mark.parametrize("shape", [(64, 24), (24, 64), (40, 40)])
def test_orthogonalize_approaches_u_vt(method, low, high, distance, shape):
    """Against U V^T from an SVD: on a matrix of condition number 20 every singular value lands in
    [low, high] (the quintic's published band is about [0.7, 1.2]; Polar Express is closer to 1) and
    the result is within `distance` of U V^T (relative Frobenius distance)."""
    G, polar = _matrix(*shape)
    X = orthogonalize(G, 5, method).double()
    s = torch.linalg.svdvals(X)
    assert low <= float(s.min()) and float(s.max()) <= high, (float(s.min()), float(s.max()))
    assert float((X - polar).norm() / polar.norm()) < distance
    # the same singular vectors: U^T X V is diagonal
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    inner = U.T @ X @ Vh.T
    off = inner - torch.diag(torch.diagonal(inner))
    assert float(off.abs().max()) < 1e-5


def test_coefficients_are_the_published_ones():
    assert QUINTIC == (3.4445, -4.7750, 2.0315)
    assert len(POLAR_EXPRESS) == 5 and POLAR_EXPRESS[0][0] == pytest.approx(8.1566, abs=1e-4)
    # the last iteration maps 1 near 1 (p(1) = a + b + c): a matrix already orthogonal stays nearly so
    assert 0.65 < sum(QUINTIC) < 0.75 and 1.0 < sum(POLAR_EXPRESS[-1]) < 1.1
    with pytest.raises(ValueError, match="method"):
        orthogonalize(torch.ones(2, 2), 5, "cubic")


def test_muon_update_momentum_blocks_and_scale():
    g = torch.Generator().manual_seed(2)
    grad, buf = torch.randn(30, 8, generator=g), torch.randn(30, 8, generator=g)
    expected_buf = 0.9 * buf + 0.1 * grad
    nesterov = grad + 0.9 * (expected_buf - grad)
    got = muon_update(grad, buf, momentum=0.9, blocks=(8, 16, 6))
    torch.testing.assert_close(buf, expected_buf)
    parts = [orthogonalize(p) * math.sqrt(max(1.0, p.shape[0] / 8)) for p in nesterov.split([8, 16, 6])]
    torch.testing.assert_close(got, torch.cat(parts))
    plain = muon_update(grad, torch.zeros(30, 8), momentum=0.0, nesterov=False)
    torch.testing.assert_close(plain, orthogonalize(grad) * math.sqrt(30 / 8))


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, norm="rmsnorm",
               positions="rope", mlp="swiglu", d_ff=48, bias=False, tie_embeddings=False)
    return Transformer(ModelConfig(**{**cfg, **kw}))


def test_param_roles_and_row_blocks():
    roles = param_roles(_model())
    assert roles["tok_emb.weight"] == "embedding" and roles["lm_head.weight"] == "head"
    assert roles["blocks.0.attn.qkv_proj.weight"] == "matrix" and roles["blocks.1.mlp.down_proj.weight"] == "matrix"
    assert roles["blocks.0.attn_norm.weight"] == "vector" and roles["final_norm.weight"] == "vector"
    tied = param_roles(_model(tie_embeddings=True))
    assert "lm_head.weight" not in tied and tied["tok_emb.weight"] == "embedding"
    blocks = row_blocks(_model())
    assert blocks["blocks.0.attn.qkv_proj.weight"] == (32, 16, 16)     # H*Dh, Hkv*Dh, Hkv*Dh
    assert blocks["blocks.1.mlp.gate_up_proj.weight"] == (48, 48)


def test_role_groups_rates_scales_and_muon_split():
    model = _model()
    groups = role_groups(model, 1e-3, weight_decay=0.1, rates={"embedding": 3e-3, "head": 2e-3})
    by_role = {g["role"]: g for g in groups}
    assert by_role["embedding"]["lr_scale"] == pytest.approx(3.0) and by_role["embedding"]["weight_decay"] == 0.0
    assert by_role["head"]["lr"] == 2e-3 and by_role["head"]["weight_decay"] == 0.1
    assert by_role["vector"]["weight_decay"] == 0.0 and by_role["matrix"]["lr_scale"] == 1.0
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    muon = role_groups(model, 1e-3, muon=dict(lr=0.02, weight_decay=0.0, momentum=0.95, ns_steps=5,
                                              ns_method="quintic", blocks=row_blocks(model)))
    kinds = {(g["kind"], g["role"]) for g in muon}
    assert ("muon", "matrix") in kinds and ("adamw", "matrix") not in kinds
    m = next(g for g in muon if g["kind"] == "muon")
    assert m["lr_scale"] == pytest.approx(20.0) and len(m["blocks"]) == len(m["params"])
    assert all(p.dim() == 2 for p in m["params"])


def _step(model, opt, x, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()


def test_muon_adamw_adamw_groups_equal_torch_adamw_bit_for_bit():
    a, b = _model(), _model()
    groups_a = [{**g, "kind": "adamw"} for g in role_groups(a, 1e-2)]
    opt_a = MuonAdamW(groups_a, betas=(0.9, 0.95), eps=1e-8)
    opt_b = torch.optim.AdamW(role_groups(b, 1e-2), betas=(0.9, 0.95), eps=1e-8, fused=True)
    x = torch.randint(0, 64, (2, 16))
    _step(a, opt_a, x)
    _step(b, opt_b, x)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def _muon_opt(model):
    groups = role_groups(model, 1e-2, muon=dict(lr=0.02, weight_decay=0.01, momentum=0.95, ns_steps=5,
                                               ns_method="polar_express", blocks=row_blocks(model)))
    return MuonAdamW(groups)


def test_muon_adamw_state_dict_resumes_exactly(tmp_path):
    x = torch.randint(0, 64, (2, 16))
    full = _model()
    opt = _muon_opt(full)
    _step(full, opt, x, 4)
    part = _model()
    opt_p = _muon_opt(part)
    _step(part, opt_p, x, 2)
    torch.save({"model": part.state_dict(), "opt": opt_p.state_dict()}, tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt", weights_only=True)       # what the checkpoint loader allows
    again = _model()
    again.load_state_dict(saved["model"])
    opt_again = _muon_opt(again)
    opt_again.load_state_dict(saved["opt"])
    _step(again, opt_again, x, 2)
    for (name, p), q in zip(full.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    muon_state = opt_again.state[next(g for g in opt_again.param_groups if g["kind"] == "muon")["params"][0]]
    assert set(muon_state) == {"momentum_buffer"}


def test_muon_moves_a_matrix_by_lr_in_spectral_norm():
    """One Muon step moves a matrix by about lr along each of its gradient's singular directions:
    the update's singular values are near 1 where the gradient's fall off by orders of magnitude."""
    model = _model()
    opt = _muon_opt(model)
    w = model.blocks[0].attn.o_proj.weight
    before = w.detach().clone()
    _step(model, opt, torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(3)), 1)
    delta = (before * (1 - 0.02 * 0.01) - w.detach()) / 0.02         # weight decay taken out
    s, g = torch.linalg.svdvals(delta), torch.linalg.svdvals(w.grad)
    assert float(g[7] / g[0]) < 0.1                  # the gradient: one direction dominates
    assert float(s.max()) < 1.25 and float(s[:8].min()) > 0.6, (s, g)   # the update: eight of them move alike


def test_muon_adamw_rejects_what_it_cannot_update():
    w, v = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="kind"):
        MuonAdamW([{"params": [w]}])
    with pytest.raises(ValueError, match=r"shape \[\(3,\)\]"):
        MuonAdamW([{"params": [v], "kind": "muon"}])
    with pytest.raises(ValueError, match="method"):
        MuonAdamW([{"params": [w], "kind": "muon", "ns_method": "cubic"}])


# ------------------------------------------------------------------------------------------
# The schedules
# ------------------------------------------------------------------------------------------

def test_wsd_values_linear_and_one_minus_sqrt():
    s = WarmupStableDecay(max_lr=1.0, warmup_steps=10, total_steps=100, decay_fraction=0.2)
    assert s.decay_start == 80
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(9) == pytest.approx(1.0)
    assert all(s.lr_at(i) == 1.0 for i in range(10, 80))              # the stable phase
    assert s.lr_at(90) == pytest.approx(0.5) and s.lr_at(99) == pytest.approx(0.05)
    assert s.lr_at(100) == 0.0 and s.lr_at(150) == 0.0                # decays to zero
    r = WarmupStableDecay(1.0, 10, 100, decay_fraction=0.2, decay_shape="1-sqrt")
    assert r.lr_at(90) == pytest.approx(1 - math.sqrt(0.5)) and r.lr_at(85) < s.lr_at(85)
    floor = WarmupStableDecay(1.0, 0, 100, min_lr=0.1)
    assert floor.lr_at(90) == pytest.approx(0.55) and floor.lr_at(100) == pytest.approx(0.1)
    # the stable phase does not depend on total_steps: a longer run agrees with a shorter one there
    longer = WarmupStableDecay(1.0, 10, 200, decay_fraction=0.2)
    assert [s.lr_at(i) for i in range(80)] == [longer.lr_at(i) for i in range(80)]
    assert wsd_lr_at(5, max_lr=2.0, warmup_steps=0, total_steps=10, decay_steps=10) == pytest.approx(1.0)


def test_wsd_validation_names_fields():
    with pytest.raises(ValueError, match="decay_fraction"):
        WarmupStableDecay(1.0, 0, 10, decay_fraction=0.0)
    with pytest.raises(ValueError, match="decay_shape"):
        WarmupStableDecay(1.0, 0, 10, decay_shape="cosine")
    with pytest.raises(ValueError, match="min_lr"):
        WarmupStableDecay(1.0, 0, 10, min_lr=2.0)


def test_schedules_apply_each_groups_scale():
    model = _model()
    opt = build_adamw(model, lr=1.0)
    opt.param_groups[0]["lr_scale"] = 4.0
    lr = WarmupCosine(1e-3, 0, 10).apply(opt, 0)
    assert opt.param_groups[0]["lr"] == pytest.approx(4e-3) and opt.param_groups[1]["lr"] == lr == 1e-3
    WarmupStableDecay(1e-3, 0, 10).apply(opt, 0)
    assert opt.param_groups[0]["lr"] == pytest.approx(4e-3)
