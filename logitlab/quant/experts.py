"""Quantized experts: a mixture of experts' stacked weights as one quantized layer per projection.

experts.py owns QuantExperts, what quantize_model puts in place of an MoE block's Experts. An
Experts module stacks its E experts' weights ((E, 2F, D) gate_up_proj, (E, D, F) down_proj); here
each expert's two projections become the quantized linear layers of linear.py (int8 per row or
int4 in groups), so every expert has exactly the bytes, scales and kernels a dense layer of its
shape would have, and the routes (routes.py) install their kernels on them like on any other:

    experts.gate_up.{e}  Int8Linear / Int4Linear  D -> 2F   (rows: gate, then up; bias: gate_up_bias[e])
    experts.down.{e}     Int8Linear / Int4Linear  F -> D    (bias: down_bias[e])
    experts.compute_dtype  an empty tensor in the model's floating dtype (what `stacked` builds)

The forms of model/moe.py run unchanged: the reference loop and the sorted dispatch reach the
experts through `expert` and `products` (each group of rows through its expert's two quantized
layers), and the gathered form (torch.compile's decode step) through `stacked`, the dequantized
weights, built on each call, in the dtype the experts were quantized from.
"""

from __future__ import annotations

import torch
from torch import nn

from logitlab.model.moe import Experts
from logitlab.quant.linear import LAYERS, QuantConfig, QuantLinear


def _layer(config: QuantConfig, in_features: int, out_features: int, bias: bool, bias_dtype, device) -> QuantLinear:
    """An empty quantized layer of this shape (for loading a saved quantized model)."""
    if config.method == "int8":
        return LAYERS["int8"](in_features, out_features, bias, bias_dtype, device)
    return LAYERS["int4"](in_features, out_features, bias, config.group_size, bias_dtype, device)


