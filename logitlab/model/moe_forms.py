"""The forms of a mixture-of-experts layer's expert products, and the measurement behind
MoE.impl "auto". moe.py owns the layer (router, stacked experts, shared expert); this module owns
how the routed tokens meet their experts. Every form maps

    x (N, D), weights (N, K), experts (N, K), keep (N, K) bool or None -> (N, D)

to each token's weighted sum of its K experts' outputs, the same values (tests/test_moe.py):

- experts_loop, "loop": for each expert, the (token, slot) pairs routed to it found by a mask,
  through it, weighted, added back: the reference, read by eye;
- experts_sorted, "sorted": the assignments sorted by expert once, then expert by expert over its
  contiguous run of rows: its tokens gathered, through it, weighted, added back. One product per
  expert, as in the loop, without a mask per expert; experts without rows cost nothing; the
  intermediates are one expert's rows at a time (no (N * K, 2F) buffer to map and free);
- experts_grouped, "grouped": the same sort and gather, then all experts at once
  (Experts.products: torch's grouped matrix product where it takes the rows, one call per
  projection; a Triton kernel or expert parallelism replace that method), added back in one
  scatter. Without capacity (dropless) it has no host sync when the grouped product runs;
- experts_gather, "gather": each token multiplies its own K experts' gathered weights (copies of
  them): static shapes and no host sync, for a handful of tokens under torch.compile.

The router's weight of each (token, expert) row is applied on the narrower side of the down
projection: to the hidden row (F wide) before it when F <= D (fine-grained experts) and the
expert has no down bias, else to its output (D wide).

"auto" (choose_form) takes "sorted" or "grouped" by a measurement on the machine that runs it:
each form's forward on this layer's weights, for the call's shape (token counts rounded up to a
power of two), timed once per process and kept in MEASURED. "grouped" is taken only where it
measured at most PROVEN of "sorted"'s time; where nothing may be timed (torch.compile tracing,
a dispatch mode) choose_form says what it takes. On a CPU, torch's grouped product is a loop of
matrix products inside one call: "grouped" saves the calls (small shapes, many experts with few
rows each), "sorted" the large intermediates (docs/benchmarks.md has the measurements). The two
run the same products and sums in the same order (on the CPU measured, to the same bits).

Shapes: N tokens, D d_model, E experts, K experts per token, F one expert's width, n kept
(token, expert) assignments (N * K when dropless).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

PROVEN = 0.9
MEASURED: dict[tuple, dict[str, float]] = {}
"""Per-process cache of "auto"'s measurements: (device type, dtype, autocast, E, K, D, F, biases,
activation, tokens rounded up to a power of two) -> {"sorted": s, "grouped": s}, the best forward
of each form. Filled on first use, never written to disk; clear it to measure again."""


# ------------------------------------------------------------------------------------------
# Sorting by expert, and the down projection with the router's weight
# ------------------------------------------------------------------------------------------

def sort_by_expert(experts: torch.Tensor, keep: torch.Tensor | None, n_experts: int):
    """The kept (token, slot) assignments of experts (N, K) ordered by expert, token order kept
    within one -> (used (n,) their flat indices t * K + k, counts (E,) per expert, ids (n,) their
    experts, token (n,) their tokens). Dropless (keep None) every assignment is kept: no host sync."""
    N, K = experts.shape
    flat = experts.reshape(-1)                                             # (N*K,)
    if keep is not None:
        flat = flat.masked_fill(~keep.reshape(-1), n_experts)              # dropped: a last group
    order = torch.argsort(flat, stable=True)                               # (N*K,) by expert
    counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts]     # (E,) rows per expert
    used = order if keep is None else order[:int(counts.sum())]            # the kept assignments
    return used, counts, flat[used], used // K


def weigh_hidden(w2: torch.Tensor, b2: torch.Tensor | None) -> bool:
    """Whether a row's router weight multiplies its hidden row (F wide) rather than its output (D
    wide): when F <= D (w2 (..., D, F)) and there is no down bias. Both give s * down(a)."""
    return b2 is None and w2.shape[-1] <= w2.shape[-2]


def expert_rows(ex, weights: tuple, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """rows (n, D) through one expert (weights: its (gate_up, gate_up_bias, down, down_bias)),
    each output times its router weight scale (n,) -> (n, D)."""
    w1, b1, w2, b2 = weights
    a = ex.act(F.linear(rows, w1, b1))                                     # (n, F)
    if weigh_hidden(w2, b2):
        return F.linear(a * scale[:, None], w2)
    return F.linear(a, w2, b2) * scale[:, None]


# ------------------------------------------------------------------------------------------
# The forms
# ------------------------------------------------------------------------------------------

def experts_loop(ex, x, weights, experts, keep=None) -> torch.Tensor:
    """The reference: for each expert, the (token, slot) pairs routed to it, through it, weighted,
    added to those tokens' outputs."""
    out = torch.zeros_like(x)
    routed = experts if keep is None else experts.masked_fill(~keep, -1)   # dropped: no expert
    per_expert = ex.per_expert()
    for e in range(ex.n_experts):
        token, slot = torch.nonzero(routed == e, as_tuple=True)
        if token.numel():
            y = ex.expert(e, x[token], per_expert) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
    return out


