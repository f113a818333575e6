"""Training scenarios on top of logitlab.parallel's N-D layouts, used by test_parallel_nd.py.

`python tests/_dist_nd.py OUT_DIR SCENARIO...` under torchrun (or alone, rank 0 of 1). Every
scenario trains the same tiny model on the same global batches (tests/_dist_worker.py's data:
random tokens, the batch of step s drawn from a generator seeded by s) with a ParallelPlan, and
rank 0 writes OUT_DIR/<scenario>.json: the global loss and pre-clip gradient norm per step, and
per-rank memory where measured. The test process runs the same `run` with world size 1 for the
reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_worker as data  # noqa: E402

from logitlab import parallel  # noqa: E402
from logitlab.parallel.apply import parallelize  # noqa: E402
from logitlab.parallel.mesh import ParallelPlan  # noqa: E402

STEPS = 4
SAVE_AT = 2
MODELS = {
    "untied": dict(tie_embeddings=False, n_layers=4),
    "tied": dict(tie_embeddings=True, n_layers=2),
    "qknorm": dict(tie_embeddings=False, n_layers=2, qk_norm=True),
}
# scenario -> (model kind, plan fields)
SCENARIOS = {
    "ddp": ("untied", dict(parallel="ddp")),
    "zero1": ("untied", dict(parallel="zero1")),
    "zero2": ("untied", dict(parallel="zero2")),
    "fsdp": ("untied", dict(parallel="fsdp")),
    "tp": ("tied", dict(tp=2)),
    "tp_sp": ("untied", dict(tp=2, sequence_parallel=True)),
    "tp_qknorm": ("qknorm", dict(tp=2, sequence_parallel=True)),
    "fsdp_ac_full": ("untied", dict(parallel="fsdp", activation_checkpointing="full")),
    "fsdp_ac_selective": ("untied", dict(parallel="fsdp", activation_checkpointing="selective")),
    "pp_gpipe": ("untied", dict(pp=2, pp_schedule="gpipe")),
    "pp_1f1b": ("untied", dict(pp=2, pp_schedule="1f1b")),
    "pp_interleaved": ("untied", dict(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2)),
    # 4 ranks
    "tp_fsdp": ("untied", dict(tp=2, dp_shard=2)),
    "pp_fsdp": ("untied", dict(pp=2, dp_shard=2)),
    "hsdp": ("untied", dict(dp_replicate=2, dp_shard=2)),
    "zero2_4": ("untied", dict(parallel="zero2")),
    # 8 ranks
    "pp_tp_fsdp": ("untied", dict(pp=2, tp=2, dp_shard=2)),
    # one process (a runner's reference)
    "one_tied": ("tied", dict()),
}


def tiny_model(kind: str):
    from logitlab.model.transformer import ModelConfig, Transformer

    torch.manual_seed(data.SEED)
    config = ModelConfig(vocab_size=64, context_length=data.T, d_model=32, n_heads=4, n_kv_heads=2,
                         norm="rmsnorm", mlp="swiglu", d_ff=64, positions="rope", bias=False, dropout=0.0,
                         **MODELS[kind])
    return Transformer(config)


def train(par, optimizer, steps: range) -> dict:
    losses, norms, seconds = [], [], []
    for step in steps:
        t0 = time.perf_counter()
        x, y = data.read_rows(parallel.shard_for_rank(data.global_offsets(step), par.dp))
        local = par.forward_backward(x, y)
        norms.append(par.clip_grad_norm(data.MAX_NORM))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(par.global_loss(local))
        seconds.append(time.perf_counter() - t0)
    return {"losses": losses, "norms": norms, "seconds": seconds}


def build(name: str, info, reference: bool = False):
    kind, fields = SCENARIOS[name]
    plan = ParallelPlan() if reference else ParallelPlan(**fields)
    par = parallelize(tiny_model(kind), plan, info, seq_len=data.T)
    return par, par.build_optimizer(lr=3e-3, weight_decay=0.1)


def _gather(value, info) -> list:
    if not info.distributed:
        return [value]
    out = [None] * info.world_size
    torch.distributed.all_gather_object(out, value)
    return out


def measure_memory(par, optimizer, info) -> list[dict]:
    """Per rank: weights held after a forward (ZeRO-2 keeps them gathered until backward),
    gradients after its backward, optimizer state after the steps already taken."""
    from logitlab.parallel.tensor import loss_parallel_context, vocab_parallel_loss
    from logitlab.parallel.zero import held_bytes

    holder = torch.nn.ModuleList(par.modules)
    x, y = data.read_rows(parallel.shard_for_rank(data.global_offsets(0), par.dp))
    with loss_parallel_context(par.model):
        loss = vocab_parallel_loss(par.model(x), y)
        after_forward = held_bytes(holder, optimizer)
        loss.backward()
    held = {**held_bytes(holder, optimizer), "weights": after_forward["weights"]}
    optimizer.zero_grad(set_to_none=True)
    return _gather(held, info)


def run(scenario: str, out: Path, info, reference: bool = False) -> dict:
    """One scenario (its plan; with reference=True a single process with the same model).

    "NAME": STEPS steps. "save-NAME": SAVE_AT steps, a sharded checkpoint OUT/dcp_NAME, the rest.
    "resume-NAME-from-SRC": layout NAME continues OUT/dcp_SRC for the remaining steps.
    "memory-NAME": STEPS steps, then the bytes each rank holds."""
    from logitlab.parallel.sharded import load_sharded, save_sharded

    kind, _, name = scenario.rpartition("-") if scenario.startswith(("save-", "memory-")) else ("", "", scenario)
    if scenario.startswith("resume-"):
        name, _, source = scenario.removeprefix("resume-").partition("-from-")
        par, optimizer = build(name, info, reference)
        meta = load_sharded(out / f"dcp_{source}", par, optimizer)
        result = train(par, optimizer, range(meta["step"], STEPS))
        return {**result, "resumed_at": meta["step"]}
    par, optimizer = build(name, info, reference)
    if kind == "save":
        first = train(par, optimizer, range(SAVE_AT))
        save_sharded(out / f"dcp_{name}", par, optimizer, step=SAVE_AT, state={"scenario": scenario})
        rest = train(par, optimizer, range(SAVE_AT, STEPS))
        return {k: first[k] + rest[k] for k in first}
    result = train(par, optimizer, range(STEPS))
    if par.plan.tp > 1 and not par.pipelined:   # what the loss sees: logits sharded on V, never gathered
        with torch.no_grad():
            logits = par.model(data.read_rows(data.global_offsets(0))[0])
        result["logits"] = {"placements": [str(p) for p in logits.placements],
                            "local_shape": list(logits.to_local().shape)}
    if kind == "memory":
        result["held"] = measure_memory(par, optimizer, info)
    if par.timers:
        result["busy_s"] = sum(t.forward_s + t.backward_s for t in par.timers)
    return result


def prepare_corpus(directory: Path) -> None:
    """A tiny byte-level corpus in `directory` (logitlab prepare's layout)."""
    from logitlab.data import tokens as data_io
    from logitlab.tokenizer.core import Tokenizer

    docs = directory.parent / "docs"
    docs.mkdir(exist_ok=True)
    for k in range(24):
        (docs / f"{k:02d}.txt").write_text(f"{k}: " + "the quick brown fox jumps over the lazy dog. " * (2 + k % 3))
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])
    data_io.prepare_corpus([docs], tokenizer, directory, val_fraction=0.2, workers=1)


