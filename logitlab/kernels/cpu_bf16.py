"""bf16 matrix products on CPU through float32 GEMMs, installed into a built model from outside.

A float32 GEMM over bf16-rounded operands computes what a bf16 GEMM computes: the product of
two bf16 numbers is exact in float32, and bf16 kernels accumulate in float32 too; only the
summation order differs, as between any two kernels. The result is rounded to bf16, as autocast's
is. Some CPUs run their float32 GEMMs faster than their bf16 ones, so the route can be the faster
one; which is faster is measured (install(model, "auto")), never guessed from CPU flags.

    handle = install(model, "auto")   # "native": nothing; "fp32": always; "auto": the faster
    handle.route, handle.timings      # what was chosen and the two measured times
    handle.remove()                   # the model's classes and head product as they were

The reference is F.linear under bf16 autocast (or on bf16 tensors); `linear` here must equal it
up to summation order (tests/test_layers.py). Products with few rows (a decode step) and every
product that is not a bf16 product on CPU run F.linear itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.transformer import Transformer

MODES = ("auto", "native", "fp32")
# Rows below which converting the weight to float32 costs more than the faster GEMM saves; larger
# weights (an LM head, whose conversion streams from DRAM) need more rows.
MIN_ROWS = 128
MIN_ROWS_LARGE = 512
LARGE_WEIGHT = 1 << 22                                             # elements (16 MiB in fp32)
MEASURE_ROWS = 512

MEASURED: dict[tuple[str, tuple[int, ...], int], dict[str, float]] = {}
"""Per-process measurement cache of install(..., "auto"): (device type, weight shape, rows) ->
{"native": seconds, "fp32": seconds}, the best timed product of each route. Filled on first
use, never written to disk; clear it to measure again."""


def wants_fp32_route(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when x @ weight^T is a bf16 product on CPU (bf16 autocast, or bf16 x and weight) with
    enough rows for the float32 GEMM to pay for converting the weight."""
    if x.device.type != "cpu":
        return False
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return False
    elif x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    rows = x.numel() // x.shape[-1]
    large = weight.numel() > LARGE_WEIGHT
    return rows >= (MIN_ROWS_LARGE if large else MIN_ROWS)


@torch.library.custom_op("logitlab::bf16_addmm_via_fp32", mutates_args=())
def _bf16_addmm_via_fp32(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """round_bf16(a (M, K)) @ round_bf16(b (K, N)) [+ round_bf16(bias (N,))] -> (M, N) bf16, by a
    float32 GEMM; the operands may be bf16 already (then the rounding is exact).

    An operator of its own (opaque to torch.compile), so that its operands are really rounded to
    bf16 and its result is rounded to bf16 whether it runs eagerly or compiled: inductor would
    otherwise fuse a bf16 -> float32 round trip into its neighbours and skip the rounding. A
    float32 weight goes in as it is and is rounded inside: outside, a compiled training graph
    would keep a bf16 copy of every weight from forward to backward."""
    with torch.autocast("cpu", enabled=False):
        a32, b32 = a.to(torch.bfloat16).float(), b.to(torch.bfloat16).float()
        bias32 = None if bias is None else bias.to(torch.bfloat16).float()
        out = torch.mm(a32, b32) if bias32 is None else torch.addmm(bias32, a32, b32)
    return out.to(torch.bfloat16)


@_bf16_addmm_via_fp32.register_fake
def _(a, b, bias):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


class Bf16LinearViaFp32(torch.autograd.Function):
    """y = round_bf16(x_bf16 @ w_bf16^T + b_bf16) through float32 GEMMs, forward and backward.

    Saves the bf16 input (as autocast does) and the weight itself (a Parameter, no copy); each
    gradient is a bf16 product cast to its input's dtype, as under autocast."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        N, K = weight.shape
        xb = x.to(torch.bfloat16).reshape(-1, K)                   # (M, K)
        y = torch.ops.logitlab.bf16_addmm_via_fp32(xb, weight.t(), bias)   # weight rounded inside
        ctx.save_for_backward(xb, weight)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], N)                            # (..., N) bf16

    @staticmethod
    def backward(ctx, grad_y):
        xb, weight = ctx.saved_tensors
        N, K = weight.shape
        gy = grad_y.to(torch.bfloat16).reshape(-1, N)              # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:                                # (M, N) @ (N, K)
            grad_x = torch.ops.logitlab.bf16_addmm_via_fp32(gy, weight, None)
            grad_x = grad_x.to(ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:                                # (N, M) @ (M, K)
            grad_w = torch.ops.logitlab.bf16_addmm_via_fp32(gy.t(), xb, None).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = gy.float().sum(0).to(torch.bfloat16).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with a bf16 product on CPU through a float32 GEMM when wants_fp32_route."""
    if wants_fp32_route(x, weight):
        return Bf16LinearViaFp32.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Bf16ViaFp32Linear(nn.Linear):
    """nn.Linear (same parameters, state-dict keys, hooks) whose forward is `linear` above; install
    swaps the class of a model's nn.Linear modules to this one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# ------------------------------------------------------------------------------------------
# "auto": measure both routes once per shape
# ------------------------------------------------------------------------------------------

def native_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference route under bf16 autocast: F.linear."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.linear(x, weight)


def fp32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float32-GEMM route under bf16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return Bf16LinearViaFp32.apply(x, weight, None)


def best_time(fn, *args, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` calls of fn(*args), after one warm-up call."""
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def measure(weight: torch.Tensor, rows: int = MEASURE_ROWS) -> dict[str, float]:
    """{"native": s, "fp32": s}: one (rows, K) bf16 product with `weight` (N, K) by each route,
    best of a few, cached in MEASURED."""
    key = (weight.device.type, tuple(weight.shape), rows)
    if key not in MEASURED:
        w = weight.detach()
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, torch.bfloat16)
        with torch.no_grad():
            MEASURED[key] = {"native": best_time(native_product, x, w), "fp32": best_time(fp32_product, x, w)}
    return MEASURED[key]


