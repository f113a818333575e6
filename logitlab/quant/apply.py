"""Quantizing a built model from outside: which layers, in place, and what it saved.

apply.py owns the walk over a model's linear layers. quantize_model(model, config) replaces every
nn.Linear inside the blocks (attention's q/k/v and output projections and gate, the MLP,
Gated DeltaNet's projections) and, with config.head, the LM head, by an Int8Linear or Int4Linear
holding the quantized weight; the embedding table, norms, biases, Gated DeltaNet's conv and decay
and multi-head latent attention's kv_b_proj stay as they are. A mixture of experts' stacked experts
become one quantized layer per expert and projection (experts.py); its router stays as it is. A tied
LM head is the embedding table and is kept. The padded rows of an LM head (vocabulary padding) are
never multiplied, so its quantized form holds the first V only.

    report = quantize_model(model, QuantConfig("int4", group_size=64))
    report.layers, report.skipped, report.bytes_before, report.bytes_after

An int4 layer whose in_features the group size does not divide is kept (named in
report.skipped). quantized_layout(model, config) builds the same modules with empty tensors, for
loading a saved quantized model (io.model_dir); weight_bytes(config, quant) counts the bytes of a
model quantized so, exactly, without building it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from logitlab.quant.experts import QuantExperts, expert_bytes, expert_targets
from logitlab.quant.linear import LAYERS, QuantConfig, QuantLinear


@dataclass
class QuantReport:
    """What quantize_model did: the config, the layers replaced (names), the ones kept and why,
    and the bytes of every parameter and buffer of the model before and after."""

    config: QuantConfig
    layers: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0

    def as_dict(self) -> dict:
        return {"quantization": self.config.to_dict(), "layers": len(self.layers), "skipped": self.skipped,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}


def targets(model: nn.Module, config: QuantConfig) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """-> ({name: nn.Linear to quantize}, {name: why it is kept}) for a logitlab Transformer."""
    chosen, kept = {}, {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if name == "lm_head":
            if model.config.tie_embeddings:
                kept[name] = "tied to the embedding table"
                continue
            if not config.head:
                kept[name] = "the LM head (head=False)"
                continue
        elif not name.startswith("blocks."):
            kept[name] = "outside the blocks"
            continue
        if name.endswith(".attn.kv_b_proj"):
            kept[name] = "latent attention's kv_b_proj (its absorbed form multiplies the weight itself, mla.py)"
            continue
        if config.method == "int4" and module.in_features % config.group_size:
            kept[name] = f"in_features {module.in_features} is not a multiple of the group size {config.group_size}"
            continue
        chosen[name] = module
    return chosen, kept


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage counted once (a tied head is the embedding)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _head_rows(model: nn.Module, name: str, linear: nn.Linear) -> nn.Linear:
    """The LM head without its padding rows: a view of its first V rows (never multiplied)."""
    V = model.config.vocab_size
    if name != "lm_head" or linear.out_features == V:
        return linear
    view = nn.Linear(linear.in_features, V, bias=False, device="meta")
    view.weight = nn.Parameter(linear.weight.detach()[:V], requires_grad=False)
    return view


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


@torch.no_grad()
def quantize_model(model: nn.Module, config: QuantConfig = QuantConfig()) -> QuantReport:
    """Replace `model`'s linear layers by quantized ones, in place (see the module docstring).
    -> QuantReport. A model already quantized is refused."""
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("the model is quantized already: load it again from its file to quantize it another way")
    chosen, kept = targets(model, config)
    experts, kept_experts = expert_targets(model, config)
    report = QuantReport(config, list(chosen) + list(experts), kept | kept_experts, bytes_before=model_bytes(model))
    layer = LAYERS[config.method]
    for name, linear in chosen.items():
        _replace(model, name, layer.from_linear(_head_rows(model, name, linear), config))
    for name, ex in experts.items():
        _replace(model, name, QuantExperts.from_experts(ex, config))
    report.bytes_after = model_bytes(model)
    return report


def quantized_layout(model: nn.Module, config: QuantConfig) -> list[str]:
    """Replace the layers quantize_model would replace by quantized ones with empty tensors on the
    model's device (for load_state_dict). -> the names of the quantized linear layers (an MoE
    block's experts: one per expert and projection)."""
    chosen, _ = targets(model, config)
    names = list(chosen)
    for name, ex in expert_targets(model, config)[0].items():
        _replace(model, name, QuantExperts.layout(ex, config))
        E = ex.n_experts
        names += [f"{name}.{part}.{e}" for part in ("gate_up", "down") for e in range(E)]
    V = model.config.vocab_size
    for name, linear in chosen.items():
        rows = V if name == "lm_head" else linear.out_features
        bias_dtype = None if linear.bias is None else linear.bias.dtype
        device = linear.weight.device
        if config.method == "int8":
            module = LAYERS["int8"](linear.in_features, rows, linear.bias is not None, bias_dtype, device)
        else:
            module = LAYERS["int4"](linear.in_features, rows, linear.bias is not None, config.group_size,
                                    bias_dtype, device)
        _replace(model, name, module)
    return names


def weight_bytes(model_config, quant: QuantConfig | None, dtype_bytes: int = 2) -> int:
    """Bytes of the parameters of a model of `model_config` with its weights quantized by `quant`
    (None: none), the rest in a dtype of `dtype_bytes` bytes, computed on the meta device (nothing
    allocated)."""
    from logitlab.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_config)
    total = sum(p.numel() for p in model.parameters()) * dtype_bytes   # a tied head counted once
    if quant is None:
        return total
    chosen, _ = targets(model, quant)
    V = model_config.vocab_size
    for name, linear in chosen.items():
        N, K = (V if name == "lm_head" else linear.out_features), linear.in_features
        total -= linear.weight.numel() * dtype_bytes                # the dense weight, padded rows included
        if quant.method == "int8":
            total += N * K + 2 * N                                  # int8 values, a bf16 scale per row
        else:
            total += N * K // 2 + 3 * N * (K // quant.group_size)   # 4-bit values, bf16 scale + uint8 zero
    for ex in expert_targets(model, quant)[0].values():
        E, two_f, D = ex.gate_up_proj.shape
        total += expert_bytes(E, D, two_f // 2, quant) - (ex.gate_up_proj.numel() + ex.down_proj.numel()) * dtype_bytes
    return total


def quantization_of(model: nn.Module) -> QuantConfig | None:
    """The QuantConfig that quantize_model(model, ...) was called with, read from the layers
    (None for a model that is not quantized): quantized_layout(fresh model, it) rebuilds them."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return None
    head = model.config.tie_embeddings or isinstance(getattr(model, "lm_head", None), QuantLinear)
    return QuantConfig(layers[0].method, getattr(layers[0], "group_size", QuantConfig.group_size), head)


def quantized_sizes(model_config) -> dict[str, int]:
    """{"int8": bytes, "int4 g128": ..., "int4 g64": ..., "int4 g32": ...}: weight_bytes of the
    model quantized each way (the rest in bf16), as `logitlab params` shows them."""
    sizes = {"int8": weight_bytes(model_config, QuantConfig("int8"))}
    for group in (128, 64, 32):
        sizes[f"int4 g{group}"] = weight_bytes(model_config, QuantConfig("int4", group))
    return sizes
