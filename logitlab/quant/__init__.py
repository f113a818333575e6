"""Quantized weights: the plain quantize / dequantize / matmul math (reference.py), the layers
that hold int8 and int4 weights (linear.py), quantizing a built model from outside (apply.py),
the CPU kernels measured against the reference (routes.py; int8 x int8 products in int8dot.py and
the optional C extension _int8dot.c) and GGUF files (gguf.py).

Quantization changes the numbers, so it is not a kernel: it is applied to a built model from
outside, like the kernels, and its fast paths must equal its own reference, not the unquantized
model. The names are resolved on first use (PEP 562)."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "Int4Linear": "linear",
    "Int8Linear": "linear",
    "QuantConfig": "linear",
    "QuantReport": "apply",
    "quantize_model": "apply",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
