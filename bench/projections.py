"""Fused or separate projections: one (H+2·Hkv)·Dh x D product for q, k, v (and one 2F x D for
SwiGLU's gate and up) against three (two) separate products, at training and decode row counts.

This decides the state-dict layout (docs/design.md): the separate form is what LoRA adapters
and tensor parallelism address, the fused one saves kernel launches. Each pair is timed
alternately in one process, best of `repeats` rounds, the same weights on both sides.

    python3 -m bench.projections [--threads 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

# (name, D, H, Hkv, Dh, F): GPT-2 small's attention (no GQA) and the small Llama of bench.model
SHAPES = [("gpt2-small", 768, 12, 12, 64, 3072), ("small-llama", 384, 6, 2, 64, 1024)]
ROWS = {"train": 2048, "decode-1": 1, "decode-8": 8}


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _pair(x, parts: list[torch.Tensor], train: bool, repeats: int) -> tuple[float, float]:
    """(fused seconds, separate seconds) for y = x @ W^T with W = cat(parts)."""
    fused_w = torch.cat(parts).requires_grad_(train)
    sep_w = [p.clone().requires_grad_(train) for p in parts]

    def fused():
        y = F.linear(x, fused_w)
        if train:
            y.sum().backward()

    def separate():
        ys = [F.linear(x, w) for w in sep_w]
        if train:
            sum(y.sum() for y in ys).backward()

    f = s = float("inf")
    for _ in range(3):  # alternate, so a change of machine load falls on both
        f = min(f, _time(fused, repeats))
        s = min(s, _time(separate, repeats))
    return f, s


def run(repeats: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, D, H, Hkv, Dh, Fd in SHAPES:
        qkv = [torch.randn(n, D, generator=g) * 0.02 for n in (H * Dh, Hkv * Dh, Hkv * Dh)]
        gate_up = [torch.randn(Fd, D, generator=g) * 0.02 for _ in range(2)]
        for mode, M in ROWS.items():
            x = torch.randn(M, D, generator=g).requires_grad_(mode == "train")
            with torch.inference_mode(mode != "train"):
                for which, parts in (("qkv", qkv), ("gate_up", gate_up)):
                    f, s = _pair(x, parts, mode == "train", repeats)
                    rows.append({"shape": name, "rows": mode, "projection": which, "fused_s": f,
                                 "separate_s": s, "separate_over_fused": s / f})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.repeats)
    for r in rows:
        print(f"{r['shape']:12s} {r['rows']:9s} {r['projection']:8s} fused {r['fused_s'] * 1e3:8.3f} ms  "
              f"separate {r['separate_s'] * 1e3:8.3f} ms  separate/fused {r['separate_over_fused']:.2f}x")
    print(json.dumps({"threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
