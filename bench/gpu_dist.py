"""The GPU check's distributed part (bench.gpu_check runs it in a child process): one torchrun
job of one rank (NCCL on a GPU, gloo on CPU) that trains the same small model three ways, from the
same weights on the same batches: plain, wrapped in DDP, and sharded with FSDP2
(parallel.wrap_model), with parallel.clip_grad_norm and AdamW, STEPS optimizer steps each. With
one rank the collectives carry nothing between GPUs, but every one of them runs through the
backend (the broadcast of the weights, the gradient all-reduce or reduce-scatter, the weight
all-gather, the norm's all-reduce), so the losses must equal the plain ones: float32, the same
kernels, so the difference is 0 or a rounding. The rank also all-reduces a tensor and checks the
sum.

    python3 -m bench.gpu_dist dist SPEC_JSON ROWS_JSONL    # as the check runs it
    torchrun --standalone --nproc_per_node 1 -m bench.gpu_dist --worker OUT_JSON [--cpu]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_check import ROOT, Rows, child_main, time_left

STEPS = 3
SEED = 0
TOLERANCE = 1e-5   # relative difference of a loss from the plain step's that still counts as equal


def small_model(cpu: bool):
    from logitlab.model.config import ModelConfig
    from logitlab.model.transformer import Transformer

    width = (64, 2, 4) if cpu else (512, 4, 8)        # d_model, layers, heads
    config = ModelConfig(vocab_size=512, context_length=64, d_model=width[0], n_layers=width[1], n_heads=width[2],
                         n_kv_heads=width[2] // 2, d_ff=4 * width[0], norm="rmsnorm", mlp="swiglu",
                         positions="rope", bias=False, tie_embeddings=True)
    return Transformer(config)


def train_steps(mode: str, device, cpu: bool) -> dict:
    """STEPS AdamW steps of a freshly seeded model wrapped by `mode` -> losses, norms, ms per step."""
    import torch

    from logitlab import parallel
    from logitlab.train.loss import cross_entropy

    torch.manual_seed(SEED)
    model = parallel.wrap_model(small_model(cpu).to(device), mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(SEED)
    losses, norms, times = [], [], []
    for _ in range(STEPS):
        ids = torch.randint(0, 512, (8, 65), generator=g).to(device)
        t0 = time.perf_counter()
        loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        norms.append(parallel.clip_grad_norm(model, 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    return {"losses": losses, "grad_norms": norms, "step_ms": 1e3 * min(times)}


def worker(out: Path, cpu: bool) -> None:
    import torch
    import torch.distributed as dist

    from logitlab import parallel

    info = parallel.init_distributed(device="cpu" if cpu else None, timeout_s=120)
    try:
        x = torch.ones(4, device=info.device) * (info.rank + 1)
        dist.all_reduce(x)
        summed = float(x[0]) == sum(range(1, info.world_size + 1))
        result = {"backend": dist.get_backend(), "world_size": info.world_size, "device": str(info.device),
                  "all_reduce_ok": summed, "modes": {m: train_steps(m, info.device, cpu) for m in ("none", "ddp", "fsdp")}}
    finally:
        parallel.destroy()
    if info.is_main:
        out.write_text(json.dumps(result))


def part_dist(spec: dict, rows: Rows) -> None:
    """torchrun with one rank, bounded by the part's share; the rows compare each mode with plain."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-dist-") as tmp:
        out = Path(tmp) / "dist.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node",
               "1", "-m", "bench.gpu_dist", "--worker", str(out)] + (["--cpu"] if spec["cpu"] else [])
        rows.begin("plain")   # the first row; torchrun runs all three
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=max(5.0, time_left(spec)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise RuntimeError(f"torchrun ran past the part's share of the budget:\n{log[-3000:]}") from None
        print(log)
        if proc.returncode or not out.exists():
            raise RuntimeError(f"torchrun failed (exit {proc.returncode}): {log.strip().splitlines()[-1:] or ''}")
        result = json.loads(out.read_text())
    rows.info(backend=result["backend"], world_size=result["world_size"], all_reduce_ok=result["all_reduce_ok"])
    plain = result["modes"]["none"]["losses"]
    for mode, label in (("none", "plain"), ("ddp", "DDP"), ("fsdp", "FSDP2")):
        r = result["modes"][mode]
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], plain))
        rows.row(label, backend=result["backend"], losses=r["losses"], grad_norms=r["grad_norms"], max_diff=diff,
                 equal=diff <= TOLERANCE and result["all_reduce_ok"], step_ms=r["step_ms"])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(Path(argv[1]), "--cpu" in argv[2:])
        return 0
    return child_main({"dist": part_dist}, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
