"""Quantized weights: the reference math (int8 per channel, int4 per group, llama.cpp's Q8_0 and
Q4_0 against the gguf package's own), quantizing a model from outside, and torch's packed CPU
kernels against the reference."""

from __future__ import annotations

import pytest
import torch

from logitlab.model import ModelConfig, Transformer
from logitlab.quant import Int4Linear, Int8Linear, QuantConfig, quantize_model, routes
from logitlab.quant import reference as ref
from logitlab.quant.apply import model_bytes, weight_bytes

LLAMA = dict(vocab_size=250, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
             norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False)


def _weight(N=48, K=128, seed=0) -> torch.Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    w[3] = 0.0                                                 # an all-zero row: scale tiny, q = 0
    w[5, :64] *= 20                                            # an outlier group
    return w


# --------------------------------------------------------------------------------------------
# The reference math
# --------------------------------------------------------------------------------------------

def test_int8_round_trip_is_within_half_a_step():
    w = _weight()
    q, s = ref.quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (48,)
    assert int(q.abs().max()) <= 127
    err = (ref.dequantize_int8(q, s) - w).abs()
    assert bool((err <= s.float()[:, None] / 2 + 1e-6 * w.abs()).all())
    assert float(ref.dequantize_int8(q, s)[3].abs().max()) == 0.0


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_is_within_one_step_per_group(group_size):
    w = _weight()
    q, s, z = ref.quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and z.dtype == torch.uint8 and int(z.max()) <= 15
    assert s.shape == z.shape == (48, 128 // group_size)
    deq = ref.dequantize_int4(q, s, z)
    step = s.float().repeat_interleave(group_size, dim=1)      # (N, K)
    assert bool(((deq - w).abs() <= step + 1e-6).all())
    assert float((deq - w).abs().mean() / step.mean()) < 0.3   # about a quarter step on average
    assert float(deq[3].abs().max()) == 0.0


def test_int4_needs_a_group_size_that_divides_the_columns():
    with pytest.raises(ValueError, match="group_size must be one of"):
        ref.quantize_int4(_weight(), 48)
    with pytest.raises(ValueError, match=r"in_features \(96\) must be divisible by group_size \(64\)"):
        ref.quantize_int4(torch.randn(4, 96), 64)


def test_nibbles_pack_two_to_a_byte_and_back():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = ref.pack_int4(q)
    assert packed.shape == (5, 6) and torch.equal(packed[0, 0], q[0, 0] | (q[0, 1] << 4))
    assert torch.equal(ref.unpack_int4(packed), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_references_are_a_matmul_with_the_dequantized_weight(dtype):
    w, x = _weight(), torch.randn(3, 7, 128).to(dtype)
    q, s = ref.quantize_int8(w)
    torch.testing.assert_close(ref.int8_linear(x, q, s), x @ ref.dequantize_int8(q, s, dtype).T)
    q4, s4, z4 = ref.quantize_int4(w, 32)
    torch.testing.assert_close(ref.int4_linear(x, ref.pack_int4(q4), s4, z4),
                               x @ ref.dequantize_int4(q4, s4, z4, dtype).T)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_block_formats_give_llama_cpps_numbers(kind):
    """Our Q8_0 / Q4_0 quantize-dequantize equals the gguf package's (llama.cpp's reference)."""
    gguf = pytest.importorskip("gguf")
    w = _weight(N=8, K=96) * 0.05
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    theirs = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
    quantize, dequantize = (ref.quantize_q8_0, ref.dequantize_q8_0) if kind == "Q8_0" else \
        (ref.quantize_q4_0, ref.dequantize_q4_0)
    ours = dequantize(*quantize(w))
    assert torch.equal(ours, torch.from_numpy(theirs).float())


# --------------------------------------------------------------------------------------------
# Quantizing a model
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,tolerance", [(QuantConfig("int8"), 0.02), (QuantConfig("int4", 32), 0.15)])
def test_a_quantized_model_computes_with_its_dequantized_weights(config, tolerance):
    model = Transformer(ModelConfig(**LLAMA)).eval()
    ids = torch.randint(0, 250, (2, 9))
    with torch.no_grad():
        before = model(ids)
        report = quantize_model(model, config)
        after = model(ids)
    assert len(report.layers) == 2 * 4 + 1 and report.skipped == {}        # qkv, o, gate_up, down; the head
    assert isinstance(model.lm_head, (Int8Linear, Int4Linear))
    assert report.bytes_after < report.bytes_before / (2.5 if config.method == "int8" else 3.2)   # fp32 embedding kept
    assert float((after - before).abs().max() / before.abs().max()) < tolerance
    dense = Transformer(ModelConfig(**LLAMA)).eval()                        # the same math by hand
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(("qweight", "scales", "zeros"))}
    for name in report.layers:
        state[name + ".weight"] = model.get_submodule(name).dequantized()
    dense.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(dense(ids), after, atol=1e-5, rtol=1e-5)


def test_a_tied_head_and_a_padded_head():
    tied = Transformer(ModelConfig(**{**LLAMA, "tie_embeddings": True}))
    report = quantize_model(tied, QuantConfig("int8"))
    assert report.skipped == {"lm_head": "tied to the embedding table"}
    assert tied.lm_head.weight is tied.tok_emb.weight
    padded = Transformer(ModelConfig(**{**LLAMA, "vocab_pad_multiple": 64})).eval()   # 250 -> 256 rows
    ids = torch.randint(0, 250, (1, 5))
    with torch.no_grad():
        before = padded(ids)
        quantize_model(padded, QuantConfig("int8"))
        after = padded(ids)
    assert padded.lm_head.out_features == 250 and after.shape == before.shape == (1, 5, 250)
    assert float((after - before).abs().max() / before.abs().max()) < 0.02


def test_quantizing_twice_and_odd_shapes():
    model = Transformer(ModelConfig(**{**LLAMA, "d_model": 96, "n_heads": 4, "n_kv_heads": 2}))
    report = quantize_model(model, QuantConfig("int4", 64))                 # D = 96: not a multiple of 64
    assert "blocks.0.attn.qkv_proj" in report.skipped and "multiple of the group size 64" in \
        report.skipped["blocks.0.attn.qkv_proj"]
    assert "blocks.0.mlp.down_proj" in report.layers                         # K = F = 128
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(model, QuantConfig("int8"))
    with pytest.raises(ValueError, match="method must be one of"):
        QuantConfig("int3")


@pytest.mark.parametrize("quant", [None, QuantConfig("int8"), QuantConfig("int4", 32), QuantConfig("int4", 128)])
def test_weight_bytes_counts_what_a_quantized_model_holds(quant):
    config = ModelConfig(**{**LLAMA, "d_model": 128, "vocab_pad_multiple": 64})
    model = Transformer(config).to(torch.bfloat16)
    if quant is not None:
        quantize_model(model, quant)
    rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.startswith("rope."))
    assert weight_bytes(config, quant) == model_bytes(model) - rope


