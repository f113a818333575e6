"""The GPU check's Triton parts (bench.gpu_check runs each in a child process; on CPU the child
has TRITON_INTERPRET=1, so the kernels run in Triton's interpreter and only their errors mean
anything):

  kernels    the fused RMSNorm (kernels.triton_norm), SwiGLU (triton_swiglu) and LM head +
             cross-entropy (triton_cross_entropy) against the eager path they replace
             (model.norms.RMSNorm, silu(gate) * up, train.loss.cross_entropy of h @ W^T):
             error, fwd+bwd time and peak memory beyond the inputs;
  attention  FlashAttention (kernels.triton_attention) against F.scaled_dot_product_attention
             (the flash backend where it takes the case): the interpreter tests' shapes, then
             realistic ones (B 4-8, H 16-32, T 1k-8k, Dh 64/128, causal, GQA).

Errors are max |x - ref| / max |ref| over the output and over each gradient, against a float32
reference computed on the same inputs; "ok" applies the kernel tests' rule: in float32 within
2e-5, in 16-bit within 3x the error of the path it replaces plus a floor (1e-2 bf16, 2e-3 fp16).
The interpreter tests' shapes run first, the autotuned attention kernels with their first candidate
configuration only (errors, no timing): timing 72 candidates for each of those shapes would spend
the budget on shapes whose speed means nothing. The realistic shapes are autotuned as in use, and
"first call s" is that cost (autotuning and compiling, on a cold cache). TFLOP/s count 4 B H T S Dh
for the forward (halved when causal) and 2.5 times that for the backward.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.nn.functional as F

from bench.gpu_check import Rows, child_main, run_cases

FLOOR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def within(err: float, low_err: float, dtype: torch.dtype) -> bool:
    """The kernel tests' rule (see the module docstring)."""
    return err <= 2e-5 if dtype == torch.float32 else err <= 3 * low_err + FLOOR[dtype]


