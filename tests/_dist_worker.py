"""A tiny training run on top of logitlab.parallel, used by test_parallel.py.

Run it on its own (rank 0 of 1) or under torchrun / a launcher environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): `python tests/_dist_worker.py OUT_DIR SCENARIO...`. Rank 0 writes
OUT_DIR/<scenario>.json with the loss and grad-norm sequence. The test process imports the same
functions to compute the single-process reference, so both sides run identical code.

The data are random tokens from a fixed seed; the global batch of every step is drawn from
a generator seeded by the step alone, so it is the same for every world size and after a resume.

After parallel.destroy() every rank checks that it is down to its main thread (no process
group, no Python thread, and on Linux no native one such as gloo's workers) and exits with
status 3 naming what is left otherwise: a collective still finishing on another thread when
the interpreter shuts down aborts the process (see parallel.destroy).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from logitlab import parallel  # noqa: E402
from logitlab.io.checkpoint import atomic_directory  # noqa: E402

SEED = 1234
T = 16            # positions per row
GLOBAL_ROWS = 8   # global batch: micro_batch x grad_accum x world_size
STEPS = 6
RESUME_AT = 3     # checkpoints are written after this many steps
MAX_NORM = 0.5    # small enough that clipping is active
TOKENS = torch.randint(0, 64, (4096,), generator=torch.Generator().manual_seed(SEED))


def tiny_model(vocab_size: int = 64):
    from logitlab.model.transformer import ModelConfig, Transformer

    torch.manual_seed(SEED)
    config = ModelConfig(vocab_size=vocab_size, context_length=T, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, norm="rmsnorm", mlp="swiglu", d_ff=64, positions="rope",
                         bias=False, tie_embeddings=True, dropout=0.0)
    return Transformer(config)


def global_offsets(step: int) -> torch.Tensor:
    """Start offsets (GLOBAL_ROWS,) of the windows of the global batch at `step`."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    return torch.randint(0, len(TOKENS) - T - 1, (GLOBAL_ROWS,), generator=g)


def read_rows(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of T + 1 tokens -> inputs (B, T) and targets (B, T) shifted by one."""
    windows = torch.stack([TOKENS[o:o + T + 1] for o in offsets.tolist()])
    return windows[:, :-1], windows[:, 1:]


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def sync_probe(model):
    """A function saying whether gradients were communicated since its last call: DDP counts
    its bucket all-reduces through a comm hook; FSDP2 puts reduce-scattered gradients in the
    sharded parameters' .grad, which is None until the first synchronised backward."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        calls = [0]

        def counting_hook(state, bucket):
            calls[0] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)

        def probe() -> bool:
            seen, calls[0] = calls[0] > 0, 0
            return seen
        return probe
    return lambda: any(p.grad is not None for p in model.parameters())


def train(model, optimizer, info, steps: range, grad_accum: int = 1, probe=None) -> dict:
    """Run `steps`; return the global-batch loss and pre-clip grad norm of each step, and with
    a probe, how many non-final / final micro-steps communicated gradients."""
    losses, norms, syncs = [], [], {"early_syncs": 0, "final_syncs": 0}
    for step in steps:
        offsets = global_offsets(step)
        total = torch.zeros((), device=info.device)
        for micro in range(grad_accum):
            x, y = read_rows(parallel.shard_for_rank(offsets, info, micro, grad_accum))
            x, y = x.to(info.device), y.to(info.device)
            with parallel.sync_gradients(model, micro == grad_accum - 1):
                logits = model(x)  # (B, T, V)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / grad_accum
                loss.backward()
            total += loss.detach()
            if probe is not None and probe():
                syncs["final_syncs" if micro == grad_accum - 1 else "early_syncs"] += 1
        norms.append(parallel.clip_grad_norm(model, MAX_NORM))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(parallel.all_reduce_mean(total).item())
    return {"losses": losses, "norms": norms, **syncs}


def save(model, optimizer, directory: Path) -> None:
    """Full state gathered to rank 0, written atomically by rank 0 only."""
    from safetensors.torch import save_file

    state = parallel.full_state_dict(model)
    optim_state = parallel.full_optimizer_state_dict(model, optimizer)
    if parallel.is_main_process():
        with atomic_directory(directory) as tmp:
            save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
                      str(tmp / "model.safetensors"))
            torch.save(optim_state, tmp / "optimizer.pt")
    parallel.barrier()