def experts_sorted(ex, x, weights, experts, keep=None) -> torch.Tensor:
    """Sorted runs: the assignments ordered by expert (sort_by_expert), then expert by expert over
    its contiguous run of rows: its tokens gathered, through it, weighted, added back. Experts
    without rows cost nothing; one host sync (the run lengths)."""
    used, counts, _, token = sort_by_expert(experts, keep, ex.n_experts)
    scale = weights.reshape(-1)[used].to(x.dtype)                          # (n,) each row's weight
    sizes = counts.tolist()                                                # (E,) the one host sync
    grad = torch.is_grad_enabled()
    if grad:                                 # gathered once, so that the backward scatters once
        runs = _runs(sizes, True, x.index_select(0, token), token, scale)
    else:                                    # gathered per run: no (n, D) buffer
        runs = [(e, x.index_select(0, t), t, s) for e, t, s in _runs(sizes, False, token, scale)]
    weights_of = _per_expert(ex, grad)
    out = torch.zeros_like(x)
    for e, rows, t, s in runs:                                             # rows (n_e, D)
        out.index_add_(0, t, expert_rows(ex, weights_of(e), rows, s).to(x.dtype))   # autocast: bf16 rows
    return out


def _runs(sizes: list[int], grad: bool, *tensors) -> list[tuple]:
    """[(e, run of each tensor), ...] for every expert e with rows, its run the sizes[e] entries
    after those of the experts before it. With gradients the tensors are split into all E runs
    (the backward joins the runs' gradients in one copy, where a slice's backward fills a zero
    gradient of the whole tensor, once per expert); without, only the non-empty runs are sliced
    (E views per tensor cost more than the work of a decode step with many experts)."""
    if grad:
        parts = [t.split(sizes) for t in tensors]
        return [(e, *(p[e] for p in parts)) for e, n in enumerate(sizes) if n]
    runs, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            runs.append((e, *(t[start:start + n] for t in tensors)))
        start += n
    return runs


def _per_expert(ex, grad: bool):
    """e -> expert e's (gate_up, gate_up_bias, down, down_bias): views of one unbind per tensor
    with gradients (Experts.per_expert: one stack in the backward), else indexed as needed."""
    if grad:
        return ex.per_expert().__getitem__
    stacked = ex.stacked()
    return lambda e: tuple(t[e] if t is not None else None for t in stacked)


def experts_grouped(ex, x, weights, experts, keep=None) -> torch.Tensor:
    """Sorted dispatch: the N*K assignments ordered by expert (token order kept within one), the
    tokens gathered in that order, every expert's rows through it at once (Experts.products,
    weighted), added back to their tokens in one scatter."""
    used, counts, ids, token = sort_by_expert(experts, keep, ex.n_experts)
    scale = weights.reshape(-1)[used].to(x.dtype)                          # (n,)
    y = ex.products(x.index_select(0, token), counts, ids, scale=scale)   # (n, D)
    return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def _grouped_mm_fits(rows: torch.Tensor) -> bool:
    """Whether torch's grouped matrix product takes these rows: a CPU (float32 or bfloat16, not
    float32 under torch.compile, whose kernel is bf16-only) or CUDA bfloat16 tensor whose rows are
    a multiple of 16 bytes."""
    if not hasattr(F, "grouped_mm") or rows.dtype not in (torch.float32, torch.bfloat16):
        return False
    if rows.dtype == torch.float32 and (rows.device.type != "cpu" or torch.compiler.is_compiling()):
        return False
    return rows.device.type in ("cpu", "cuda") and (rows.shape[-1] * rows.element_size()) % 16 == 0