def fwd_bwd(fn, inputs: list[torch.Tensor], seed: torch.Tensor | None) -> list[torch.Tensor]:
    """[out, *gradients of out with respect to the floating inputs], the output weighted by seed
    (a scalar output: by 1)."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [x for x in leaves if x.requires_grad], seed if out.ndim else None)
    return [out.detach(), *grads]


def compare(fused, eager, inputs: list[torch.Tensor], seed: torch.Tensor | None, dtype: torch.dtype,
            reference=None) -> dict:
    """Errors of fused and eager (in the inputs' dtype) against reference (default: eager) run on
    float32 copies of the floating inputs: of the output, and the largest over the gradients."""
    wide = [x.float() if x.is_floating_point() else x for x in inputs]
    ref = fwd_bwd(reference or eager, wide, None if seed is None else seed.float())
    got, low = fwd_bwd(fused, inputs, seed), fwd_bwd(eager, inputs, seed)
    errs = {name: [rel_err(a, r) for a, r in zip(side, ref)] for name, side in (("fused", got), ("eager", low))}
    ok = all(within(a, b, dtype) for a, b in zip(errs["fused"], errs["eager"]))
    return {"err_fused": errs["fused"][0], "err_eager": errs["eager"][0], "grad_err_fused": max(errs["fused"][1:]),
            "grad_err_eager": max(errs["eager"][1:]), "ok": ok}


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def peak_extra_mib(fn) -> float:
    """GPU memory one call of fn allocates beyond what was allocated before it, at its peak (MiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def timed_pair(fused, eager, inputs, seed) -> dict:
    """fwd+bwd ms of both paths and their peak memory beyond the inputs (GPU only)."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    wrt = [x for x in leaves if x.requires_grad]

    def run(fn):
        def go():
            out = fn(*leaves)
            torch.autograd.grad(out, wrt, seed if out.ndim else None)
        return go
    fused_ms, eager_ms = bench_ms(run(fused)), bench_ms(run(eager))
    return {"fused_ms": fused_ms, "eager_ms": eager_ms, "speedup": eager_ms / fused_ms,
            "fused_peak_mib": peak_extra_mib(run(fused)), "eager_peak_mib": peak_extra_mib(run(eager))}


# --------------------------------------------------------------------------------------------
# The fused training kernels
# --------------------------------------------------------------------------------------------

def _randn(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def rmsnorm_case(N: int, D: int, dtype, device, timed: bool) -> dict:
    """x (N, D) and weight (D,) in dtype; the eager path is model.norms.RMSNorm's own forward."""
    from torch.func import functional_call

    from logitlab.kernels.triton_norm import rms_norm
    from logitlab.model.norms import RMSNorm

    norm = RMSNorm(D, 1e-6).to(device)

    def eager(x, w):
        return functional_call(norm, {"weight": w}, (x,))

    def fused(x, w):
        return rms_norm(x, w, 1e-6)

    inputs = [_randn(N, D, dtype=dtype, device=device), _randn(D, dtype=dtype, device=device)]
    seed = _randn(N, D, dtype=dtype, device=device)
    return {"kernel": "RMSNorm", **compare(fused, eager, inputs, seed, dtype),
            **(timed_pair(fused, eager, inputs, seed) if timed else {})}


def swiglu_case(N: int, Fw: int, dtype, device, timed: bool) -> dict:
    """gate|up (N, 2F) in dtype; the eager path is model.mlp.SwiGLU's silu(gate) * up."""
    from logitlab.kernels.triton_swiglu import swiglu

    def eager(gu):
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    inputs, seed = [_randn(N, 2 * Fw, dtype=dtype, device=device)], _randn(N, Fw, dtype=dtype, device=device)
    return {"kernel": "SwiGLU", **compare(swiglu, eager, inputs, seed, dtype),
            **(timed_pair(swiglu, eager, inputs, seed) if timed else {})}


def cross_entropy_case(N: int, D: int, V: int, dtype, device, timed: bool) -> dict:
    """h (N, D), an LM head W (V, D) in dtype, targets (N,); the eager path is
    train.loss.cross_entropy of the (N, V) logits h @ W^T (upcast to float32 inside)."""
    from logitlab.kernels.triton_cross_entropy import linear_cross_entropy
    from logitlab.train.loss import cross_entropy

    def eager(h, w, t):
        return cross_entropy((h @ w.t()).unsqueeze(0), t.unsqueeze(0))

    inputs = [_randn(N, D, dtype=dtype, device=device), _randn(V, D, dtype=dtype, device=device, scale=D ** -0.5),
              torch.randint(0, V, (N,), device=device)]
    return {"kernel": "linear cross-entropy", **compare(linear_cross_entropy, eager, inputs, None, dtype),
            **(timed_pair(linear_cross_entropy, eager, inputs, None) if timed else {})}


def part_kernels(spec: dict, rows: Rows) -> None:
    cpu = spec["cpu"]
    device, bf16 = ("cpu" if cpu else "cuda"), torch.bfloat16
    timed = not cpu
    if cpu:
        shapes = [("RMSNorm N64 D64 bf16", lambda: rmsnorm_case(64, 64, bf16, device, timed)),
                  ("SwiGLU N32 F96 bf16", lambda: swiglu_case(32, 96, bf16, device, timed)),
                  ("linear CE N16 D32 V300 bf16", lambda: cross_entropy_case(16, 32, 300, bf16, device, timed))]
    else:
        shapes = [("RMSNorm N16384 D4096 bf16", lambda: rmsnorm_case(16384, 4096, bf16, device, timed)),
                  ("SwiGLU N16384 F8192 bf16", lambda: swiglu_case(16384, 8192, bf16, device, timed)),
                  ("linear CE N8192 D768 V50257 bf16 (GPT-2)",
                   lambda: cross_entropy_case(8192, 768, 50257, bf16, device, timed)),
                  ("linear CE N8192 D1024 V248320 bf16 (Qwen3.5)",
                   lambda: cross_entropy_case(8192, 1024, 248320, bf16, device, timed))]
    run_cases([(name, _freeing(fn, cpu)) for name, fn in shapes], spec, rows)


def _freeing(fn, cpu: bool):
    """fn, then the GPU's cached blocks released, so that one case's memory is not the next's."""
    def run():
        try:
            return fn()
        finally:
            if not cpu:
                torch.cuda.empty_cache()
    return run


# --------------------------------------------------------------------------------------------
# FlashAttention
# --------------------------------------------------------------------------------------------

# the interpreter tests' shapes (tests/triton/test_triton_attention.py): B, H, Hkv, T, S, Dh, causal, dtype
EDGE_CASES = {
    "causal-ragged": (1, 2, 2, 37, 37, 24, True, torch.float32),
    "plain-ragged-S": (2, 2, 2, 20, 33, 16, False, torch.float32),
    "gqa-causal": (1, 4, 2, 21, 21, 32, True, torch.float32),
    "gqa-8": (1, 8, 1, 9, 9, 16, True, torch.float32),
    "chunk-after-cache": (1, 4, 2, 5, 40, 32, True, torch.float32),
    "decode-step": (2, 2, 1, 1, 29, 16, False, torch.float32),
    "decode-causal": (1, 2, 2, 1, 18, 16, True, torch.float32),
    "16-bit causal": (1, 4, 2, 23, 23, 32, True, torch.bfloat16),
    "16-bit plain": (1, 4, 2, 23, 23, 32, False, torch.bfloat16),
}
CPU_EDGE_CASES = ("causal-ragged", "chunk-after-cache", "decode-step", "16-bit causal")
# realistic training shapes, bf16, S = T: B, H, Hkv, T, Dh, causal; grouped by what the autotuner
# compiles once (head dim, causality), so each group pays its compile once and then only re-times
REALISTIC = [(4, 32, 8, 4096, 128, True), (8, 16, 16, 1024, 128, True), (4, 16, 16, 8192, 128, True),
             (8, 32, 4, 2048, 128, True), (8, 16, 4, 2048, 64, True), (4, 32, 32, 8192, 64, True),
             (4, 16, 16, 4096, 128, False)]
CPU_REALISTIC = [(1, 4, 2, 64, 32, True)]


@contextlib.contextmanager
def first_config_only():
    """Inside, the autotuned attention kernels run their first candidate configuration, untimed;
    their candidate lists and the results they had tuned are restored after."""
    from logitlab.kernels import triton_flash_bwd, triton_flash_fwd

    tuners = [triton_flash_fwd.flash_fwd_kernel, triton_flash_bwd._dkdv_kernel, triton_flash_bwd._dq_kernel]
    saved = [(t.configs, dict(t.cache)) for t in tuners]
    try:
        for t in tuners:
            t.configs = t.configs[:1]
        yield
    finally:
        for t, (configs, cache) in zip(tuners, saved):
            t.configs, t.cache = configs, cache


def attention_reference(G: int, causal: bool, T: int, S: int, device):
    """The float32 reference: eager attention on repeated K/V heads (query i sees keys up to
    i + S - T when causal); for large shapes SDPA's memory-efficient backend (no T x S tensor)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from logitlab.model.attention import eager_attention, repeat_kv

    mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T) if causal else None

    def reference(q, k, v):
        if q.shape[0] * q.shape[1] * T * S <= 2**24 or str(device) == "cpu":
            return eager_attention(q, repeat_kv(k, G), repeat_kv(v, G), mask)[0]
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), is_causal=causal)
    return reference


def sdpa_path(q, k, v, do, causal: bool, G: int):
    """(SDPA on these inputs, its route's name): on a GPU the flash backend, with GQA native where
    it takes that forward and backward, else on K/V heads repeated G times; the default dispatch
    on repeated K/V where flash takes neither (float32) and on a CPU; with an explicit mask when
    causal and T < S (SDPA's is_causal aligns the triangle to the first key, the kernel to the last)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from logitlab.model.attention import repeat_kv

    T, S = q.shape[2], k.shape[2]
    if causal and T != S:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        return (lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G),
                                                                attn_mask=mask)), "masked"

    def flash_gqa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=G > 1)

    def flash_repeated(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), is_causal=causal)

    if q.device.type == "cuda":
        for fn, name in ((flash_gqa, "flash"), (flash_repeated, "flash, K/V repeated")):
            try:
                fwd_bwd(fn, [q, k, v], do)
                return fn, name
            except RuntimeError:   # this backend does not take the case
                pass
    return (lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G),
                                                           is_causal=causal)), "default"