def load(model, optimizer, directory: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    optim_state = torch.load(directory / "optimizer.pt", weights_only=True)
    parallel.load_full_state_dict(model, state, optimizer, optim_state)


def run(scenario: str, out: Path, info) -> dict:
    """One scenario; see test_parallel.py for what each one checks."""
    mode, _, variant = scenario.partition("_")
    model = parallel.wrap_model(tiny_model(), mode, mixed_precision=variant == "bf16", info=info)
    optimizer = make_optimizer(model)
    accum = 2 if variant == "accum" else 1
    if variant == "resume":  # continue a checkpoint written by a different world size
        load(model, optimizer, out / "ckpt_none")
        return train(model, optimizer, info, range(RESUME_AT, STEPS))
    probe = sync_probe(model) if variant == "accum" else None
    first = train(model, optimizer, info, range(RESUME_AT), accum, probe)
    if variant == "":
        save(model, optimizer, out / f"ckpt_{mode}")
    rest = train(model, optimizer, info, range(RESUME_AT, STEPS), accum, probe)
    return {k: first[k] + rest[k] for k in first}


def train_config(out: Path, mode: str, **kw):
    """logitlab.train's own loop: global batch 8 rows x 2 micro-steps, checkpoints every 3 steps."""
    from logitlab.train.loop import TrainConfig

    base = dict(data_dir=str(out / "prep"), out_dir=str(out / f"run_{mode}"), steps=STEPS, batch_size=8,
                grad_accum=2, seq_len=T, lr=3e-3, warmup_steps=2, eval_every=RESUME_AT, save_every=RESUME_AT,
                eval_tokens=256, keep_last=10, device="cpu", precision="fp32", seed=5, tensorboard=False)
    if train_has_parallel_field():
        base["parallel"] = mode
    return TrainConfig(**{**base, **kw})


def train_has_parallel_field() -> bool:
    """True once train.py picks DDP/FSDP itself (TrainConfig.parallel); before that it takes
    rank / world_size / wrap / all_reduce hooks, which carry DDP only."""
    import dataclasses

    from logitlab.train.loop import TrainConfig

    return "parallel" in {f.name for f in dataclasses.fields(TrainConfig)}


def run_train_loop(out: Path, mode: str, info, resume: bool = False):
    """Train through logitlab.train.train, distributed by parallel.py."""
    from logitlab.train.loop import train

    model, config = tiny_model(vocab_size=257), train_config(out, mode)
    if train_has_parallel_field():
        return train(model, config, resume=resume)
    return train(model, config, resume=resume, rank=info.rank, world_size=info.world_size,
                 all_reduce=parallel.all_reduce_mean,
                 wrap=lambda m: parallel.wrap_model(m, mode, info=info))


def die(info) -> None:
    """Rank 1 is killed in the middle of the second step; rank 0 must stop with a clear error."""
    model = parallel.wrap_model(tiny_model(), "ddp", info=info)
    optimizer = make_optimizer(model)
    with parallel.rank_failure_guard(info):
        for step in range(50):
            if step == 2 and info.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            train(model, optimizer, info, range(step, step + 1))
    print("rank", info.rank, "finished without noticing", flush=True)


def hang(info) -> None:
    """Rank 1 stops answering (alive, silent); rank 0 must give up after the timeout."""
    with parallel.rank_failure_guard(info):
        for step in range(50):
            if step == 2 and info.rank == 1:
                time.sleep(600)
            parallel.all_reduce_mean(torch.ones(()))
    print("rank", info.rank, "finished without noticing", flush=True)


def main(argv: list[str]) -> int:
    out, scenarios = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    # generous: a collective may wait while a peer on a loaded machine catches up (the launcher's
    # own limit bounds a real hang)
    timeout = float(os.environ.get("LOGITLAB_TEST_TIMEOUT_S", "300"))
    info = parallel.init_distributed(timeout_s=timeout)
    try:
        for scenario in scenarios:
            if scenario == "die":
                die(info)
            elif scenario == "hang":
                hang(info)
            elif scenario.startswith("train_"):  # metrics.jsonl in OUT/run_<mode> is the result
                run_train_loop(out, scenario.partition("_")[2], info)
            else:
                result = run(scenario, out, info)
                if info.is_main:
                    result["world_size"] = info.world_size
                    (out / f"{scenario}.json").write_text(json.dumps(result))
    finally:
        if scenarios[-1] not in ("die", "hang"):
            parallel.destroy()
    if scenarios[-1] not in ("die", "hang"):
        left = threads_left()
        if torch.distributed.is_initialized() or left:
            print(f"rank {info.rank}: after parallel.destroy() the process group is "
                  f"{'still' if torch.distributed.is_initialized() else 'not'} initialized and "
                  f"{len(left)} other threads run: {left}", file=sys.stderr, flush=True)
            return 3
    return 0


def leftover_threads() -> list[str]:
    """Threads of this process other than the main one: Python threads, and on Linux every
    native thread by name (gloo's are pt_gloo_runloop and gloo_tcp_loop)."""
    left = [f"python:{t.name}" for t in threading.enumerate() if t is not threading.main_thread()]
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():  # no /proc: the Python threads only
        return left
    for task in sorted(tasks.iterdir()):
        if int(task.name) == threading.main_thread().native_id:
            continue
        try:
            left.append(f"native:{(task / 'comm').read_text().strip()}")
        except OSError:  # it ended between the listing and the read
            pass
    return left


def threads_left(timeout_s: float = 30.0) -> list[str]:
    """leftover_threads() once the threads that are ending have ended. A joined thread stays
    listed in /proc for a moment (up to 0.1 s measured on 2 busy cores), so this waits until
    none is; timeout_s only bounds a thread that never ends."""
    deadline = time.monotonic() + timeout_s
    while (left := leftover_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