# --------------------------------------------------------------------------------------------
# torch's packed CPU kernels against the reference
# --------------------------------------------------------------------------------------------

def _layers():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=True)
    return Int8Linear.from_linear(linear), Int4Linear.from_linear(linear, QuantConfig("int4", 32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_kernels_equal_the_reference(dtype):
    for layer in _layers():
        x = torch.randn(5, 128).to(dtype)
        want = layer(x)
        handle = routes.install(layer, "packed", dtype=dtype)
        assert handle.layers == 1 and layer.kernel is not None
        got = layer(x)
        # the kernels round the scales and int4's zero term to x's dtype and sum in another order
        scale = want.float().abs().max()
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert float((got.float() - want.float()).abs().max() / scale) < tolerance
        assert got.dtype == dtype and got.shape == (5, 48)
        handle.remove()
        assert layer.kernel is None and torch.equal(layer(x), want)


def test_packed_kernels_leave_unsupported_shapes_to_the_reference():
    int8 = Int8Linear.from_linear(torch.nn.Linear(40, 8))                   # K % 32 != 0
    int4 = Int4Linear.from_linear(torch.nn.Linear(64, 24), QuantConfig("int4", 32))   # N % 16 != 0
    for layer in (int8, int4):
        handle = routes.install(layer, "packed")
        assert handle.layers == 0 and handle.route == "reference" and layer.kernel is None


def test_auto_installs_the_packed_kernel_only_where_it_is_faster(monkeypatch):
    int8, _ = _layers()

    def timings(packed, reference):
        routes.MEASURED.clear()
        monkeypatch.setattr(routes, "_best", lambda fn, x, repeats=5: reference if fn.__name__ == "reference"
                            else packed)

    timings(packed=1.0, reference=2.0)
    handle = routes.install(int8, "auto", dtype=torch.float32)
    assert handle.route == "packed" and int8.kernel is not None
    assert handle.timings["int8 48x128"] == {"reference": 4.0, "packed": 2.0}
    handle.remove()
    timings(packed=1.0, reference=1.05)                                     # a near tie keeps the reference
    handle = routes.install(int8, "auto", dtype=torch.float32)
    assert handle.route == "reference" and int8.kernel is None
    routes.MEASURED.clear()
    with pytest.raises(ValueError, match="route must be one of"):
        routes.install(int8, "fast")


# --------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", 32, head=False)])
def test_a_quantized_model_saves_and_loads_as_safetensors(tmp_path, config):
    import json

    from safetensors import safe_open

    from logitlab.io import model_dir

    model = Transformer(ModelConfig(**{**LLAMA, "vocab_pad_multiple": 64})).to(torch.bfloat16).eval()
    quantize_model(model, config)
    model_dir.save_model(model, tmp_path / "q")
    stored = json.loads((tmp_path / "q" / "config.json").read_text())
    assert stored["quantization"] == config.to_dict()
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("blocks.0.mlp.down_proj.qweight").dtype == (torch.int8 if config.method == "int8"
                                                                         else torch.uint8)
    assert "blocks.0.attn.qkv_proj.weight" not in keys and ("lm_head.qweight" in keys) == config.head
    loaded = model_dir.load_model(tmp_path / "q").eval()
    assert model_dir.quantization_of(loaded) == config
    assert set(loaded.state_dict()) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = torch.randint(0, 250, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        as_fp32 = model_dir.load_model(tmp_path / "q", dtype=torch.float32)   # scales stay bf16
    assert as_fp32.blocks[0].mlp.down_proj.scales.dtype == torch.bfloat16
    assert as_fp32.tok_emb.weight.dtype == torch.float32


def test_a_quantized_model_is_not_exported_as_dense_and_a_bad_config_is_named(tmp_path):
    import json

    from logitlab.io import hf, model_dir

    model = Transformer(ModelConfig(**LLAMA))
    quantize_model(model, QuantConfig("int8"))
    with pytest.raises(ValueError, match=r"quantized \(int8\).*export the model before quantizing"):
        hf.save_pretrained(model, tmp_path / "hf")
    model_dir.save_model(model, tmp_path / "q")
    path = tmp_path / "q" / "config.json"
    payload = json.loads(path.read_text())
    path.write_text(json.dumps({**payload, "quantization": {"method": "int2"}}))
    with pytest.raises(ValueError, match="config.json: \"quantization\": method must be one of"):
        model_dir.load_model(tmp_path / "q")
