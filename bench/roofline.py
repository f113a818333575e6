"""The machine's own limits, measured in one run: matmul FLOP/s at the model's shapes and memory bandwidth.

    python3 -m bench.roofline            # fp32 and bf16 at every shape, 5 repeats, 1 and N threads; bandwidth
    python3 -m bench.roofline --quick    # 2 repeats, the LM-head shapes left out (a smoke run)

Every throughput elsewhere in bench/ is read against these numbers: MFU = model FLOP/s /
`matmul_peak(dtype, shapes)`; the decode bound = bytes read per decoded token /
`memory_bandwidth()`. Both functions are importable; both measure with torch's current thread count.

Matmul shapes are (M, K, N): an (M, K) activation times a (K, N) weight, M = B*T = 1024 tokens,
2*M*K*N FLOPs, the best of several repetitions after a warm-up. Memory bandwidth is measured three
ways over a tensor far larger than any cache: a copy (bytes read + bytes written), a sum
reduction (bytes read) and a float32 matrix-vector product (the matrix bytes: how a batch-1 decode
step reads its weights). `memory_bandwidth()` is the read bandwidth: the larger of the two reads.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from bench.common import command_line, cpu_flags, machine_info, markdown_table, publish

TOKENS = 1024  # M = B*T rows of activations
SHAPES: dict[str, list[tuple[int, int, int]]] = {
    # GPT-2 small: D 768, one of q/k/v/o (768), fused qkv (2304), MLP up (3072) and down, LM head (50257)
    "gpt2-small": [(TOKENS, 768, 768), (TOKENS, 768, 2304), (TOKENS, 768, 3072), (TOKENS, 3072, 768),
                   (TOKENS, 768, 50257)],
    # small Llama: D 384, F 1024 (gate/up and down), V 8192
    "small-llama": [(TOKENS, 384, 384), (TOKENS, 384, 1024), (TOKENS, 1024, 384), (TOKENS, 384, 8192)],
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Seconds of the fastest of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_rates(dtype: str | torch.dtype, shapes: list[tuple[int, int, int]], repeats: int = 5,
                 device: str | torch.device = "cpu") -> list[float]:
    """GFLOP/s of an (M, K) x (K, N) matmul for each (M, K, N) in `shapes`, best of `repeats`."""
    torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    rates = []
    for M, K, N in shapes:
        if min(M, K, N) <= 0:
            raise ValueError(f"matmul shape ({M}, {K}, {N}) must be positive")
        a = torch.randn(M, K, generator=g).to(device=device, dtype=torch_dtype)  # (M, K) activations
        w = torch.randn(K, N, generator=g).to(device=device, dtype=torch_dtype)  # (K, N) weight
        seconds = best_time(lambda a=a, w=w: a @ w, repeats, device)
        rates.append(2 * M * K * N / seconds / 1e9)
        del a, w
    return rates


def matmul_peak(dtype: str | torch.dtype = "fp32", shapes: list[tuple[int, int, int]] | None = None,
                repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """The best matmul rate (GFLOP/s) over `shapes` (default: every benchmark shape): MFU's denominator."""
    if shapes is None:
        shapes = [s for group in SHAPES.values() for s in group]
    return max(matmul_rates(dtype, shapes, repeats, device))


