"""Fast matmuls for quantized layers, installed where measured faster than the reference.

routes.py owns the fast paths of the quantized layers and the measurement that decides where
they run. Two kinds read the small integers directly instead of building a dequantized weight:

- "packed", torch's weight-only CPU kernels (the activations stay as they are):
  - int8: torch._weight_int8pack_mm(x (M, K), q (N, K) int8, scales (N,)) = x @ (q * s)^T, on the
    layer's own qweight; the scales in x's dtype.
  - int4: torch._weight_int4pack_mm_for_cpu(x, packed, G, scales_and_zeros (K/G, N, 2)) computes
    with w = (q - 8) * s + m per group; our (q - z) * s is that with m = (8 - z) * s. The weight
    is repacked once into the kernel's own layout (_convert_weight_to_int4pack_for_cpu); that copy
    is as large as qweight and lives beside it while the route is installed.
  Both take bf16, float16 or float32 activations. Their products equal the reference (dequantize,
  then F.linear) up to summation order and the rounding of the scales and zero terms to x's dtype
  (tests/test_quant.py). They need shapes the kernels accept (checked before any call: int8 with
  K % 32 != 0 reads past its rows) and a CPU.
- "int8dot": x is quantized to int8 per block of 32 columns as it arrives and multiplied by the
  int8 or int4 weight on integer dot-product instructions (int8dot.py, _int8dot.c; the extension
  is built at install when a C compiler is present), reading the layer's own tensors. Its products
  are reference.int8dot_linear and int4dot_linear, which differ from the weight-only ones by the
  activations' rounding: at most half a step of 1/254 of each block's largest |x|
  (tests/test_quant_int8dot.py). It takes float32 and bf16 activations on the CPU, K % 32 == 0.

    handle = install(model, "auto")   # "reference": nothing; "packed" / "int8dot": wherever allowed
    handle.route, handle.timings      # per (method, N, K): {"reference": s, "packed": s, ...}
    handle.remove()

"auto" times the routes once per process for each distinct layer shape, at one row (a decode
step) and at MEASURE_ROWS rows (a prefill), and installs the fastest route on a shape only where
it took at most PROVEN of the reference's time at both: a near tie keeps the reference. "auto"
considers int8dot only for bf16 activations, whose own rounding (8 significant bits) is of the
order of the 8-bit activations' (a float32 model keeps the weight-only products unless int8dot is
asked for by name).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from logitlab.quant import int8dot
from logitlab.quant.linear import Int4Linear, Int8Linear, QuantLinear

ROUTES = ("auto", "reference", "packed", "int8dot")
FAST = ("packed", "int8dot")
MEASURE_ROWS = 64
PROVEN = 0.9
MEASURED: dict[tuple, dict[str, float]] = {}
"""Per-process cache of "auto"'s timings: (method, N, K, G, dtype) -> {"reference": s, route: s, ...}."""


def supported(module: QuantLinear, route: str = "packed") -> bool:
    """Whether `route` ("packed" or "int8dot") takes this layer (its kind, its shape, this install)."""
    N, K = module.out_features, module.in_features
    if route == "int8dot":
        return K % 32 == 0 and int8dot.available()
    if isinstance(module, Int8Linear):
        return K % 32 == 0
    return N % 16 == 0 and K % 32 == 0


def candidates(module: QuantLinear, dtype: torch.dtype) -> list[str]:
    """The fast routes "auto" times for this layer at activations of `dtype` (module docstring)."""
    return [r for r in FAST if supported(module, r) and (r == "packed" or dtype == torch.bfloat16)]


