"""bf16 matrix products and attention on CPU through float32 kernels, installed into a built
model from outside.

A float32 GEMM over bf16-rounded operands computes what a bf16 GEMM computes: the product of
two bf16 numbers is exact in float32, and bf16 kernels accumulate in float32 too; only the
summation order differs, as between any two kernels. The result is rounded to bf16, as autocast's
is. Some CPUs run their float32 GEMMs faster than their bf16 ones (a CPU without bf16
instructions runs bf16 products through a slow generic loop), so the route can be the faster
one; which is faster is measured (install(model, "auto")), never guessed from CPU flags.

Attention gets the same treatment on its own measurement: SDPA over the bf16 q, k, v upcast to
float32 (exactly), its output rounded to bf16. The bf16 kernel rounds its softmax weights to
bf16 before multiplying them with V; the float32 route keeps them in float32, so it is the same
attention, computed at least as accurately (tests/test_layers.py holds both to a float64
reference).

    handle = install(model, "auto", seq_len=256)   # "native": nothing; "fp32": always; "auto": the faster
    handle.route, handle.timings                   # the products: what was chosen, the two times
    handle.attention_route, handle.attention_timings   # attention: the same, forward + backward
    handle.remove()                                # the model's classes and head product as they were

The reference is F.linear (and SDPA) under bf16 autocast, or on bf16 tensors; `linear` here must
equal it up to summation order (tests/test_layers.py). Products with few rows (a decode step),
attention with few queries, and everything that is not a bf16 product on CPU run the plain
kernels themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.attention import Attention
from logitlab.model.transformer import Transformer

MODES = ("auto", "native", "fp32")
# Rows below which converting the weight to float32 costs more than the faster GEMM saves; larger
# weights (an LM head, whose conversion streams from DRAM) need more rows.
MIN_ROWS = 128
MIN_ROWS_LARGE = 512
LARGE_WEIGHT = 1 << 22                                             # elements (16 MiB in fp32)
MEASURE_ROWS = 512
# Queries below which attention keeps the bf16 kernel: a decode step (T = 1) would upcast the
# whole K/V cache for one query row.
MIN_QUERIES = 16
MEASURE_QUERIES = 256            # the attention measured: one sequence of this many positions (or seq_len)
# "auto" takes a float32 route only where it measured at most this fraction of the native route's
# time: a near tie keeps the plain kernels. Timings on a shared machine move by several percent
# between calls, and inside a compiled step the route's casts cost more than in the measurement
# (one CPU measured attention at 10.8 ms by the float32 route against 12.1 ms, yet in its compiled
# GPT-2 small bf16 step the route's casts took 0.26 s where SDPA saved 0.14 s).
PROVEN = 0.9

MEASURED: dict[tuple[str, tuple[int, ...], int], dict[str, float]] = {}
"""Per-process measurement cache of install(..., "auto"): (device type, weight shape, rows) ->
{"native": seconds, "fp32": seconds}, the best timed product of each route, and ("attention",
H, Hkv, T, Dh) -> the same for one sequence's attention forward and backward. Filled on first
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


