"""Quantized linear layers: what replaces an nn.Linear once its weight is int8 or int4.

linear.py owns QuantConfig (which method, which group size) and the two modules. Each holds its
weight in the reference form (reference.py) as buffers, so the state dict, a saved file and the
math a reader checks are the same tensors:

    Int8Linear:  qweight (N, K) int8, scales (N,) bf16                 [, bias (N,)]
    Int4Linear:  qweight (N, K/2) uint8 (two 4-bit values a byte), scales (N, K/G) bf16,
                 zeros (N, K/G) uint8                                 [, bias (N,)]

forward runs the reference matmul (dequantize, then F.linear in the input's dtype) unless a
faster kernel was installed from outside (routes.py sets `kernel`, a function (module, x2d) ->
y2d computing the same product); the bias, kept in its original dtype, is added after either.
Shapes: N out_features, K in_features, G group size, M rows of x (B*T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn

from logitlab.quant import reference as ref

METHODS = ("int8", "int4")


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model's linear layers (weight-only; activations stay in the model's dtype).

    method: "int8" (per output channel, symmetric) or "int4" (group-wise with zero points).
    group_size: columns per int4 group (32, 64 or 128; ignored by int8): smaller groups follow the
        weights more closely and cost more scales (3 bytes per group).
    head: quantize the LM head too (when it is not tied to the embedding table, which stays as it is).
    """

    method: Literal["int8", "int4"] = "int8"
    group_size: int = 64
    head: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.group_size not in ref.GROUP_SIZES:
            raise ValueError(f"group_size must be one of {ref.GROUP_SIZES}, got {self.group_size!r}")
        if not isinstance(self.head, bool):
            raise ValueError(f"head must be True or False, got {self.head!r}")

    def to_dict(self) -> dict:
        return {"method": self.method, "group_size": self.group_size, "head": self.head}

    @classmethod
    def from_dict(cls, data: dict) -> "QuantConfig":
        if not isinstance(data, dict) or set(data) - {"method", "group_size", "head"}:
            raise ValueError(f"a quantization config is an object with method, group_size and head, got {data!r}")
        return cls(**data)

    @property
    def label(self) -> str:
        """'int8' or 'int4 (group 64)'."""
        return self.method if self.method == "int8" else f"int4 (group {self.group_size})"


class QuantLinear(nn.Module):
    """The part both quantized layers share: sizes, the bias, the installed kernel."""

    kernel: Callable[["QuantLinear", torch.Tensor], torch.Tensor] | None

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None
        self.kernel = None

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype."""
        if self.kernel is None:
            y = self.reference(x)
        else:
            y = self.kernel(self, x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The weight (N, K) this layer multiplies by, in `dtype`."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of the quantized weight, its scales and zero points (the bias not included)."""
        return sum(t.numel() * t.element_size() for name, t in self.named_buffers() if "." not in name)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    """y = x @ (qweight * scales)^T + bias; see the module docstring."""

    method = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, bias_dtype=None, device=None):
        super().__init__(in_features, out_features, bias, bias_dtype, device)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.bfloat16, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig | None = None) -> "Int8Linear":
        w = linear.weight.detach()
        out = cls(w.shape[1], w.shape[0], linear.bias is not None,
                  None if linear.bias is None else linear.bias.dtype, w.device)
        out.qweight, out.scales = ref.quantize_int8(w)
        if linear.bias is not None:
            out.bias.data.copy_(linear.bias.detach())
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return ref.int8_linear(x, self.qweight, self.scales)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return ref.dequantize_int8(self.qweight, self.scales, dtype)


class Int4Linear(QuantLinear):
    """y = x @ ((q - zeros) * scales)^T + bias, q unpacked from qweight; see the module docstring."""

    method = "int4"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group_size: int = 64,
                 bias_dtype=None, device=None):
        ref.check_group_size(in_features, group_size)
        super().__init__(in_features, out_features, bias, bias_dtype, device)
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.bfloat16, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.uint8, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig) -> "Int4Linear":
        w = linear.weight.detach()
        out = cls(w.shape[1], w.shape[0], linear.bias is not None, config.group_size,
                  None if linear.bias is None else linear.bias.dtype, w.device)
        q, out.scales, out.zeros = ref.quantize_int4(w, config.group_size)
        out.qweight = ref.pack_int4(q)
        if linear.bias is not None:
            out.bias.data.copy_(linear.bias.detach())
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return ref.int4_linear(x, self.qweight, self.scales, self.zeros)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return ref.dequantize_int4(ref.unpack_int4(self.qweight), self.scales, self.zeros, dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


LAYERS = {"int8": Int8Linear, "int4": Int4Linear}
