"""Shapes that do not divide the ranks, through the main training loop, used by
test_parallel_shapes.py.

`python tests/_dist_shapes.py OUT_DIR SCENARIO...` under torchrun (or alone: rank 0 of 1, the
reference). Every scenario trains the same model, whose vocabulary (263 ids, unpadded) and
layer count (3) divide neither 2 nor 4 ranks, with logitlab.train.loop.train on OUT_DIR/prep
(tests/_dist_nd.py's corpus), evaluating a validation set of 33 windows, so the ranks hold
different numbers of windows; OUT_DIR/run_<scenario>/metrics.jsonl is the result. The hooks are
the ones `logitlab train` gets (train.layouts.parallel_hooks picks them from the config), except
for "runner_*" scenarios, which call train.parallel_run.train_parallel with a ParallelPlan.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitlab import parallel  # noqa: E402

STEPS = 4
WINDOWS = 33          # validation windows of T tokens: 17 + 16 on 2 ranks, 9 + 8 + 8 + 8 on 4
T = 16
SCENARIOS = {
    "one": {},                                        # one process: the reference
    # 2 ranks
    "ddp": dict(parallel="ddp"),
    "fsdp": dict(parallel="fsdp"),
    "zero1": dict(parallel="zero1"),
    "zero2": dict(parallel="zero2"),
    "dp_shard_2": dict(dp_shard=2),                   # --dp-shard 2 alone: sharded (--parallel auto)
    # 4 ranks
    "fsdp_4": dict(parallel="fsdp", dp_shard=4),
    "hsdp": dict(parallel="fsdp", dp_replicate=2, dp_shard=2),
    "zero2_4": dict(parallel="zero2"),
    "runner_hsdp": dict(parallel="fsdp", dp_replicate=2, dp_shard=2),
}


def model():
    from logitlab.model.transformer import ModelConfig, Transformer

    torch.manual_seed(7)
    return Transformer(ModelConfig(vocab_size=263, vocab_pad_multiple=1, context_length=T, d_model=40, n_layers=3,
                                   n_heads=4, n_kv_heads=2, d_ff=72, norm="rmsnorm", mlp="swiglu", positions="rope",
                                   bias=False, tie_embeddings=True, dropout=0.0))


def config(out: Path, name: str):
    from logitlab.train.config import TrainConfig

    fields = SCENARIOS[name]
    return TrainConfig(data_dir=str(out / "prep"), out_dir=str(out / f"run_{name}"), steps=STEPS, batch_size=4,
                       seq_len=T, lr=3e-3, warmup_steps=1, eval_every=2, eval_tokens=WINDOWS * T, save_every=2,
                       device="cpu", precision="fp32", seed=5, tensorboard=False,
                       dist_timeout=float(os.environ.get("LOGITLAB_TEST_TIMEOUT_S", "120")), **fields)


def run(name: str, out: Path) -> None:
    from logitlab.train.loop import train

    cfg = config(out, name)
    if name.startswith("runner_"):
        from logitlab.parallel.mesh import ParallelPlan
        from logitlab.train.parallel_run import train_parallel

        plan = ParallelPlan(**SCENARIOS[name])
        train_parallel(model(), cfg, plan)
        return
    train(model(), cfg)


def main(argv: list[str]) -> int:
    out, scenarios = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    info = parallel.init_distributed(timeout_s=float(os.environ.get("LOGITLAB_TEST_TIMEOUT_S", "120")))
    try:
        with parallel.rank_failure_guard(info):
            for name in scenarios:
                run(name, out)
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