def wants_fp32_attention(q: torch.Tensor) -> bool:
    """True when attention over q (B, H, T, Dh) is a bf16 attention on CPU with at least
    MIN_QUERIES queries (under autocast q is bf16: the projection's output)."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[-2] >= MIN_QUERIES


def attention_via_fp32(attend, q, k, v, mask, is_causal):
    """round_bf16(attend(q, k, v) in float32): `attend` (Attention._attend's SDPA route) over the
    bf16 q (B, H, T, Dh), k, v (B, Hkv, S, Dh) upcast to float32 (exact), autocast off so that
    it stays float32; a float mask (ALiBi's bias) is upcast too. -> out (B, H, T, Dh) bf16."""
    with torch.autocast("cpu", enabled=False):
        mask32 = mask.float() if mask is not None and mask.is_floating_point() else mask
        out = attend(q.float(), k.float(), v.float(), mask32, is_causal)
    return out.to(q.dtype)


class Bf16ViaFp32Attention(Attention):
    """Attention (same parameters, keys, projections, cache) whose SDPA route runs in float32 for
    a bf16 attention on CPU with enough queries (wants_fp32_attention); everything else, the eager
    reference and need_weights among it, runs as in Attention. install swaps the class of a
    model's Attention modules to this one."""

    def _attend(self, q, k, v, mask, is_causal, impl, need_weights):
        """q (B, H, T, Dh), k, v (B, Hkv, S, Dh) -> (out (B, H, T, Dh), weights or None)."""
        if need_weights or impl == "eager" or self.sinks is not None or not wants_fp32_attention(q):
            return super()._attend(q, k, v, mask, is_causal, impl, need_weights)

        def sdpa(q, k, v, mask, is_causal):
            return super(Bf16ViaFp32Attention, self)._attend(q, k, v, mask, is_causal, impl, False)[0]
        return attention_via_fp32(sdpa, q, k, v, mask, is_causal), None


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


def best_time(fn, *args, repeats: int = 3, losing: float = float("inf")) -> float:
    """Seconds of the fastest of `repeats` calls of fn(*args), after one warm-up call; stops
    early once a timed call takes longer than `losing` (that call's time is then returned: enough
    to tell that fn is the slower route without timing it again)."""
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
        if best > losing:
            break
    return best


def race(fp32, native, *args) -> dict[str, float]:
    """{"fp32": s, "native": s}: the best time of each route over args; the native route stops
    being timed once a call takes more than twice the fp32 route's best (see best_time)."""
    fast = best_time(fp32, *args)
    return {"native": best_time(native, *args, losing=2 * fast), "fp32": fast}


def _sdpa(q, k, v, mask, is_causal):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def native_attention(q, k, v) -> torch.Tensor:
    """The reference route: causal SDPA over bf16 q, k, v, forward and backward."""
    out = _sdpa(q, k, v, None, True)
    out.float().sum().backward()
    return out


def fp32_attention(q, k, v) -> torch.Tensor:
    """The float32 route (attention_via_fp32), forward and backward."""
    out = attention_via_fp32(_sdpa, q, k, v, None, True)
    out.float().sum().backward()
    return out


def measure_attention(heads: int, kv_heads: int, queries: int, head_dim: int) -> dict[str, float]:
    """{"native": s, "fp32": s}: causal attention over one sequence of `queries` positions (bf16
    q (1, heads, T, Dh), k and v (1, kv_heads, T, Dh)), forward and backward by each route, best
    of a few, cached in MEASURED."""
    key = ("attention", heads, kv_heads, queries, head_dim)
    if key not in MEASURED:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, queries, head_dim, generator=g).to(torch.bfloat16).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        MEASURED[key] = race(fp32_attention, native_attention, q, k, v)
    return MEASURED[key]


def measure(weight: torch.Tensor, rows: int = MEASURE_ROWS) -> dict[str, float]:
    """{"native": s, "fp32": s}: one (rows, K) bf16 product with `weight` (N, K) by each route,
    best of a few, cached in MEASURED."""
    key = (weight.device.type, tuple(weight.shape), rows)
    if key not in MEASURED:
        w = weight.detach()
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, torch.bfloat16)
        with torch.no_grad():
            MEASURED[key] = race(fp32_product, native_product, x, w)
    return MEASURED[key]


# ------------------------------------------------------------------------------------------
# Installing
# ------------------------------------------------------------------------------------------

