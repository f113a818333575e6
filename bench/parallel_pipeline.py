"""Pipeline bubble: the idle share (p - 1) / (m + p - 1) of GPipe and 1F1B beside the idle time
measured per stage (a step's wall time minus the stage's own forward and backward time), on CPU
ranks with gloo. Launch it with torchrun:

    torchrun --standalone --nproc_per_node 2 bench/parallel_pipeline.py [--quick]

Rank 0 prints one row per (schedule, micro-batches); every rank's measured idle share is
gathered. On a CPU the stages also compete for cores, so the measured share is an upper bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(schedule: str, m: int, quick: bool) -> dict:
    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.parallel import planner
    from logitlab.parallel.apply import parallelize
    from logitlab.parallel.mesh import ParallelPlan

    T, d = (32, 64) if quick else (128, 256)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, context_length=T, d_model=d, n_layers=4, n_heads=4,
                                    n_kv_heads=2, d_ff=4 * d, norm="rmsnorm", mlp="swiglu", positions="rope",
                                    tie_embeddings=False))
    par = parallelize(model, ParallelPlan(pp=dist.get_world_size(), pp_schedule=schedule, n_microbatches=m))
    x = torch.randint(0, 512, (2 * m, T))
    par.forward_backward(x, x)                      # first step: shapes exchanged, not timed
    for t in par.timers:
        t.reset()
    steps, t0 = 2 if quick else 5, time.perf_counter()
    for _ in range(steps):
        par.forward_backward(x, x)
    wall = time.perf_counter() - t0
    idle = [0.0] * dist.get_world_size()
    dist.all_gather_object(idle, par.timers[0].idle_fraction(wall))
    return {"schedule": schedule, "m": m, "bubble": planner.bubble_fraction(dist.get_world_size(), m), "idle": idle}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from logitlab import parallel

    parallel.init_distributed()
    rows = [run(s, m, args.quick) for s in ("gpipe", "1f1b") for m in ((2, 4) if args.quick else (2, 4, 8))]
    if dist.get_rank() == 0:
        print("| schedule | micro-batches | bubble (p-1)/(m+p-1) | measured idle per stage |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['schedule']} | {r['m']} | {r['bubble']:.2f} | {', '.join(f'{v:.2f}' for v in r['idle'])} |")
    parallel.destroy()


if __name__ == "__main__":
    main()
