"""Layers against independent formulas: norms, RoPE, MLPs, and the two attention paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from logitlab.model.config import ModelConfig, RopeScaling
from logitlab.model.layers import (
    Attention,
    GeluMLP,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rope,
    eager_attention,
    repeat_kv,
    rope_inv_freq,
)


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=50, context_length=32, d_model=32, n_layers=2, n_heads=4)
    base.update(kw)
    return ModelConfig(**base)


# --- norms ---------------------------------------------------------------------------------

def test_rmsnorm_matches_formula():
    x = torch.randn(3, 5, 16) * 3 + 1
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    rms = torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), norm.weight * x / rms, rtol=1e-6, atol=1e-6)


def test_rmsnorm_bf16_computes_in_float32_then_casts():
    x = (torch.randn(4, 64) * 50).bfloat16()
    norm = RMSNorm(64).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_layernorm_matches_formula_and_torch():
    x = torch.randn(2, 7, 24) * 2 - 1
    norm = LayerNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
        norm.bias.copy_(torch.randn(24))
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
    ref = torch.nn.LayerNorm(24, eps=1e-5)
    ref.load_state_dict(norm.state_dict())
    torch.testing.assert_close(norm(x), ref(x))


# --- RoPE ----------------------------------------------------------------------------------

def test_rope_matches_complex_rotation():
    """Rotate-half pairs dimension i with i + Dh/2 and turns the pair by angle pos * f_i."""
    Dh, T = 8, 6
    rope = RotaryEmbedding(Dh, context_length=16, theta=10000.0)
    x = torch.randn(1, T, 2, Dh)                                                   # (B, T, heads, Dh)
    cos, sin = rope(torch.arange(T)[None])
    out = apply_rope(x, cos, sin)
    f = torch.tensor([10000.0 ** (-2 * i / Dh) for i in range(Dh // 2)], dtype=torch.float64)
    angle = (torch.arange(T, dtype=torch.float64)[:, None] * f[None])[:, None]  # (T, 1, Dh/2)
    z = torch.complex(x[..., : Dh // 2].double(), x[..., Dh // 2:].double())       # pairs (i, i + Dh/2)
    z = z * torch.polar(torch.ones_like(angle), angle)                              # turn by pos * f_i
    expected = torch.cat((z.real, z.imag), dim=-1).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_half_by_half_rotation_bit_for_bit(dtype):
    """The folded-sign tables give exactly [x1*c - x2*s, x2*c + x1*s] (transformers' values)."""
    Dh, T = 16, 9
    rope = RotaryEmbedding(Dh, context_length=16, theta=10000.0)
    x = torch.randn(2, T, 3, Dh).to(dtype)                                     # (B, T, heads, Dh)
    cos, sin = (t.to(dtype) for t in rope(torch.arange(T)[None]))
    assert cos.shape == sin.shape == (1, T, 1, Dh)
    c, s = rope.cos[:T, None].to(dtype), rope.sin[:T, None].to(dtype)          # (T, 1, Dh/2)
    x1, x2 = x[..., :Dh // 2], x[..., Dh // 2:]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert torch.equal(apply_rope(x, cos, sin), expected)
    compiled = torch.compile(apply_rope, backend="aot_eager", fullgraph=True)     # the half-by-half form
    assert torch.equal(compiled(x, cos, sin), expected)

def test_rope_dot_product_depends_only_on_relative_position():
    Dh = 16
    rope = RotaryEmbedding(Dh, context_length=64, theta=10000.0)
    q, k = torch.randn(Dh, dtype=torch.float32), torch.randn(Dh)

    def rotated(v, pos):
        cos, sin = rope(torch.tensor([[pos]]))
        return apply_rope(v.view(1, 1, 1, Dh), cos, sin).flatten()

    for offset in (0, 3, 17):
        dots = [rotated(q, m + offset) @ rotated(k, m) for m in (0, 5, 20, 40)]
        for d in dots[1:]:
            assert abs(float(d - dots[0])) < 1e-4
    by_offset = torch.stack([rotated(q, d) @ rotated(k, 0) for d in range(12)])
    assert float(by_offset.max() - by_offset.min()) > 0.1     # it does depend on the offset


def test_rope_scaling_frequencies_hand_computed():
    # Dh 8, theta 1e4: f = 1, 0.1, 0.01, 0.001; wavelengths 2*pi/f = 6.28, 62.8, 628, 6283.
    # C = 100, low 1, high 4, factor 8: w < 25 kept, w > 100 divided by 8, 62.8 blended with
    # s = (100/62.83 - 1) / 3 = 0.197183 -> (1 - s) * 0.1/8 + s * 0.1 = 0.0297535.
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=100)
    got = rope_inv_freq(8, 10000.0, scaling).tolist()
    assert got == pytest.approx([1.0, 0.0297535, 0.00125, 0.000125], rel=1e-5)
    assert rope_inv_freq(8, 10000.0).tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-6)