class QuantExperts(Experts):
    """E experts, each a quantized gate_up (D -> 2F) and down (F -> D) layer; see the module
    docstring. Built by from_experts (quantizing an Experts module) or empty by layout."""

    def __init__(self, source: Experts, gate_up: list[QuantLinear], down: list[QuantLinear], dtype: torch.dtype):
        nn.Module.__init__(self)                     # no stacked parameters: the layers hold the weights
        self.n_experts = source.n_experts
        self.clamped, self.alpha, self.limit = source.clamped, source.alpha, source.limit
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.gate_up_bias = self.down_bias = None
        # what `stacked` dequantizes to: an empty floating buffer, so model.to(dtype) and loading in
        # a dtype (which casts the state dict's floating tensors) carry it along
        self.register_buffer("compute_dtype", torch.empty(0, dtype=dtype, device=gate_up[0].qweight.device))

    @classmethod
    @torch.no_grad()
    def from_experts(cls, ex: Experts, config: QuantConfig) -> "QuantExperts":
        """Quantize each expert of `ex` (its weights and biases as they are now)."""
        layer = LAYERS[config.method]
        gate_up, down = [], []
        for w1, b1, w2, b2 in ex.per_expert():
            gate_up.append(layer.from_linear(_as_linear(w1, b1), config))
            down.append(layer.from_linear(_as_linear(w2, b2), config))
        return cls(ex, gate_up, down, ex.gate_up_proj.dtype)

    @classmethod
    def layout(cls, ex: Experts, config: QuantConfig) -> "QuantExperts":
        """Empty quantized layers of `ex`'s shapes on its device, for load_state_dict."""
        E, two_f, D = ex.gate_up_proj.shape
        device, bias = ex.gate_up_proj.device, ex.gate_up_bias is not None
        dtype = ex.gate_up_proj.dtype
        gate_up = [_layer(config, D, two_f, bias, dtype, device) for _ in range(E)]
        down = [_layer(config, two_f // 2, D, bias, dtype, device) for _ in range(E)]
        return cls(ex, gate_up, down, dtype)

    def stacked(self) -> tuple:
        """The dequantized (gate_up (E, 2F, D), gate_up_bias, down (E, D, F), down_bias), built
        now: for the gathered form only (the other forms multiply by the quantized layers)."""
        def stack(layers):
            return torch.stack([m.dequantized(self.compute_dtype.dtype) for m in layers])
        def biases(layers):
            return None if layers[0].bias is None else torch.stack([m.bias for m in layers])
        return stack(self.gate_up), biases(self.gate_up), stack(self.down), biases(self.down)

    def per_expert(self, stacked: tuple | None = None) -> "list[tuple] | _Dequantized":
        """Each expert's (gate_up, gate_up_bias, down, down_bias) as tensors, for the forms that
        multiply by tensors: split from `stacked` when given, else dequantized one expert at a
        time as a form asks for it (expert and products run the quantized layers instead)."""
        if stacked is not None:
            return super().per_expert(stacked)
        return _Dequantized(self)

    def expert(self, e: int, x: torch.Tensor, weights=None) -> torch.Tensor:
        """Expert e on x (n, D) -> (n, D): its quantized gate_up, the activation, its quantized
        down (`weights` is not needed: the layers hold them)."""
        return self.down[e](self.act(self.gate_up[e](x)))

    def products(self, rows: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor,
                 stacked: tuple | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        """rows (n, D) grouped by expert, counts[e] for expert e in turn -> (n, D): each non-empty
        group through its expert's quantized layers, times scale (n,) when given. With `stacked`
        (tensors, as expert parallelism passes its shard) the plain grouped products run."""
        if stacked is not None:
            return super().products(rows, counts, ids, stacked, scale)
        sizes = counts.tolist()
        scales = scale.split(sizes) if scale is not None else [None] * len(sizes)
        ys = [self.expert(e, chunk) * (1 if s is None else s[:, None].to(rows.dtype))
              for e, (chunk, s) in enumerate(zip(rows.split(sizes), scales)) if sizes[e]]
        return torch.cat(ys) if ys else rows

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}"


class _Dequantized:
    """Experts' weights by index, dequantized when asked: d[e] -> (gate_up (2F, D), gate_up_bias,
    down (D, F), down_bias) in the model's floating dtype."""

    def __init__(self, ex: QuantExperts):
        self.ex = ex

    def __len__(self) -> int:
        return self.ex.n_experts

    def __getitem__(self, e: int) -> tuple:
        g, d, dtype = self.ex.gate_up[e], self.ex.down[e], self.ex.compute_dtype.dtype
        return g.dequantized(dtype), g.bias, d.dequantized(dtype), d.bias


def _as_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A meta-built nn.Linear holding (views of) one expert's weight and bias."""
    out, inp = weight.shape
    linear = nn.Linear(inp, out, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def expert_targets(model: nn.Module, config: QuantConfig) -> tuple[dict[str, Experts], dict[str, str]]:
    """-> ({name: Experts to quantize}, {name: why it is kept}) for the MoE blocks of a model."""
    chosen, kept = {}, {}
    for name, module in model.named_modules():
        if type(module) is not Experts:
            continue
        E, two_f, D = module.gate_up_proj.shape
        if config.method == "int4" and (D % config.group_size or (two_f // 2) % config.group_size):
            kept[name] = (f"the experts' widths (d_model {D}, expert d_ff {two_f // 2}) are not multiples of "
                          f"the group size {config.group_size}")
            continue
        chosen[name] = module
    return chosen, kept


def expert_bytes(E: int, D: int, Fe: int, config: QuantConfig) -> int:
    """Bytes of E experts' gate_up (2F x D) and down (D x F) weights quantized by `config`
    (values, scales and zero points; biases not included)."""
    def layer(N: int, K: int) -> int:
        if config.method == "int8":
            return N * K + 2 * N                                    # int8 values, a bf16 scale per row
        return N * K // 2 + 3 * N * (K // config.group_size)        # 4-bit values, bf16 scale + uint8 zero
    return E * (layer(2 * Fe, D) + layer(D, Fe))