def group_products(ex, rows: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor,
                   stacked: tuple | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """rows (n, D) grouped by expert, counts[e] of them for expert e in turn (ids[i]: row i's
    expert) -> each row through its expert, times scale[i] when given, (n, D): torch's grouped
    matrix product (one call per projection for all groups) where it takes the rows, else one
    product per non-empty group. stacked: the experts' tensors (ex.stacked() by default)."""
    w1, b1, w2, b2 = stacked or ex.stacked()
    Fe = w2.shape[-1]
    if not (_grouped_mm_fits(rows) and (Fe * rows.element_size()) % 16 == 0 and rows.shape[0]):
        return _products_per_group(ex, rows, counts, (w1, b1, w2, b2), scale)
    offs = counts.cumsum(0).to(torch.int32)                                # (E,) end of each group
    h = F.grouped_mm(rows, w1.transpose(1, 2), offs=offs)                  # (n, 2F)
    a = ex.act(h if b1 is None else h + b1[ids])                           # (n, F)
    early = scale is not None and weigh_hidden(w2, b2)
    if early:
        a = a * scale[:, None]
    y = F.grouped_mm(a, w2.transpose(1, 2), offs=offs)                     # (n, D)
    if b2 is not None:
        y = y + b2[ids]
    return y * scale[:, None] if scale is not None and not early else y


def _products_per_group(ex, rows, counts, stacked: tuple, scale) -> torch.Tensor:
    """group_products by one product per non-empty group, joined."""
    per_expert, sizes = ex.per_expert(stacked), counts.tolist()
    scales = scale.split(sizes) if scale is not None else [None] * len(sizes)
    ys = [ex.expert(e, chunk, per_expert) if s is None else expert_rows(ex, per_expert[e], chunk, s)
          for e, (chunk, s) in enumerate(zip(rows.split(sizes), scales)) if sizes[e]]
    return torch.cat(ys) if ys else rows


def experts_gather(ex, x, weights, experts, keep=None) -> torch.Tensor:
    """Each token through its own K experts' gathered weights: (N, K, 2F, D) and (N, K, D, F)
    copies, so meant for a handful of tokens (decoding)."""
    w1, b1, w2, b2 = ex.stacked()
    h = torch.einsum("nd,nkfd->nkf", x, w1[experts])                      # (N, K, 2F)
    if b1 is not None:
        h = h + b1[experts]
    y = torch.einsum("nkf,nkdf->nkd", ex.act(h), w2[experts])             # (N, K, D)
    if b2 is not None:
        y = y + b2[experts]
    w = weights if keep is None else weights * keep
    return torch.einsum("nkd,nk->nd", y, w.to(x.dtype)).to(x.dtype)           # autocast: x's dtype


FORMS = {"loop": experts_loop, "sorted": experts_sorted, "grouped": experts_grouped, "gather": experts_gather}


# ------------------------------------------------------------------------------------------
# "auto": the faster of sorted and grouped, measured
# ------------------------------------------------------------------------------------------

def choose_form(ex, x: torch.Tensor, k: int, products_replaced: bool = False) -> str:
    """"auto"'s form for x (N, D) routed to k experts per token:
    - while torch.compile traces: "gather" for a handful of tokens (N * k <= E: static shapes, no
      host sync, the compiled decode step), else "grouped";
    - "grouped" where Experts.products is replaced (products_replaced: a kernel's products, which
      only the grouped form calls), and where nothing may be timed: under a dispatch mode (a FLOP
      counter; selective activation checkpointing, whose recompute must replay the same ops), or
      off the CPU and CUDA;
    - else "grouped" where it measured at most PROVEN of "sorted"'s time for this shape
      (measure_forms), "sorted" otherwise."""
    if torch.compiler.is_compiling():
        return "gather" if x.shape[0] * k <= ex.n_experts else "grouped"
    if products_replaced or x.device.type not in ("cpu", "cuda") or is_in_torch_dispatch_mode():
        return "grouped"
    timings = measure_forms(ex, x, k)
    return "grouped" if timings["grouped"] <= PROVEN * timings["sorted"] else "sorted"


def measure_forms(ex, x: torch.Tensor, k: int, repeats: int = 5) -> dict[str, float]:
    """{"sorted": s, "grouped": s}: the best of `repeats` forwards (after one warm-up, the forms
    alternating) of each form on ex's weights, without gradients, over N random tokens routed to
    k experts each uniformly, N the call's token count rounded up to a power of two; cached in
    MEASURED."""
    w2 = ex.down_proj
    n = 1 << max(x.shape[0] - 1, 0).bit_length()                          # N rounded up to 2^i
    autocast = torch.is_autocast_enabled(x.device.type)
    key = (x.device.type, x.dtype, autocast, ex.n_experts, k, x.shape[1], w2.shape[-1],
           ex.gate_up_bias is not None, ex.clamped, n)
    if key not in MEASURED:
        g = torch.Generator().manual_seed(0)
        xs = torch.randn(n, x.shape[1], generator=g).to(x.device, x.dtype)
        experts = torch.rand(n, ex.n_experts, generator=g).topk(k, dim=-1).indices.to(x.device)
        weights = torch.softmax(torch.randn(n, k, generator=g), dim=-1).to(x.device)
        best = {"sorted": float("inf"), "grouped": float("inf")}
        with torch.no_grad():
            for i in range(repeats + 1):
                for name in best:
                    seconds = _timed(FORMS[name], ex, xs, weights, experts)
                    best[name] = min(best[name], seconds) if i else best[name]   # call 0: warm-up
        MEASURED[key] = best
    return MEASURED[key]


def _timed(form, ex, x, weights, experts) -> float:
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    form(ex, x, weights, experts)
    sync()
    return time.perf_counter() - start