def test_rope_tables_are_float32_non_persistent():
    rope = RotaryEmbedding(8, context_length=10, theta=500000.0)
    assert rope.cos.dtype == torch.float32 and rope.cos.shape == (10, 4)
    assert rope.state_dict() == {}
    before = rope.cos.clone()
    rope.to(torch.bfloat16)
    assert rope.cos.dtype == torch.float32 and torch.equal(rope.cos, before)


# --- MLPs ----------------------------------------------------------------------------------

def test_swiglu_matches_formula():
    mlp = SwiGLU(tiny(mlp="swiglu", d_ff=48, bias=False))
    x = torch.randn(2, 3, 32)
    g, u = (x @ mlp.gate_up_proj.weight.T).chunk(2, dim=-1)   # rows: gate, then up
    expected = (g * torch.sigmoid(g) * u) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_gelu_mlp_tanh_matches_formula():
    mlp = GeluMLP(tiny(mlp="gelu", gelu_approximate="tanh"))
    x = torch.randn(2, 3, 32)
    h = x @ mlp.up_proj.weight.T + mlp.up_proj.bias
    gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    expected = gelu @ mlp.down_proj.weight.T + mlp.down_proj.bias
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_compiled_form_matches_f_gelu(dtype, monkeypatch):
    """The form a compiled graph traces (x * sigmoid(2u)), forward and gradient, against F.gelu:
    once through torch.compile and once by making the eager call take the compiled branch."""
    from logitlab.model import mlp as layers

    torch.manual_seed(0)
    x = (torch.randn(64, 96) * 4).to(dtype)
    x[0, :4] = torch.tensor([0.0, -30.0, 30.0, 1e-3])       # zero, both saturated ends, small
    for approximate in ("tanh", "none"):
        expected = F.gelu(x.float(), approximate=approximate).to(dtype)
        compiled = torch.compile(lambda t: layers.gelu(t, approximate), backend="aot_eager", fullgraph=True)
        tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
        torch.testing.assert_close(compiled(x), expected, **tol)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    a = x.float().requires_grad_()
    b = x.float().requires_grad_()
    layers.gelu(a, "tanh").sum().backward()
    F.gelu(b, approximate="tanh").sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=4e-6)


# --- attention -----------------------------------------------------------------------------

