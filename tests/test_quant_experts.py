"""Quantized experts: a mixture of experts' stacked weights quantized one layer per expert and
projection, held against the same model with its experts' dequantized weights, in every form of
the expert products, saved and loaded, counted exactly, and under the packed CPU kernels."""

from __future__ import annotations

import copy

import pytest
import torch

from logitlab.model import ModelConfig, Transformer
from logitlab.model.moe import Experts, experts_loop, set_moe_impl
from logitlab.model.moe_forms import experts_sorted
from logitlab.quant import QuantConfig, quantize_model, routes
from logitlab.quant.apply import model_bytes, weight_bytes
from logitlab.quant.experts import QuantExperts
from logitlab.quant.linear import QuantLinear

MOE = dict(vocab_size=250, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
           norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False,
           n_experts=4, n_experts_per_token=2, moe_d_ff=64)
GPT_OSS_LIKE = dict(MOE, expert_bias=True, expert_act="clamped_swiglu")


def _model(fields: dict, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**fields)).eval()
    with torch.no_grad():                       # biases away from zero, so a lost bias shows
        for module in model.modules():
            if isinstance(module, Experts) and module.gate_up_bias is not None:
                module.gate_up_bias.normal_(0, 0.5)
                module.down_bias.normal_(0, 0.5)
    return model


def _dequantized_copy(model: Transformer, fields: dict) -> Transformer:
    """The unquantized model whose experts hold the quantized experts' dequantized weights."""
    dense = Transformer(ModelConfig(**fields)).eval()
    state = dense.state_dict()
    for key, value in model.state_dict().items():
        if key in state:
            state[key] = value
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and ".experts." not in name:
            state[f"{name}.weight"] = module.dequantized()
        if isinstance(module, QuantExperts):
            w1, b1, w2, b2 = module.stacked()
            state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"] = w1, w2
            if b1 is not None:
                state[f"{name}.gate_up_bias"], state[f"{name}.down_bias"] = b1, b2
    dense.load_state_dict(state)
    return dense


@pytest.mark.parametrize("fields", [MOE, GPT_OSS_LIKE], ids=["swiglu", "gpt-oss-like"])
@pytest.mark.parametrize("config,tolerance", [(QuantConfig("int8"), 0.02), (QuantConfig("int4", 32), 0.25)])
def test_quantized_experts_compute_with_their_dequantized_weights_in_every_form(fields, config, tolerance):
    model = _model(fields)
    original = copy.deepcopy(model.blocks[0].mlp.experts)
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        report = quantize_model(model, config)
        expected = _dequantized_copy(model, fields)(ids)
        outputs = {}
        for impl in ("loop", "sorted", "grouped", "gather", "auto"):
            set_moe_impl(model, impl)
            outputs[impl] = model(ids)
    assert "blocks.0.mlp.experts" in report.layers and "blocks.1.mlp.experts" in report.layers
    assert isinstance(model.blocks[0].mlp.experts, QuantExperts)
    assert model.blocks[0].mlp.router.weight.dtype == torch.float32            # the router is kept
    for impl, out in outputs.items():
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=impl)
    # the experts alone, on the same rows and routing: within the quantization's own error
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 64, generator=g)
    experts = torch.randint(0, 4, (12, 2), generator=g)
    weights = torch.rand(12, 2, generator=g)
    with torch.no_grad():
        want = experts_loop(original, x, weights, experts)
        got = experts_loop(model.blocks[0].mlp.experts, x, weights, experts)
        with torch.enable_grad():                  # the sorted form's runs with gradients enabled
            runs = experts_sorted(model.blocks[0].mlp.experts, x, weights, experts)
    torch.testing.assert_close(runs, got, atol=1e-5, rtol=1e-5)
    error = float((got - want).abs().max() / want.abs().max())
    assert 0 < error < tolerance                                              # quantized, and close


@pytest.mark.parametrize("quant", [QuantConfig("int8"), QuantConfig("int4", 32)])
def test_weight_bytes_counts_quantized_experts(quant):
    config = ModelConfig(**MOE)
    model = Transformer(config).to(torch.bfloat16)
    before = weight_bytes(config, None)
    quantize_model(model, quant)
    rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.startswith("rope."))
    assert weight_bytes(config, quant) == model_bytes(model) - rope
    experts = 2 * 4 * (2 * 64 * 64 + 64 * 64) * 2                               # L * E * (2F*D + D*F) bf16
    assert weight_bytes(config, quant) < before - experts * (0.45 if quant.method == "int8" else 0.7)


def test_int4_experts_whose_widths_the_group_does_not_divide_are_kept():
    model = Transformer(ModelConfig(**{**MOE, "moe_d_ff": 96}))
    report = quantize_model(model, QuantConfig("int4", 64))
    assert "blocks.0.mlp.experts" in report.skipped
    assert "expert d_ff 96" in report.skipped["blocks.0.mlp.experts"]
    assert type(model.blocks[0].mlp.experts) is Experts


@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", 32)])
def test_a_model_with_quantized_experts_saves_and_loads(tmp_path, config):
    from safetensors import safe_open

    from logitlab.io import model_dir

    model = _model(GPT_OSS_LIKE).to(torch.bfloat16)
    quantize_model(model, config)
    model_dir.save_model(model, tmp_path / "q")
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "blocks.0.mlp.experts.gate_up.3.qweight" in keys and "blocks.0.mlp.experts.down.0.scales" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    loaded = model_dir.load_model(tmp_path / "q").eval()
    assert model_dir.quantization_of(loaded) == config
    assert set(loaded.state_dict()) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.blocks[0].mlp.experts.gate_up[0].scales.dtype == torch.bfloat16
    ids = torch.randint(0, 250, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        set_moe_impl(loaded, "gather")                 # the dequantized stack follows the model's dtype
        torch.testing.assert_close(loaded(ids), model(ids), atol=2e-2, rtol=2e-2)


def test_packed_kernels_run_on_the_experts_and_equal_the_reference():
    model = _model(MOE).to(torch.bfloat16)
    quantize_model(model, QuantConfig("int8"))
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 250, (1, 7))
    handle = routes.install(model, "packed")
    try:
        assert model.blocks[0].mlp.experts.gate_up[0].kernel is not None
        with torch.no_grad():
            torch.testing.assert_close(model(ids).float(), reference(ids).float(), atol=3e-2, rtol=3e-2)
    finally:
        handle.remove()
    assert model.blocks[0].mlp.experts.gate_up[0].kernel is None