def _int8_kernel(scales: torch.Tensor, dtype: torch.dtype):
    def kernel(module: Int8Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype or x.device.type != "cpu":
            return module.reference(x)
        return torch._weight_int8pack_mm(x.contiguous(), module.qweight, scales)           # (M, N)
    return kernel


def int4_operands(module: Int4Linear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed in the kernel's layout, scales_and_zeros (K/G, N, 2) in `dtype`) for an Int4Linear."""
    from logitlab.quant.reference import unpack_int4

    q = unpack_int4(module.qweight).to(torch.int32)                                        # (N, K)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    s = module.scales.float()                                                              # (N, K/G)
    m = (8 - module.zeros.float()) * s
    return packed, torch.stack((s, m), dim=-1).transpose(0, 1).contiguous().to(dtype)


def _int4_kernel(packed: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype):
    def kernel(module: Int4Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype or x.device.type != "cpu":
            return module.reference(x)
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, module.group_size, scales_and_zeros)
    return kernel


def _int8dot_kernel(module: QuantLinear):
    if isinstance(module, Int8Linear):
        tensors = (module.qweight, module.scales.float())
        product, op = int8dot.bind(*tensors), int8dot.linear_op
    else:
        tensors = (module.qweight, module.scales, module.zeros)
        product, op = int8dot.bind_int4(*tensors), int8dot.linear_int4_op

    def kernel(module: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in int8dot.DTYPES or x.device.type != "cpu":
            return module.reference(x)
        if torch.compiler.is_compiling():                  # one opaque operator in a compiled graph
            return op(x, *tensors)
        return product(x)                                                                  # (M, N)
    return kernel


def packed_kernel(module: QuantLinear, dtype: torch.dtype, route: str = "packed"):
    """The kernel of `route` for `module` at activations of `dtype`: a function (module, x2d) -> y2d
    (the reference for inputs of another dtype or device)."""
    if route == "int8dot":
        return _int8dot_kernel(module)
    if isinstance(module, Int8Linear):
        return _int8_kernel(module.scales.to(dtype), dtype)
    return _int4_kernel(*int4_operands(module, dtype), dtype)


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------

def _best(fn, x: torch.Tensor, repeats: int = 5) -> float:
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def measure(module: QuantLinear, dtype: torch.dtype) -> dict[str, float]:
    """{"reference": s, route: s for each of candidates()}: the sum of the best times at 1 and
    MEASURE_ROWS rows of x in `dtype` (random, seeded), cached in MEASURED by the layer's shape.
    A route that loses at either size gets inf (it is not proven)."""
    key = (module.method, module.out_features, module.in_features, getattr(module, "group_size", None), dtype)
    if key not in MEASURED:
        routes = candidates(module, dtype)
        kernels = {r: packed_kernel(module, dtype, r) for r in routes}
        total = dict.fromkeys(["reference", *routes], 0.0)
        g = torch.Generator().manual_seed(0)
        for rows in (1, MEASURE_ROWS):
            x = torch.randn(rows, module.in_features, generator=g).to(dtype)
            ref_s = _best(module.reference, x)
            total["reference"] += ref_s
            for r, kernel in kernels.items():
                fast_s = _best(lambda t, kernel=kernel: kernel(module, t), x)
                total[r] += fast_s if fast_s <= PROVEN * ref_s else float("inf")
        MEASURED[key] = total
    return MEASURED[key]


def fastest(timings: dict[str, float]) -> str:
    """The route "auto" installs from measure()'s timings: the fastest taking at most PROVEN of
    the reference's time, else "reference"."""
    best = min((t, r) for r, t in timings.items() if r != "reference")[1] if len(timings) > 1 else "reference"
    return best if timings.get(best, float("inf")) <= PROVEN * timings["reference"] else "reference"


# --------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------

@dataclass
class Installed:
    """What install did: the mode, the route of each layer shape ("reference", "packed" or
    "int8dot") and, for "auto", the timings behind it; `layers` the number of layers given a fast
    route. remove() takes the kernels (and their repacked copies) away again."""

    mode: str
    routes: dict[str, str] = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    layers: int = 0
    _modules: list[QuantLinear] = field(default_factory=list, repr=False)

    @property
    def route(self) -> str:
        """The one route every shape took ("reference" when none did a fast one), else "mixed"."""
        chosen = set(self.routes.values())
        return chosen.pop() if len(chosen) == 1 else ("mixed" if chosen else "reference")

    def remove(self) -> None:
        for module in self._modules:
            module.kernel = None
        self._modules = []


def _shape_name(module: QuantLinear) -> str:
    extra = f" G{module.group_size}" if isinstance(module, Int4Linear) else ""
    return f"{module.method} {module.out_features}x{module.in_features}{extra}"


def _route(handle: Installed, module: QuantLinear, mode: str, dtype: torch.dtype) -> str:
    """The route of `module` under `mode`, timed once per shape for "auto"."""
    name = _shape_name(module)
    if module.qweight.device.type != "cpu" or mode == "reference":
        return "reference"
    if mode != "auto":
        return mode if supported(module, mode) else "reference"
    if not candidates(module, dtype):
        return "reference"
    if name not in handle.timings:
        handle.timings[name] = measure(module, dtype)
    return fastest(handle.timings[name])


def install(model: torch.nn.Module, mode: str = "auto", dtype: torch.dtype | None = None) -> Installed:
    """Give the quantized layers of `model` fast products: nowhere ("reference"), the named route
    wherever it takes the layer ("packed", "int8dot"), or the fastest where measured faster ("auto";
    see the module docstring). dtype: the activations' dtype (default: the model's floating
    parameters' dtype). A model not on the CPU keeps the reference. -> Installed (remove() undoes it)."""
    if mode not in ROUTES:
        raise ValueError(f"quantized matmul route must be one of {ROUTES}, got {mode!r}")
    floats = [p for p in model.parameters() if p.is_floating_point()]
    dtype = dtype or (floats[0].dtype if floats else torch.float32)
    handle = Installed(mode)
    for module in (m for m in model.modules() if isinstance(m, QuantLinear)):
        route = handle.routes[_shape_name(module)] = _route(handle, module, mode, dtype)
        if route != "reference":
            module.kernel = packed_kernel(module, dtype, route)
            handle._modules.append(module)
    handle.layers = len(handle._modules)
    return handle