# ------------------------------------------------------------------------------------------
# Installing
# ------------------------------------------------------------------------------------------

@dataclass
class Installed:
    """What install did: `route` ("native": nothing installed, or "fp32"), `timings` ({"native":
    s, "fp32": s} when "auto" measured, else None) and `weight_shape` (the product measured).
    remove() restores the swapped classes and head products exactly."""

    mode: str
    route: str
    timings: dict[str, float] | None = None
    weight_shape: tuple[int, ...] | None = None
    _classes: list[tuple[nn.Module, type]] = field(default_factory=list, repr=False)
    _heads: list[tuple[Transformer, object]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        for module, cls in reversed(self._classes):
            module.__class__ = cls
        for model, head in reversed(self._heads):
            model.head_matmul = head
        self._classes, self._heads = [], []


def install(model: nn.Module, mode: str) -> Installed:
    """Route the bf16 products of `model` on CPU through float32 GEMMs.

    mode "native": install nothing; "fp32": swap the class of every plain nn.Linear module to
    Bf16ViaFp32Linear and route each Transformer's padded LM-head product (head_matmul) through
    `linear`; "auto": measure both routes once at the model's largest Linear weight (MEASURE_ROWS
    rows, see measure) and install "fp32" only when it is the faster; a model not on the CPU gets
    "native". Products that are not bf16 products on CPU, or have few rows, run as before either
    way. -> Installed; its remove() undoes this."""
    if mode not in MODES:
        raise ValueError(f"bf16 matmul mode must be one of {MODES}, got {mode!r}")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    handle = Installed(mode=mode, route="native" if mode == "native" else "fp32")
    if mode == "auto":
        weight = max((m.weight for m in linears), key=lambda w: w.numel(), default=None)
        if weight is None or weight.device.type != "cpu":
            handle.route = "native"
        else:
            handle.timings, handle.weight_shape = measure(weight), tuple(weight.shape)
            handle.route = "fp32" if handle.timings["fp32"] < handle.timings["native"] else "native"
    if handle.route == "fp32":
        for module in linears:
            handle._classes.append((module, type(module)))
            module.__class__ = Bf16ViaFp32Linear
        for sub in model.modules():
            if isinstance(sub, Transformer):
                handle._heads.append((sub, sub.head_matmul))
                sub.head_matmul = linear
    return handle