def test_repeat_kv_query_head_reads_kv_head_h_div_g():
    k = torch.randn(2, 3, 5, 4)                      # Hkv = 3
    out = repeat_kv(k, 4)                            # H = 12, G = 4
    for h in range(12):
        assert torch.equal(out[:, h], k[:, h // 4])


def test_eager_attention_matches_sdpa_and_weights_are_causal():
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    out, w = eager_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.all(w.triu(1) == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
    mask = torch.rand(2, 1, 6, 6) > 0.3
    mask |= torch.eye(6, dtype=torch.bool)
    out, w = eager_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.all(w.masked_select(~mask.expand_as(w)) == 0)


@pytest.mark.parametrize("n_kv_heads,qk_norm", [(4, False), (2, False), (1, True)])
def test_attention_module_sdpa_equals_eager(n_kv_heads, qk_norm):
    cfg = tiny(n_kv_heads=n_kv_heads, qk_norm=qk_norm, positions="rope")
    attn = Attention(cfg)
    rope = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta)
    x = torch.randn(2, 7, 32)
    cs = rope(torch.arange(7)[None])
    a, _ = attn(x, cs, is_causal=True, impl="sdpa")
    b, w = attn(x, cs, is_causal=True, impl="eager", need_weights=True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert w.shape == (2, 4, 7, 7)
    mask = (torch.rand(2, 1, 7, 7) > 0.4) | torch.eye(7, dtype=torch.bool)
    a, _ = attn(x, cs, mask=mask, impl="sdpa")
    b, _ = attn(x, cs, mask=mask, impl="eager")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_qk_norm_is_applied_per_head_before_rope():
    cfg = tiny(qk_norm=True, positions="rope", n_kv_heads=2)
    attn = Attention(cfg)
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.rand(8) + 0.5)
        attn.k_norm.weight.copy_(torch.rand(8) + 0.5)
    rope = RotaryEmbedding(8, 32, 10000.0)
    x = torch.randn(1, 5, 32)
    cos, sin = rope(torch.arange(5)[None])                      # (1, 5, 1, 8)
    qkv = attn.qkv_proj(x)                                       # columns: q (32), k (16), v (16)
    q = qkv[..., :32].reshape(1, 5, 4, 8)
    k = qkv[..., 32:48].reshape(1, 5, 2, 8)
    v = qkv[..., 48:].reshape(1, 5, 2, 8).transpose(1, 2)
    cos_h, sin_h = cos.transpose(1, 2), sin.transpose(1, 2)      # (1, 1, 5, 8) for (B, H, T, Dh) below

    def rms(t, w):
        return w * t / torch.sqrt((t ** 2).mean(-1, keepdim=True) + cfg.norm_eps)

    q = apply_rope(rms(q, attn.q_norm.weight).transpose(1, 2), cos_h, sin_h)
    k = apply_rope(rms(k, attn.k_norm.weight).transpose(1, 2), cos_h, sin_h)
    out, _ = eager_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    expected = attn.o_proj(out.transpose(1, 2).reshape(1, 5, 32))
    torch.testing.assert_close(attn(x, (cos, sin), is_causal=True)[0], expected, rtol=1e-5, atol=1e-5)


def test_sdpa_without_enable_gqa_repeats_heads(monkeypatch):
    import logitlab.model.attention as layers

    attn = Attention(tiny(n_kv_heads=2, positions="rope"))
    x = torch.randn(2, 5, 32)
    native, _ = attn(x, None, is_causal=True)
    monkeypatch.setattr(layers, "_SDPA_GQA", False)      # the torch < 2.5 path
    torch.testing.assert_close(attn(x, None, is_causal=True)[0], native, rtol=1e-5, atol=1e-5)


# --- bf16 products through float32 GEMMs (logitlab.kernels.cpu_bf16) -----------------------

@pytest.fixture
def bf16_mode():
    """Yields a function mode -> linear: the reference F.linear for "native", the float32-GEMM
    route (cpu_bf16.linear) for "fp32"; an unknown mode is install's ValueError."""
    from logitlab.kernels import cpu_bf16

    def use(mode):
        cpu_bf16.install(torch.nn.Module(), mode)           # validates the mode
        return F.linear if mode == "native" else cpu_bf16.linear
    yield use


def _round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _linear_and_grads(x, w, b, grad, linear):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, w, b)
    y.float().backward(grad)
    return y, x.grad, w.grad, (None if b is None else b.grad)


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_via_fp32_is_the_bf16_product_with_float32_accumulation(bf16_mode, bias):
    """Under bf16 autocast the fp32-GEMM path computes round(x_bf16 @ w_bf16^T + b_bf16) and the
    gradients autocast would: each product of bf16 operands, accumulated in float32, rounded."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 80, 48), torch.randn(24, 48)
    b = torch.randn(24) if bias else None
    grad = torch.randn(2, 80, 24)
    y, gx, gw, gb = _linear_and_grads(x, w, b, grad, bf16_mode("fp32"))
    assert y.dtype == torch.bfloat16 and gx.dtype == gw.dtype == torch.float32
    ref = _round(x) @ _round(w).T + (0 if b is None else _round(b))
    torch.testing.assert_close(y.float(), _round(ref), rtol=0, atol=0)
    g = _round(grad).reshape(-1, 24)
    torch.testing.assert_close(gx, _round(g @ _round(w)).view_as(x), rtol=0, atol=0)
    torch.testing.assert_close(gw, _round(g.T @ _round(x).reshape(-1, 48)), rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(gb, _round(g.sum(0)), rtol=0, atol=0)
    # the native bf16 kernel agrees up to summation order (an ulp of bf16 here and there)
    y2, gx2, gw2, _ = _linear_and_grads(x, w, b, grad, bf16_mode("native"))
    torch.testing.assert_close(y.float(), y2.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gw, gw2, rtol=1e-2, atol=2e-2)


def test_bf16_linear_via_fp32_is_chosen_by_mode_rows_and_dtype(bf16_mode, monkeypatch):
    from logitlab.kernels import cpu_bf16
    calls = []
    monkeypatch.setattr(cpu_bf16.Bf16LinearViaFp32, "apply",
                        lambda *a: calls.append(a[0].shape) or F.linear(*a).to(torch.bfloat16))
    w = torch.randn(16, 8)
    linear = bf16_mode("fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear(torch.randn(4, 40, 8), w)                           # 160 rows: fp32 GEMM
        linear(torch.randn(1, 8), w)                               # a decode step: native
    linear(torch.randn(200, 8), w)                                 # float32: untouched
    linear(torch.randn(200, 8).bfloat16(), w.bfloat16())           # bf16 weights, many rows
    assert calls == [(4, 40, 8), (200, 8)]
    with torch.autocast("cpu", dtype=torch.float16):
        linear(torch.randn(200, 8), w)                             # another autocast dtype: native
    linear = bf16_mode("native")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear(torch.randn(200, 8), w)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="bf16 matmul mode.*'fast'"):
        bf16_mode("fast")


def _compiled_and_eager_bf16_linear(backend: str):
    """relu(linear(1.37 x, w)) under bf16 autocast through the float32-GEMM path, compiled with
    `backend` and eagerly: -> (x, w, eager out, eager grads, compiled out, compiled grads)."""
    from logitlab.kernels.cpu_bf16 import linear

    torch.manual_seed(0)
    x, w, grad = torch.randn(160, 32), torch.randn(40, 32), torch.randn(160, 40)

    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.relu(linear(x * 1.37, w))

    runs = []
    for fn in (f, torch.compile(f, fullgraph=True, backend=backend)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xs, ws)
        out.float().backward(grad)
        runs += [out, (xs.grad, ws.grad)]
    return (x, w, *runs)


def test_bf16_linear_via_fp32_compiles_to_the_same_values(bf16_mode):
    """Compiled, the operands are still rounded to bf16 (the product is an operator of its own,
    so the compiler cannot fuse the rounding away): outputs and gradients equal the eager ones."""
    bf16_mode("fp32")
    x, w, eager, eager_grads, compiled, compiled_grads = _compiled_and_eager_bf16_linear("aot_eager")
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(compiled_grads, eager_grads, rtol=0, atol=0)
    # and not the float32 product: the rounding of the operands is visible
    assert not torch.equal(eager.float(), torch.relu(_round(x * 1.37 @ w.T)))


@pytest.mark.slow
def test_bf16_linear_via_fp32_inductor_keeps_the_rounding(bf16_mode):
    """The same check through inductor, whose fused kernels would skip a bf16 round trip."""
    bf16_mode("fp32")
    _, _, eager, eager_grads, compiled, compiled_grads = _compiled_and_eager_bf16_linear("inductor")
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(compiled_grads, eager_grads, rtol=0, atol=0)


def test_linear_layers_keep_nn_linear_keys_and_hooks():
    from torch.nn import Linear

    from logitlab.kernels import cpu_bf16
    from logitlab.model.transformer import Transformer
    model = Transformer(tiny())
    keys = list(model.state_dict())
    handle = cpu_bf16.install(model, "fp32")                        # swaps the classes
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Linear) for m in linears)
    assert all(type(m) is cpu_bf16.Bf16ViaFp32Linear for m in linears)
    assert list(model.state_dict()) == keys
    seen = []
    model.blocks[0].attn.qkv_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model(torch.zeros(1, 5, dtype=torch.long))
    assert seen == [(1, 5, 3 * 32)]
    handle.remove()
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


# --- installing the route into a model -----------------------------------------------------

def _padded_model():
    from logitlab.model.transformer import Transformer
    torch.manual_seed(0)
    return Transformer(tiny(vocab_pad_multiple=64, n_layers=1)).eval()


def test_install_fp32_equals_native_bf16_and_remove_restores_exactly():
    """Installed, a bf16-autocast forward through the float32 GEMMs (the padded head too) agrees
    with the plain model up to summation order; removed, the plain model is back bit for bit."""
    from logitlab.kernels import cpu_bf16
    model = _padded_model()
    ids = torch.randint(0, 50, (8, 20), generator=torch.Generator().manual_seed(1))   # 160 rows
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(ids)
    heads = []
    handle = cpu_bf16.install(model, "fp32")
    assert (handle.route, handle.timings) == ("fp32", None) and model.head_matmul is cpu_bf16.linear
    real = cpu_bf16.Bf16LinearViaFp32.apply
    cpu_bf16.Bf16LinearViaFp32.apply = lambda x, w, b: heads.append(w.shape) or real(x, w, b)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            routed = model(ids)
    finally:
        cpu_bf16.Bf16LinearViaFp32.apply = real
    assert (50, 32) in heads and len(heads) == 5                    # qkv, o, up, down, the head's V rows
    torch.testing.assert_close(routed.float(), plain.float(), rtol=2e-2, atol=2e-2)
    handle.remove()
    assert model.head_matmul is F.linear
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(ids), plain)
    assert cpu_bf16.install(model, "native").route == "native"
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("slow", ["native", "fp32"])
def test_install_auto_measures_and_picks_the_faster_route(monkeypatch, slow):
    """"auto" times both routes once at the model's largest Linear weight and installs the faster;
    the times are on the handle and cached per (device, weight shape, rows)."""
    import time

    from logitlab.kernels import cpu_bf16
    monkeypatch.setattr(cpu_bf16, "MEASURED", {})
    real = getattr(cpu_bf16, f"{slow}_product")
    monkeypatch.setattr(cpu_bf16, f"{slow}_product", lambda x, w: time.sleep(0.02) or real(x, w))
    model = _padded_model()
    handle = cpu_bf16.install(model, "auto")
    fast = "fp32" if slow == "native" else "native"
    assert handle.route == fast and handle.timings[slow] > handle.timings[fast]
    assert handle.weight_shape == (128, 32)                         # the largest: mlp.up_proj (F, D)
    assert list(cpu_bf16.MEASURED) == [("cpu", (128, 32), cpu_bf16.MEASURE_ROWS),
                                       ("attention", 4, 4, cpu_bf16.MEASURE_QUERIES, 8)]
    swapped = type(model.blocks[0].mlp.down_proj) is cpu_bf16.Bf16ViaFp32Linear
    assert swapped == (fast == "fp32")
    handle.remove()
    assert type(model.blocks[0].mlp.down_proj) is torch.nn.Linear


# --- bf16 attention through float32 SDPA (logitlab.kernels.cpu_bf16) ---------------------------

def _attention_and_grads(q, k, v, grad, attend):
    """attend(q, k, v) over bf16 leaves -> (out, (dq, dk, dv)) for the output gradient `grad`."""
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.float().backward(grad)
    return out, (q.grad, k.grad, v.grad)


def _qkv_grad(B=2, H=4, Hkv=2, T=40, Dh=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, Dh, generator=g), torch.randn(B, Hkv, T, Dh, generator=g),
            torch.randn(B, Hkv, T, Dh, generator=g), torch.randn(B, H, T, Dh, generator=g))


def test_bf16_attention_via_fp32_is_float32_attention_of_the_bf16_operands():
    """The route computes SDPA in float32 over the bf16 q, k, v and rounds the output to bf16:
    exactly that, its gradients those of the float32 attention rounded to bf16, and no farther
    from a float64 reference than the bf16 kernel is (which also rounds its softmax weights)."""
    from logitlab.kernels import cpu_bf16
    q, k, v, grad = _qkv_grad()
    sdpa = cpu_bf16._sdpa

    def routed(q, k, v):
        return cpu_bf16.attention_via_fp32(sdpa, q, k, v, None, True)
    out, grads = _attention_and_grads(q, k, v, grad, routed)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    qb, kb, vb = (t.to(torch.bfloat16).float().requires_grad_() for t in (q, k, v))
    exact = sdpa(qb, kb, vb, None, True)
    exact.backward(_round(grad))
    torch.testing.assert_close(out, exact.to(torch.bfloat16), rtol=0, atol=0)
    for g, e in zip(grads, (qb.grad, kb.grad, vb.grad)):
        torch.testing.assert_close(g.float(), _round(e), rtol=0, atol=0)

    q64, k64, v64 = (t.to(torch.bfloat16).double().requires_grad_() for t in (q, k, v))
    ref = eager_attention(q64, repeat_kv(k64, 2), repeat_kv(v64, 2), is_causal=True)[0]
    ref.backward(_round(grad).double())
    native, native_grads = _attention_and_grads(q, k, v, grad, lambda q, k, v: sdpa(q, k, v, None, True))

    def err(a, b):
        return float((a.detach().double() - b.detach()).abs().max())
    assert err(out, ref) <= err(native, ref) + 1e-6
    torch.testing.assert_close(out.float(), native.float(), rtol=2e-2, atol=2e-2)   # the same attention
    for g, n, r in zip(grads, native_grads, (q64.grad, k64.grad, v64.grad)):
        assert err(g, r) <= 2 * err(n, r) + 1e-3
        torch.testing.assert_close(g.float(), n.float(), rtol=5e-2, atol=5e-2)


def _spy_attention(monkeypatch):
    """Records the query count T of every call that takes the float32 attention route."""
    from logitlab.kernels import cpu_bf16
    calls, real = [], cpu_bf16.attention_via_fp32
    monkeypatch.setattr(cpu_bf16, "attention_via_fp32",
                        lambda attend, q, *a: calls.append(q.shape[-2]) or real(attend, q, *a))
    return calls


def test_install_fp32_routes_bf16_attention_with_enough_queries_only(monkeypatch):
    """Installed, a bf16-autocast forward and backward takes the float32 attention route in every
    layer and agrees with the plain model; float32 calls, a decode step (T = 1), the eager path and
    need_weights keep the plain attention; removed, the plain Attention classes are back."""
    from logitlab.generate.loop import decode_step
    from logitlab.kernels import cpu_bf16
    from logitlab.model.cache import KVCache
    from logitlab.model.transformer import Transformer
    torch.manual_seed(0)
    model = Transformer(tiny(n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False))
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        logits.float().square().mean().backward()
        return logits.float(), [p.grad.clone() for p in model.parameters()]
    plain, plain_grads = run()
    calls = _spy_attention(monkeypatch)
    handle = cpu_bf16.install(model, "fp32")
    assert handle.attention_route == "fp32"
    assert all(type(b.attn) is cpu_bf16.Bf16ViaFp32Attention for b in model.blocks)
    routed, routed_grads = run()
    assert calls == [24, 24]                                        # each layer's attention, forward
    torch.testing.assert_close(routed, plain, rtol=3e-2, atol=3e-2)
    for r, p in zip(routed_grads, plain_grads):
        torch.testing.assert_close(r, p, rtol=0.1, atol=5e-3)

    calls.clear()
    with torch.no_grad():
        model(ids)                                                  # float32: untouched
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.forward_with_attention(ids)                       # need_weights: the eager reference
            model.attn_impl = "eager"
            model(ids)
            model.attn_impl = "sdpa"
            cache = KVCache.for_model(model.config, batch_size=2, max_len=32, dtype=torch.bfloat16)
            model(ids, cache=cache)                                 # a prefill of 24 queries: routed
            decode_step(model, ids[:, -1:], cache)                  # one query: the bf16 kernel
    assert calls == [24, 24]
    handle.remove()
    assert all(type(b.attn) is Attention for b in model.blocks)
    again, _ = run()
    assert torch.equal(again, plain)


@pytest.mark.parametrize("slow", ["native", "fp32"])
def test_install_auto_measures_attention_and_picks_the_faster_route(monkeypatch, slow):
    """"auto" times attention forward and backward by both routes at the model's heads and the
    given sequence length, and installs the float32 route only when it is the faster."""
    import time

    from logitlab.kernels import cpu_bf16
    monkeypatch.setattr(cpu_bf16, "MEASURED", {})
    real = getattr(cpu_bf16, f"{slow}_attention")
    monkeypatch.setattr(cpu_bf16, f"{slow}_attention", lambda q, k, v: time.sleep(0.02) or real(q, k, v))
    model = _padded_model()
    handle = cpu_bf16.install(model, "auto", seq_len=20)
    fast = "fp32" if slow == "native" else "native"
    assert handle.attention_route == fast and handle.attention_timings[slow] > handle.attention_timings[fast]
    assert handle.attention_shape == (4, 4, 20, 8) and ("attention", 4, 4, 20, 8) in cpu_bf16.MEASURED
    assert (type(model.blocks[0].attn) is cpu_bf16.Bf16ViaFp32Attention) == (fast == "fp32")
    record = handle.record()
    assert record["bf16_attention_route"] == fast and set(record["bf16_attention_timings_s"]) == {"native", "fp32"}
    handle.remove()
    assert type(model.blocks[0].attn) is Attention
    with pytest.raises(ValueError, match="seq_len must be a positive"):
        cpu_bf16.install(model, "auto", seq_len=0)


def test_best_time_stops_timing_a_route_that_already_lost():
    """race times the float32 route first and stops timing the native one once a call of it takes
    more than twice the float32 route's best: the slower route is not timed again and again."""
    import time

    from logitlab.kernels import cpu_bf16
    calls = []
    timings = cpu_bf16.race(lambda: calls.append("fp32"), lambda: calls.append("native") or time.sleep(0.01))
    assert calls.count("fp32") == 4 and calls.count("native") == 2      # warm-up + one timed call
    assert timings["native"] > timings["fp32"]


def test_bf16_attention_route_compiles_to_the_same_values():
    """Compiled (aot_eager), the installed route gives the eager route's logits and gradients."""
    from logitlab.kernels import cpu_bf16
    from logitlab.model.transformer import Transformer
    torch.manual_seed(0)
    model = Transformer(tiny(n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False))
    cpu_bf16.install(model, "fp32")
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))

    def loss(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(ids).float().square().mean()
    runs = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        value = fn(ids)
        value.backward()
        runs.append((value.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("fp32_share, route", [(0.5, "fp32"), (0.9, "fp32"), (0.95, "native"), (1.2, "native")])
def test_install_auto_keeps_the_plain_kernels_on_a_near_tie(monkeypatch, fp32_share, route):
    """A float32 route is taken only where it measured clearly faster (at most PROVEN of the native
    time), for the products and for attention alike: a tie within a shared machine's noise keeps
    the bf16 kernels."""
    from logitlab.kernels import cpu_bf16
    timings = {"native": 1.0, "fp32": fp32_share}
    monkeypatch.setattr(cpu_bf16, "measure", lambda weight: timings)
    monkeypatch.setattr(cpu_bf16, "measure_attention", lambda *shape: timings)
    assert cpu_bf16.PROVEN == 0.9
    handle = cpu_bf16.install(_padded_model(), "auto")
    assert (handle.route, handle.attention_route) == (route, route)
    handle.remove()