def attention_flops(B: int, H: int, T: int, S: int, Dh: int, causal: bool) -> float:
    """Forward FLOPs: 4 B H T S Dh, halved when causal over a square."""
    return 4.0 * B * H * T * S * Dh * (0.5 if causal and T == S else 1.0)


def attention_case(shape: tuple, dtype, device: str, timed: bool, pinned: bool) -> dict:
    from logitlab.kernels.triton_attention import flash_attention

    B, H, Hkv, T, S, Dh, causal = shape
    G = H // Hkv
    q, k, v = (_randn(B, h, n, Dh, dtype=dtype, device=device) for h, n in ((H, T), (Hkv, S), (Hkv, S)))
    do = _randn(B, H, T, Dh, dtype=dtype, device=device)

    def triton(q, k, v):
        return flash_attention(q, k, v, causal=causal)

    with first_config_only() if pinned else contextlib.nullcontext():
        t0 = time.perf_counter()
        fwd_bwd(triton, [q, k, v], do)
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0
        sdpa, backend = sdpa_path(q, k, v, do, causal, G)
        c = compare(triton, sdpa, [q, k, v], do, dtype, attention_reference(G, causal, T, S, device))
        row = {"dtype": DTYPE_NAMES[dtype], "sdpa_backend": backend, "first_call_s": first,
               "err_out": c["err_fused"], "err_out_sdpa": c["err_eager"], "err_grad": c["grad_err_fused"],
               "err_grad_sdpa": c["grad_err_eager"], "ok": c["ok"], "autotuned": not pinned}
        if timed:
            row.update(attention_speed(triton, sdpa, [q, k, v], do, attention_flops(B, H, T, S, Dh, causal)))
    return row


