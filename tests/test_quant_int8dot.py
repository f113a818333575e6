"""The int8dot products (int8 weights times activations quantized to int8 per block of 32) against
their plain torch references: the activations byte for byte, the int32 block sums exactly, the
product within float32 rounding of reference.int8dot_linear and within the activations' own
rounding bound of the weight-only int8 product; and the route installed into a model."""

from __future__ import annotations

import pytest
import torch

from logitlab.model import ModelConfig, Transformer
from logitlab.quant import Int4Linear, Int8Linear, QuantConfig, int8dot, quantize_model, routes
from logitlab.quant import reference as ref
from logitlab.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(not int8dot.available(), reason="logitlab.quant._int8dot was not built "
                                "(no C compiler with OpenMP at install)")


def _x(M=5, K=96, seed=0) -> torch.Tensor:
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, 32:64] = 0.0                                          # an all-zero block: d = 0, q = 0
    x[1, :32] = torch.arange(32) - 15.5                        # halves: x / d lands on .5 steps
    x[2, 64:] *= 100                                           # a block of outliers
    return x


def _weight(N=37, K=96, seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    w[4] = 0.0
    return ref.quantize_int8(w)


@pytest.mark.parametrize("isa", int8dot.isas() if int8dot.available() else [])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_are_quantized_as_the_reference_does(dtype, isa):
    x = _x().to(dtype)
    x[3, 5], x[4, 40] = float("nan"), float("-inf")
    q, d = int8dot.quantize(x, isa)
    want_q, want_d = ref.quantize_activations(x)
    assert torch.equal(d.isnan(), want_d.isnan()) and torch.equal(d.nan_to_num(), want_d.nan_to_num())
    assert torch.equal(q, want_q) and d.isnan().sum() == 2 and int(q[3, :32].abs().max()) == 0
    assert d.dtype == torch.float32 and d.shape == (5, 3) and float(d[0, 1]) == 0.0
    assert int(q.abs().max()) == 127 and int(q[1, :32].abs().max()) == 127
    wide = (torch.randn(64, 512, generator=torch.Generator().manual_seed(2)) * torch.logspace(-6, 6, 64)[:, None])
    assert all(torch.equal(a, b) for a, b in zip(int8dot.quantize(wide.to(dtype), isa),
                                                 ref.quantize_activations(wide.to(dtype))))
    # each activation within half a step of its block's scale
    err = (ref.dequantize_q8_0(q, d) - x.float()).abs().view(5, 3, 32)[:3]
    assert bool((err <= d[:3, :, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("isa", int8dot.isas() if int8dot.available() else [])
@pytest.mark.parametrize("M", [1, 3, 6])
def test_block_sums_equal_torch_integer_products_exactly(isa, M):
    qx, _ = int8dot.quantize(_x(M=max(M, 3))[:M])
    qw, _ = _weight()
    B = qx.shape[1] // 32
    want = (qx.view(M, 1, B, 32).to(torch.int32) * qw.view(1, -1, B, 32).to(torch.int32)).sum(-1)
    assert torch.equal(int8dot.block_dots(qx, qw, isa), want)
    # the extremes: 32 products of 127 * 127 each way (the int16 pairs do not saturate)
    full = torch.full((2, 64), 127, dtype=torch.int8)
    full[1] = -127
    assert int8dot.block_dots(full[:1], full, isa).flatten().tolist() == [32 * 127 * 127] * 2 + [-32 * 127 * 127] * 2


@pytest.mark.parametrize("isa", int8dot.isas() if int8dot.available() else [])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_equals_the_reference(isa, threads, dtype):
    x, (q, s) = _x().to(dtype), _weight()
    got = int8dot.linear(x, q, s.float(), isa=isa, threads=threads)
    want = ref.int8dot_linear(x, q, s)
    assert got.dtype == dtype and got.shape == (5, 37)
    scale = float(want.float().abs().max())
    # float32: the same terms summed in another order; bf16: one rounding of the output apart
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert float((got.float() - want.float()).abs().max()) <= tolerance * scale
    for m in range(1, 5):                                         # every tile height gives the same rows
        assert torch.allclose(int8dot.linear(x[:m], q, s.float(), isa=isa).float(), got[:m].float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("isa", int8dot.isas() if int8dot.available() else [])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_block_sums_and_product_equal_the_reference(isa, group_size):
    M, K, N = 5, 256, 37
    x = _x(M=M, K=K, seed=5)
    q, s, z = ref.quantize_int4(torch.randn(N, K, generator=torch.Generator().manual_seed(6)), group_size)
    packed = ref.pack_int4(q)
    qx, _ = int8dot.quantize(x)
    want = (qx.view(M, 1, K // 32, 32).to(torch.int32) * q.view(1, N, K // 32, 32).to(torch.int32)).sum(-1)
    assert torch.equal(int8dot.block_dots_int4(qx, packed, group_size, isa), want)
    if group_size == 32:                                          # an odd number of blocks a row
        q3, s3, z3 = ref.quantize_int4(torch.randn(7, 96, generator=torch.Generator().manual_seed(7)), 32)
        x3 = _x(M=3, K=96)
        got3 = int8dot.linear_int4(x3, ref.pack_int4(q3), s3, z3, isa=isa)
        assert torch.allclose(got3, ref.int4dot_linear(x3, ref.pack_int4(q3), s3, z3), rtol=1e-5, atol=1e-4)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        got = int8dot.linear_int4(x.to(dtype), packed, s, z, isa=isa, threads=2)
        plain = ref.int4dot_linear(x.to(dtype), packed, s, z)
        assert got.dtype == dtype and got.shape == (M, N)
        assert float((got.float() - plain.float()).abs().max()) <= tolerance * float(plain.float().abs().max())
        for m in range(1, 5):                                     # every tile height gives the same rows
            assert torch.allclose(int8dot.linear_int4(x[:m].to(dtype), packed, s, z, isa=isa).float(),
                                  got[:m].float(), rtol=1e-5, atol=1e-5 * float(got.float().abs().max()))


def test_the_product_moves_from_weight_only_int8_by_at_most_the_activations_rounding():
    x, (q, s) = _x(M=8, K=256, seed=3), _weight(N=40, K=256, seed=4)
    got = int8dot.linear(x, q, s.float())
    weight_only = ref.int8_linear(x, q, s)                                     # x as it is, float32
    _, d = ref.quantize_activations(x)                                         # (M, B)
    w = ref.dequantize_int8(q, s).abs().view(40, 8, 32).sum(-1)                # (N, B): sum |w| per block
    bound = (d / 2) @ w.T                                                      # (M, N)
    err = (got - weight_only).abs()
    assert bool((err <= bound * (1 + 1e-4) + 1e-5).all())
    assert float(err.max()) > 0 and float((err / bound.clamp_min(1e-12)).max()) < 1.0


def test_a_nan_or_an_infinity_in_a_row_makes_that_row_nan():
    x, (q, s) = _x(), _weight()
    x[1, 3], x[3, 70] = float("nan"), float("inf")
    y = int8dot.linear(x, q, s.float())
    assert bool(y[[1, 3]].isnan().all()) and bool(y[[0, 2, 4]].isfinite().all())
    assert torch.equal(y.isnan(), ref.int8dot_linear(x, q, s).isnan())


def test_bad_tensors_are_refused_with_their_shapes():
    q, s = _weight()
    with pytest.raises(ValueError, match="multiple of 32"):
        int8dot.linear(torch.randn(2, 40), torch.zeros(3, 40, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        int8dot.linear(_x().half(), q, s.float())
    with pytest.raises(ValueError, match="float32"):
        int8dot.linear(_x(), q, s)                                             # bf16 scales
    with pytest.raises(ValueError, match="columns"):
        int8dot.bind(q, s.float())(torch.randn(2, 64))
    with pytest.raises(ValueError, match="isa must be one of"):
        int8dot.linear(_x(), q, s.float(), isa="neon")


# --------------------------------------------------------------------------------------------
# The route
# --------------------------------------------------------------------------------------------

def _model(method: str = "int8") -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=128, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False)
    model = Transformer(config).to(torch.bfloat16).eval()
    quantize_model(model, QuantConfig(method, group_size=32))
    return model


def _plain_products(model, product) -> None:
    for layer in (m for m in model.modules() if isinstance(m, QuantLinear)):
        layer.kernel = product


@torch.no_grad()
def test_the_route_runs_a_model_as_its_reference_does():
    model, ids = _model(), torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    handle = routes.install(model, "int8dot")
    assert handle.route == "int8dot" and handle.layers == 2 * 4 + 1          # qkv, o, gate-up, down; the head
    got = model(ids).float()
    handle.remove()
    _plain_products(model, lambda module, x: ref.int8dot_linear(x, module.qweight, module.scales))
    want = model(ids).float()
    _plain_products(model, None)
    weight_only = model(ids).float()
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 0.05 * scale                     # bf16 roundings between layers
    assert float((got - weight_only).abs().max()) > 0                          # it is another product


@torch.no_grad()
def test_the_route_runs_an_int4_model_as_its_reference_does():
    model, ids = _model("int4"), torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    handle = routes.install(model, "int8dot")
    assert handle.route == "int8dot" and handle.layers == 2 * 4 + 1
    got = model(ids).float()
    handle.remove()
    _plain_products(model, lambda module, x: ref.int4dot_linear(x, module.qweight, module.scales, module.zeros))
    want = model(ids).float()
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


def test_auto_considers_int8dot_for_bf16_activations_only(monkeypatch):
    layer = Int8Linear.from_linear(torch.nn.Linear(64, 16))
    int4 = Int4Linear.from_linear(torch.nn.Linear(64, 16), QuantConfig("int4", 32))
    for module in (layer, int4):
        assert routes.candidates(module, torch.bfloat16) == ["packed", "int8dot"]
        assert routes.candidates(module, torch.float32) == ["packed"]
    assert routes.fastest({"reference": 6.0, "packed": 4.0, "int8dot": 2.0}) == "int8dot"
    assert routes.fastest({"reference": 6.0, "packed": 4.0, "int8dot": float("inf")}) == "packed"
    assert routes.fastest({"reference": 6.0, "packed": 5.8}) == "reference"           # a near tie
    monkeypatch.setattr(routes, "measure", lambda module, dtype: {"reference": 6.0, "packed": 4.0, "int8dot": 2.0})
    handle = routes.install(layer, "auto", dtype=torch.bfloat16)
    assert handle.route == "int8dot" and layer.kernel is not None
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(layer(x), int8dot.linear(x, layer.qweight, layer.scales.float()) + layer.bias.to(torch.bfloat16))
    handle.remove()
    with pytest.raises(ValueError, match="int8dot"):
        routes.install(layer, "fast")


@pytest.mark.slow
@torch.no_grad()
def test_the_route_runs_in_the_compiled_decode_step():
    from logitlab.generate import SampleConfig, decode_step, generate
    from logitlab.kernels.decode import compiled_decode_step

    for method in ("int8", "int4"):
        model = _model(method)
        handle = routes.install(model, "int8dot")
        prompts, sample = [[5, 6, 7, 8]], SampleConfig(temperature=0, max_new_tokens=6)
        want = generate(model, prompts, sample).tokens
        for backend in ("aot_eager", "inductor"):                     # one graph each (fullgraph)
            step = compiled_decode_step(model, backend, step=decode_step)
            assert generate(model, prompts, sample, step=step).tokens == want
        handle.remove()