@dataclass
class Installed:
    """What install did: `route` ("native": nothing installed, or "fp32"), `timings` ({"native":
    s, "fp32": s} when "auto" measured, else None) and `weight_shape` (the product measured);
    the same for attention: `attention_route`, `attention_timings` and `attention_shape` (H, Hkv,
    T, Dh). remove() restores the swapped classes and head products exactly."""

    mode: str
    route: str
    timings: dict[str, float] | None = None
    weight_shape: tuple[int, ...] | None = None
    attention_route: str = "native"
    attention_timings: dict[str, float] | None = None
    attention_shape: tuple[int, ...] | None = None
    _classes: list[tuple[nn.Module, type]] = field(default_factory=list, repr=False)
    _heads: list[tuple[Transformer, object]] = field(default_factory=list, repr=False)

    def record(self) -> dict:
        """What was chosen and measured, for a run's metrics: JSON-ready."""
        return {"bf16_route": self.route, "bf16_route_timings_s": self.timings,
                "bf16_attention_route": self.attention_route, "bf16_attention_timings_s": self.attention_timings}

    def remove(self) -> None:
        for module, cls in reversed(self._classes):
            module.__class__ = cls
        for model, head in reversed(self._heads):
            model.head_matmul = head
        self._classes, self._heads = [], []


def install(model: nn.Module, mode: str, seq_len: int | None = None) -> Installed:
    """Route the bf16 products and attention of `model` on CPU through float32 kernels.

    mode "native": install nothing; "fp32": swap the class of every plain nn.Linear module to
    Bf16ViaFp32Linear, route each Transformer's padded LM-head product (head_matmul) through
    `linear`, and swap every plain Attention to Bf16ViaFp32Attention; "auto": measure each route
    once, the products at the model's largest Linear weight (MEASURE_ROWS rows, see measure),
    attention at its heads over one sequence of seq_len positions (MEASURE_QUERIES when None; see
    measure_attention), and install each only where it is clearly the faster (chosen: at most
    PROVEN of the native time); a model not on the CPU gets "native". Products that are not bf16
    products on CPU, or have few rows, run as before either way. -> Installed; its remove()
    undoes this."""
    if mode not in MODES:
        raise ValueError(f"bf16 matmul mode must be one of {MODES}, got {mode!r}")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len must be a positive number of positions, got {seq_len}")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    attentions = [m for m in model.modules() if type(m) is Attention]
    first = next(model.parameters(), None)
    on_cpu = first is not None and first.device.type == "cpu"
    route = "native" if mode == "native" else "fp32"
    handle = Installed(mode=mode, route=route, attention_route=route if attentions else "native")
    if mode == "auto":
        _measure_routes(handle, linears, attentions, on_cpu, seq_len)
    if handle.route == "fp32":
        for module in linears:
            handle._classes.append((module, type(module)))
            module.__class__ = Bf16ViaFp32Linear
        for sub in model.modules():
            if isinstance(sub, Transformer):
                handle._heads.append((sub, sub.head_matmul))
                sub.head_matmul = linear
    if handle.attention_route == "fp32":
        for module in attentions:
            handle._classes.append((module, type(module)))
            module.__class__ = Bf16ViaFp32Attention
    return handle


def chosen(timings: dict[str, float]) -> str:
    """"fp32" where the float32 route measured at most PROVEN of the native route's time, else
    "native" (the plain kernels keep a near tie)."""
    return "fp32" if timings["fp32"] <= PROVEN * timings["native"] else "native"


def _measure_routes(handle: Installed, linears: list, attentions: list, on_cpu: bool, seq_len: int | None) -> None:
    """install's "auto": time each route and keep the chosen one (see chosen) on `handle`."""
    weight = max((m.weight for m in linears), key=lambda w: w.numel(), default=None)
    if weight is None or not on_cpu:
        handle.route = "native"
    else:
        handle.timings, handle.weight_shape = measure(weight), tuple(weight.shape)
        handle.route = chosen(handle.timings)
    if not attentions or not on_cpu:
        handle.attention_route = "native"
        return
    a = attentions[0]
    handle.attention_shape = (a.n_heads, a.n_kv_heads, seq_len or MEASURE_QUERIES, a.head_dim)
    handle.attention_timings = measure_attention(*handle.attention_shape)
    handle.attention_route = chosen(handle.attention_timings)