def bandwidths(mib: int = 512, repeats: int = 5, device: str | torch.device = "cpu") -> dict[str, float]:
    """GB/s of a copy (read + write bytes), a sum (read) and a float32 matrix-vector product (read),
    each over a `mib` MiB float32 tensor, the best of `repeats`."""
    if mib <= 0:
        raise ValueError(f"mib ({mib}) must be positive")
    device = torch.device(device)
    cols = 4096
    rows = max(1, mib * 2**20 // 4 // cols)
    src = torch.ones(rows, cols, device=device)     # (rows, cols) float32
    dst = torch.empty_like(src)
    x = torch.ones(cols, 1, device=device)          # (cols, 1)
    nbytes = src.numel() * src.element_size()
    out = {"copy": 2 * nbytes / best_time(lambda: dst.copy_(src), repeats, device) / 1e9,
           "sum": nbytes / best_time(lambda: src.sum(), repeats, device) / 1e9,
           "matvec": nbytes / best_time(lambda: src @ x, repeats, device) / 1e9}
    out["read"] = max(out["sum"], out["matvec"])
    return out


def memory_bandwidth(mib: int = 512, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Memory read bandwidth in GB/s (the decode bound's denominator); see `bandwidths`."""
    return bandwidths(mib, repeats, device)["read"]


def run(quick: bool = False, repeats: int | None = None, device: str = "cpu",
        threads: list[int] | None = None) -> dict:
    """Every shape in both dtypes and the bandwidths, once per thread count (default: torch's own)."""
    repeats = repeats or (2 if quick else 5)
    threads, before = threads or [torch.get_num_threads()], torch.get_num_threads()
    rows, bw = [], {}
    for n in threads:
        torch.set_num_threads(n)
        for dtype in DTYPES:
            for model, shapes in SHAPES.items():
                if quick:
                    shapes = [s for s in shapes if s[2] < 8192]   # the LM heads take the most time
                for (M, K, N), rate in zip(shapes, matmul_rates(dtype, shapes, repeats, device)):
                    rows.append(dict(threads=n, dtype=dtype, model=model, M=M, K=K, N=N, gflops=rate))
                    print(f"{n} thread(s) matmul {dtype} {model:12s} {M:5d} x {K:5d} x {N:6d}: "
                          f"{rate:8.1f} GFLOP/s", flush=True)
        bw[n] = bandwidths(256 if quick else 512, repeats, device)
        for kind in ("copy", "sum", "matvec"):
            print(f"{n} thread(s) memory {kind:7s}: {bw[n][kind]:7.1f} GB/s", flush=True)
    torch.set_num_threads(before)
    peak = {n: {d: max(r["gflops"] for r in rows if r["dtype"] == d and r["threads"] == n) for d in DTYPES}
            for n in threads}
    info = machine_info()
    info.update(cpu_flags=cpu_flags(), numpy=__import__("numpy").__version__, device=device)
    return dict(command=command_line(), machine=info, quick=quick, repeats=repeats, threads=threads,
                matmul=rows, matmul_peak_gflops=peak, bandwidth_gbs=bw,
                memory_bandwidth_gbs={n: b["read"] for n, b in bw.items()})


def render(result: dict) -> str:
    """The `## Roofline` section of docs/benchmarks.md: a column per (dtype, thread count)."""
    m, threads = result["machine"], result["threads"]
    rate = {(r["threads"], r["dtype"], r["model"], r["M"], r["K"], r["N"]): r["gflops"] for r in result["matmul"]}
    keys = list(dict.fromkeys((r["model"], r["M"], r["K"], r["N"]) for r in result["matmul"]))
    cols = [(n, d) for d in DTYPES for n in threads]
    rows = [[model, f"{M} x {K} x {N}"] + [f"{rate[(n, d, model, M, K, N)]:.1f}" for n, d in cols]
            + [" / ".join(f"{rate[(n, 'bf16', model, M, K, N)] / rate[(n, 'fp32', model, M, K, N)]:.2f}"
                          for n in threads)] for model, M, K, N in keys]
    peak = result["matmul_peak_gflops"]
    rows.append(["**peak**", "best shape"] + [f"**{peak[n][d]:.1f}**" for n, d in cols] + [""])
    table = markdown_table(["shape", "M x K x N"] + [f"{d} GFLOP/s, {n} thr" for n, d in cols]
                           + ["bf16 / fp32 (" + " / ".join(f"{n} thr" for n in threads) + ")"], rows)
    bw = result["bandwidth_gbs"]
    bw_table = markdown_table(
        ["memory", "bytes counted"] + [f"GB/s, {n} thr" for n in threads],
        [[label, counted] + [f"{bw[n][kind]:.1f}" for n in threads]
         for kind, label, counted in (("copy", "copy", "read + written"), ("sum", "sum (reduction)", "read"),
                                      ("matvec", "fp32 matrix-vector", "matrix read"),
                                      ("read", "**read bandwidth** (`memory_bandwidth()`)", "larger read"))])
    flags = ", ".join(m.get("cpu_flags") or []) or "none listed"
    return f"""The machine's own limits, measured in one run; every MFU and bandwidth fraction in this file is
read against numbers like these. Matmul: an (M, K) activation times a (K, N) weight at the
benchmarks' shapes (M = B*T = 1024 tokens; GPT-2 small's projections, fused qkv, MLP and LM head;
the small Llama's D 384, F 1024, V 8192), 2*M*K*N FLOPs over the best of {result['repeats']} repetitions
after a warm-up, at each torch thread count. Memory: a {'256' if result['quick'] else '512'} MiB float32 tensor,
far larger than any cache.

Command: `{result['command']}` — machine: {m['nproc']} CPUs ({m['cpu']}; {flags}), torch {m['torch']},
numpy {m['numpy']}, Python {m['python']}, commit {m['commit']}, load average {m.get('load_avg_1m', '?')}
at the end (the machine is shared: when another process holds a core, a 2-thread run stalls at
every parallel region, so read the 1-thread column as the steady one and compare within a column).

{table}

{bw_table}

A decode step that reads X bytes of weights and KV cache can take no less than X / read bandwidth.
From Python: `from bench.roofline import matmul_peak, memory_bandwidth`; `matmul_peak("bf16",
[(1024, 768, 3072)])` -> GFLOP/s, `memory_bandwidth()` -> GB/s, both at torch's current thread count.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, no LM-head shapes, 256 MiB tensors")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 5; --quick 2)")
    parser.add_argument("--threads", type=int, nargs="*", default=None,
                        help="torch thread counts to measure at (default: 1 and torch's own choice)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    threads = args.threads or sorted({1, torch.get_num_threads()})
    result = run(args.quick, args.repeats, args.device, threads)
    for n in threads:
        print(f"{n} thread(s): peak fp32 {result['matmul_peak_gflops'][n]['fp32']:.1f} GFLOP/s, bf16 "
              f"{result['matmul_peak_gflops'][n]['bf16']:.1f} GFLOP/s; read bandwidth "
              f"{result['memory_bandwidth_gbs'][n]:.1f} GB/s")
    publish("roofline", "Roofline", result, render, args.quick, not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