def runner_config(out: Path, name: str, steps: int = STEPS):
    from logitlab.train.config import TrainConfig

    return TrainConfig(data_dir=str(out / "prep"), out_dir=str(out / f"runner_{name}"), steps=steps, batch_size=4,
                       grad_accum=2, seq_len=data.T, lr=3e-3, warmup_steps=1, save_every=SAVE_AT, device="cpu",
                       precision="fp32", seed=5, tensorboard=False)


def runner(name: str, out: Path, info, resume_from: str | None = None):
    """logitlab.train.parallel_run.train_parallel with scenario `name`'s layout on OUT/prep."""
    import shutil

    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.train.parallel_run import train_parallel

    kind, fields = SCENARIOS[name]
    torch.manual_seed(data.SEED)
    model = Transformer(ModelConfig(vocab_size=320, context_length=data.T, d_model=32, n_heads=4, n_kv_heads=2,
                                    norm="rmsnorm", mlp="swiglu", d_ff=64, positions="rope", bias=False,
                                    **MODELS[kind]))
    config = runner_config(out, name)
    if resume_from is not None and info.is_main:
        name_ = f"dcp-{SAVE_AT:06d}"
        shutil.copytree(out / f"runner_{resume_from}" / name_, Path(config.out_dir) / name_)
    plan = ParallelPlan(**fields) if info.distributed else ParallelPlan()
    return train_parallel(model, config, plan, resume=resume_from is not None, info=info)


def main_loop(name: str, out: Path, info):
    """logitlab.train.loop.train driven by parallel_run.nd_hooks with scenario `name`'s plan."""
    from logitlab.train.loop import ParallelHooks, train
    from logitlab.train.parallel_run import nd_hooks

    kind, fields = SCENARIOS[name]
    torch.manual_seed(data.SEED)
    from logitlab.model.transformer import ModelConfig, Transformer

    model = Transformer(ModelConfig(vocab_size=320, context_length=data.T, d_model=32, n_heads=4, n_kv_heads=2,
                                    norm="rmsnorm", mlp="swiglu", d_ff=64, positions="rope", bias=False,
                                    **MODELS[kind]))
    config = runner_config(out, f"loop_{name}" if info.distributed else "loop_none")
    hooks = nd_hooks(config, ParallelPlan(**fields), info) if info.distributed else ParallelHooks()
    return train(model, config, parallel=hooks)


def die(name: str, info) -> None:
    """Rank 1 is killed in its third step of layout `name`; rank 0 must stop with RankFailureError."""
    import signal

    par, optimizer = build(name, info)
    with parallel.rank_failure_guard(info):
        for step in range(50):
            if step == 2 and info.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            train(par, optimizer, range(step, step + 1))
    print("rank", info.rank, "finished without noticing", flush=True)


def main(argv: list[str]) -> int:
    out, scenarios = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    info = parallel.init_distributed(timeout_s=float(os.environ.get("LOGITLAB_TEST_TIMEOUT_S", "300")))
    try:
        for scenario in scenarios:
            if scenario.startswith("runner-"):
                result = runner(scenario.removeprefix("runner-"), out, info)
                if info.is_main:
                    (out / f"{scenario}.json").write_text(json.dumps({"losses": result.losses}))
                continue
            if scenario.startswith("loop-"):
                main_loop(scenario.removeprefix("loop-"), out, info)
                continue
            if scenario.startswith("die-"):
                die(scenario.removeprefix("die-"), info)
                continue
            result = run(scenario, out, info)
            if info.is_main:
                result["world_size"] = info.world_size
                (out / f"{scenario}.json").write_text(json.dumps(result))
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