def attention_speed(triton, sdpa, inputs, do, flops: float) -> dict:
    """TFLOP/s of the forward (no grad) and of forward + backward, each path, and the ratios
    (> 1: the Triton kernel is faster)."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = {}
    for name, fn in (("", triton), ("sdpa_", sdpa)):
        def fwd(fn=fn):
            with torch.no_grad():
                fn(*inputs)

        def fb(fn=fn):
            torch.autograd.grad(fn(*leaves), leaves, do)
        out[f"{name}fwd_tflops"] = flops / bench_ms(fwd) * 1e-9
        out[f"{name}fb_tflops"] = 3.5 * flops / bench_ms(fb) * 1e-9
    out["fwd_ratio"] = out["fwd_tflops"] / out["sdpa_fwd_tflops"]
    out["fb_ratio"] = out["fb_tflops"] / out["sdpa_fb_tflops"]
    return out


def _shape_name(B, H, Hkv, T, S, Dh, causal) -> str:
    return f"B{B} H{H} Hkv{Hkv} T{T} S{S} Dh{Dh} {'causal' if causal else 'full'}"


def part_attention(spec: dict, rows: Rows) -> None:
    cpu = spec["cpu"]
    device, timed = ("cpu" if cpu else "cuda"), not cpu
    edges = {n: EDGE_CASES[n] for n in (CPU_EDGE_CASES if cpu else EDGE_CASES)}
    realistic = [(B, H, Hkv, T, T, Dh, c) for B, H, Hkv, T, Dh, c in (CPU_REALISTIC if cpu else REALISTIC)]

    def edge(shape, dtype):
        return lambda: {"kind": "interpreter test shape", **attention_case(shape, dtype, device, False, True)}

    def real(shape):
        return lambda: {"kind": "realistic", **attention_case(shape, torch.bfloat16, device, timed, False)}

    cases = [(f"{_shape_name(*c[:7])} ({name})", edge(c[:7], c[7])) for name, c in edges.items()]
    cases += [(f"{_shape_name(*s)} (realistic)", real(s)) for s in realistic]
    run_cases([(name, _freeing(fn, cpu)) for name, fn in cases], spec, rows, min_s=5.0)


PARTS = {"kernels": part_kernels, "attention": part_attention}

if __name__ == "__main__":
    sys.exit(child_main(PARTS, sys.argv[1:]))
