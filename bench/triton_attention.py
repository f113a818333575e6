"""FlashAttention in Triton (logitlab.kernels.triton_attention) against torch's SDPA (its flash
backend where it takes the case) and the eager reference, on a CUDA GPU.

    python3 -m bench.triton_attention                 # T = 512 .. 16k, Dh 64/128, causal or not, G 1/4/8
    python3 -m bench.triton_attention --quick         # T = 1k, 4k; Dh 64 and 128; fewer cases
    python3 -m bench.triton_attention --no-doc        # leave docs/benchmarks.md as it is

For every case: TFLOP/s of the forward pass and of forward + backward, with the standard count
4 * B * H * T^2 * Dh for the forward (x 0.5 when causal) and 2.5 times that for the backward,
the peak memory of one forward + backward beyond the inputs (linear in T for the kernels,
quadratic for eager), and the kernel's largest difference from SDPA's output. The token count
B * T is held at 16k (B = 16384 // T), H = 16 query heads, Hkv = H / G. Eager runs only while its
(B, H, T, T) scores fit the memory budget. Results go to bench/results/triton_attention.json
and the "Triton attention (GPU)" section of docs/benchmarks.md.

Needs a CUDA GPU: on a CPU-only machine (or under TRITON_INTERPRET=1, whose interpreter is a
correctness check, never a speed) it says so and exits with status 2, measuring nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

TOKENS, HEADS = 16384, 16
EAGER_BUDGET = 24 << 30                                            # bytes of eager scores + softmax


def refuse() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set: the interpreter checks correctness and has no speed to measure"
    import torch

    if not torch.cuda.is_available():
        return ("bench.triton_attention needs a CUDA GPU and this machine has none; the kernels' "
                "correctness runs on CPU through the interpreter: TRITON_INTERPRET=1 pytest tests/triton")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install triton"
    return None


def flops(B, H, T, Dh, causal, backward=False) -> float:
    fwd = 4.0 * B * H * T * T * Dh * (0.5 if causal else 1.0)
    return fwd * (3.5 if backward else 1.0)


def paths(G: int):
    """name -> attention(q, k, v, causal) for the three contenders."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from logitlab.kernels.triton_attention import flash_attention
    from logitlab.model.attention import eager_attention, repeat_kv

    def sdpa(q, k, v, causal):
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=G > 1)
        except RuntimeError:                                       # a case the flash backend refuses
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=G > 1)

    def eager(q, k, v, causal):
        return eager_attention(q, repeat_kv(k, G), repeat_kv(v, G), is_causal=causal)[0]

    return {"triton": flash_attention, "sdpa": sdpa, "eager": eager}


def measure(fn, q, k, v, causal) -> dict:
    """ms of forward and forward + backward (triton.testing.do_bench), and the peak extra bytes."""
    import torch
    from triton.testing import do_bench

    do = torch.randn_like(q)

    def fwd():
        return fn(q, k, v, causal)

    def fwd_bwd():
        torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)

    ms_fwd = do_bench(fwd, warmup=10, rep=50)
    ms_fb = do_bench(fwd_bwd, warmup=10, rep=50)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    return {"fwd_ms": ms_fwd, "fwd_bwd_ms": ms_fb, "peak_extra_bytes": torch.cuda.max_memory_allocated() - base}


def run_case(T, Dh, causal, G, dtype) -> list[dict]:
    import torch

    B, H = max(1, TOKENS // T), HEADS
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, T, Dh, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, H // G, T, Dh, device="cuda", dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, H // G, T, Dh, device="cuda", dtype=dtype, generator=g).requires_grad_()
    fns = paths(G)
    with torch.no_grad():
        diff = (fns["triton"](q, k, v, causal).float() - fns["sdpa"](q, k, v, causal).float()).abs().max().item()
    rows = []
    for name, fn in fns.items():
        row = {"path": name, "B": B, "H": H, "Hkv": H // G, "T": T, "Dh": Dh, "causal": causal, "G": G}
        if name == "eager" and 3 * B * H * T * T * 4 > EAGER_BUDGET:
            rows.append({**row, "skipped": "scores exceed the memory budget"})
            continue
        try:
            m = measure(fn, q, k, v, causal)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append({**row, "skipped": "out of GPU memory"})
            continue
        rows.append({**row, **m, "max_diff_vs_sdpa": diff if name == "triton" else None,
                     "fwd_tflops": flops(B, H, T, Dh, causal) / m["fwd_ms"] * 1e-9,
                     "fwd_bwd_tflops": flops(B, H, T, Dh, causal, True) / m["fwd_bwd_ms"] * 1e-9})
        torch.cuda.empty_cache()
    return rows


def render(result: dict) -> str:
    from bench.common import markdown_table

    head = ["T", "Dh", "causal", "G", "path", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "peak extra MiB", "max diff"]
    rows = []
    for r in result["rows"]:
        if "skipped" in r:
            rows.append([r["T"], r["Dh"], r["causal"], r["G"], r["path"], "-", "-", r["skipped"], ""])
            continue
        diff = "" if r["max_diff_vs_sdpa"] is None else f"{r['max_diff_vs_sdpa']:.1e}"
        rows.append([r["T"], r["Dh"], r["causal"], r["G"], r["path"], f"{r['fwd_tflops']:.1f}",
                     f"{r['fwd_bwd_tflops']:.1f}", f"{r['peak_extra_bytes'] / 2**20:.0f}", diff])
    return (f"`{result['command']}` on {result['gpu']}, {result['dtype']}, B*T = {TOKENS}, H = {HEADS}.\n\n"
            + markdown_table(head, rows))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.triton_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T = 1k and 4k only")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    args = parser.parse_args(argv)
    why = refuse()
    if why:
        print(why, file=sys.stderr)
        return 2
    import torch

    from bench.common import command_line, machine_info, publish

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    seqs = (1024, 4096) if args.quick else (512, 1024, 2048, 4096, 8192, 16384)
    cases = [(T, Dh, c, G) for T in seqs for Dh in (64, 128) for c in (True, False) for G in (1, 4, 8)
             if not (args.quick and (G == 4 or (Dh == 128 and not c)))]
    rows = []
    for i, (T, Dh, causal, G) in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] T={T} Dh={Dh} causal={causal} G={G}", file=sys.stderr, flush=True)
        rows += run_case(T, Dh, causal, G, dtype)
    result = {"command": command_line(), "gpu": torch.cuda.get_device_name(), "dtype": args.dtype,
              "machine": machine_info(), "rows": rows}
    print(render(result))
    publish("triton_attention", "Triton attention (GPU)", result, render, quick=args.quick, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
