"""Activation checkpointing's cost: the bytes a training forward keeps for backward and the time
of a forward + backward step, for none / selective / full, on one CPU process.

    python3 -m bench.parallel_ac [--quick] [--threads 2]

Memory is measured (parallel.activation.saved_activation_bytes: every tensor created during the
forward that is still alive at its end) and set beside the planner's estimate
(parallel.planner.activation_bytes).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def measure(quick: bool, repeats: int = 3) -> list[dict]:
    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.parallel import activation, planner

    d, layers, T, B = (64, 2, 64, 2) if quick else (256, 4, 256, 4)
    config = ModelConfig(vocab_size=512, context_length=T, d_model=d, n_layers=layers, n_heads=4, n_kv_heads=2,
                         d_ff=4 * d, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    x = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(0))
    rows = []
    for mode in activation.AC_MODES:
        torch.manual_seed(0)
        model = activation.apply_activation_checkpointing(Transformer(config), mode)
        loss, kept = activation.saved_activation_bytes(lambda: F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
        loss.backward()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            times.append(time.perf_counter() - t0)
        rows.append({"mode": mode, "kept_bytes": kept, "planner_bytes": planner.activation_bytes(config, B * T, 4, mode),
                     "step_ms": 1000 * min(times)})
    return rows


def render(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| checkpointing | kept for backward (measured) | planner | step ms | vs none |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['kept_bytes'] / 2**20:.2f} MiB | {r['planner_bytes'] / 2**20:.2f} MiB | "
                     f"{r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f}x time, "
                     f"{r['kept_bytes'] / base['kept_bytes']:.2f}x memory |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(render(measure(args.quick)))


if __name__ == "__main__":
    main()
