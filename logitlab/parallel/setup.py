"""Several processes: the torch.distributed process group, set up from torchrun's environment and
torn down so that no backend thread outlives it; rank-0 checks, barriers, means over ranks, and a
guard that turns one rank's failure into an error on every rank.

The training loop becomes distributed with a handful of calls (parallel/wrap.py for the model,
parallel/state.py for checkpoints), each a no-op in a plain single process:

    info = init_distributed()                    # reads torchrun's RANK / WORLD_SIZE / ...
    model = wrap_model(model.to(info.device), mode, mixed_precision)   # "none" | "ddp" | "fsdp"
    optimizer = ...                              # built AFTER wrap_model (FSDP2 swaps parameters)
    with sync_gradients(model, micro_step == grad_accum - 1): loss.backward()
    log(all_reduce_mean(loss))                   # the loss of the whole global batch
    state = full_state_dict(model)               # gathered to rank 0, unwrapped keys
    if info.is_main: save(...)                   # only rank 0 logs and writes

Each rank's rows of a global batch come from the sampler (data.RandomWindows takes rank and
world_size), so the optimizer sees the same data for any world size.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import torch
import torch.distributed as dist

ParallelMode = Literal["none", "ddp", "fsdp"]
PARALLEL_MODES = ("none", "ddp", "fsdp")
DEFAULT_TIMEOUT_S = 300.0
_ENV_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankFailureError(RuntimeError):
    """Another rank died, was killed, or stopped answering within the timeout."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. A plain `python -m logitlab ...` is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None when no process group was created
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that prints, logs, plots and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     device: str | None = None) -> DistInfo:
    """Join the job torchrun started (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in
    the environment); a plain process gets rank 0 of 1 and no process group.

    backend: None picks nccl when CUDA is available, else gloo; device "cpu" forces gloo. Rank
    LOCAL_RANK of a node uses cuda:LOCAL_RANK, made current. timeout_s bounds every collective:
    when a rank dies or hangs the others raise within it (at once for a dead peer) instead of
    waiting forever; `rank_failure_guard` turns that into a RankFailureError naming the rank."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if dist.is_initialized():
        return current_info()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(device=torch.device(device or "cpu"), timeout_s=timeout_s)
    missing = [name for name in _ENV_NEEDED if name not in os.environ]
    if missing:
        raise ValueError(f"incomplete launcher environment: {missing} not set (start the job with torchrun, "
                         "which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise ValueError(f"RANK ({rank}) must be in [0, WORLD_SIZE={world})")
    use_cuda = torch.cuda.is_available() and device != "cpu"
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend not in ("gloo", "nccl") or (backend == "nccl" and not use_cuda):
        raise ValueError(f"backend must be 'gloo' or 'nccl' (nccl needs CUDA, available: "
                         f"{torch.cuda.is_available()}), got {backend!r}")
    dev = torch.device("cpu")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices "
                             "(use --nproc_per_node <= number of GPUs)")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    # Imported before the group exists: see destroy() for why its import must not come later.
    import torch.distributed.nn.functional as _defaults_without_a_group  # noqa: F401

    _STATE.setdefault("parent", os.getppid())   # before the slow part: the launcher is alive now
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=dev if backend == "nccl" else None)
    _STATE["timeout_s"] = timeout_s
    return current_info()


_STATE: dict = {"timeout_s": DEFAULT_TIMEOUT_S}


def launched_by_torchrun() -> bool:
    """Whether torchrun's agent started this process (it sets TORCHELASTIC_RUN_ID for its workers)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launcher_gone() -> bool:
    """Whether the process that started this one has died since init_distributed (or since the
    first call): its parent process id changed, as it does when an orphan is adopted by init or
    a subreaper. torchrun starts each rank in a session of its own and stops them only while it
    lives, so when its agent is killed with SIGKILL nothing else tells the ranks; the training
    loop asks this at every step boundary (a system call, well under a microsecond; portable,
    unlike Linux's PR_SET_PDEATHSIG, which would also fire on the exit of the thread that
    started the process). Ask it only of launched ranks (launched_by_torchrun): a plain
    process whose shell exits (nohup) is adopted just the same, and must go on."""
    parent = _STATE.setdefault("parent", os.getppid())
    return os.getppid() != parent


def current_info() -> DistInfo:
    """DistInfo of this process, from the live process group (or rank 0 of 1 without one)."""
    if not dist.is_initialized():
        return DistInfo()
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return DistInfo(rank=dist.get_rank(), local_rank=_env_int("LOCAL_RANK", dist.get_rank()),
                    world_size=dist.get_world_size(), device=dev, backend=backend,
                    timeout_s=_STATE["timeout_s"])


def destroy() -> None:
    """Leave the process group and stop its backend's threads (safe to call when none exists).

    Call it on every rank once the wrapped model is gone (a live DDP or FSDP2 module still
    holds the group, whose threads then run until the process exits). Afterwards the process
    may exit at any moment: no collective is still finishing on another thread."""
    if not dist.is_initialized():
        return
    # Why more than destroy_process_group: gloo runs every collective on a worker thread of the
    # group, and that thread drops the finished work -- often the last reference to the
    # collective's tensors, or to earlier works that a barrier kept -- only after wait() has
    # returned here. Freeing a tensor whose Python object is already gone takes the GIL. When
    # the interpreter has begun to finalize by then (the script returned right after its last
    # collective; on a loaded machine the worker runs late), CPython ends the waiting thread
    # with pthread_exit inside a noexcept C++ destructor, and the finished job dies with
    # "terminate called without an active exception" (SIGABRT). Gloo has no shutdown: only the
    # group's destructor stops and joins its threads, letting a worker take the GIL to finish.
    # It runs when the last reference goes, but in torch 2.13 two outlive destroy_process_group
    # and kept the group, and its threads, until exit:
    # - torch.distributed.nn.functional evaluates `group=group.WORLD` in its functions'
    #   defaults on import; DDP's constructor imports it (through torch._dynamo) after the group
    #   exists, so the defaults held the group. init_distributed imports it first (None).
    # - a DeviceMesh keeps its groups in `_pg_registry`, and DTensor's sharding and
    #   redistribution caches keep FSDP2's meshes alive. Those meshes are unusable once their
    #   groups are destroyed; emptying their registries lets the group go.
    # gc.collect() then frees a wrapped module left in a reference cycle, and with the last
    # reference the destructor joins the threads here, while the interpreter is fully alive.
    dist.destroy_process_group()
    _forget_destroyed_groups()
    gc.collect()


def _forget_destroyed_groups() -> None:
    """Empty the group registry of every live DeviceMesh (see destroy). A no-op when no mesh
    was ever built (the module is then not imported) or where a torch version keeps none."""
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(mesh_module, "DeviceMesh", None)
    if not isinstance(mesh_type, type):
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), mesh_type):  # type(), not isinstance: no __class__ lookups
            registry = getattr(obj, "__dict__", {}).get("_pg_registry")
            if isinstance(registry, dict):
                registry.clear()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def rank_failure_guard(info: DistInfo | None = None) -> Iterator[None]:
    """Turn a failed collective (a peer crashed, was killed or timed out) into RankFailureError,
    whose message names this rank, the collective and the line that called it, and says why,
    instead of a backend error from deep inside backward or all_reduce. Other exceptions pass
    through unchanged."""
    try:
        yield
    except RankFailureError:
        raise
    except (dist.DistError, RuntimeError) as exc:
        text = str(exc)
        markers = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe")
        if not isinstance(exc, dist.DistError) and not any(m in text.lower() for m in markers):
            raise
        info = info or current_info()
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        where = failed_collective(exc)
        raise RankFailureError(
            f"rank {info.rank} of {info.world_size}: a collective operation failed{f' ({where})' if where else ''}, "
            f"so another rank crashed, was killed, or did not answer within the {info.timeout_s:g} s timeout "
            f"(--dist-timeout); stopping this rank too. The last checkpoint written before the failure is intact. "
            f"Backend said: {first[:300]}") from exc


def failed_collective(exc: BaseException) -> str | None:
    """Which collective `exc` came out of, from its traceback: the innermost torch.distributed
    function (all_reduce, broadcast, all_gather_single...: FSDP2's weight gathers end in one of
    them) and the innermost line that led there from the run itself, outside torch and outside
    the plumbing of logitlab.parallel and logitlab.model, with the line that called that one ->
    "all_reduce, called from logitlab/train/layouts.py:49 in <lambda>, called from
    logitlab/train/loss.py:129 in evaluate"; None when no torch.distributed frame is in it."""
    frames = traceback.extract_tb(exc.__traceback__)
    in_torch = [f for f in frames if _is_in(f.filename, "torch", "distributed")]
    if not in_torch:
        return None
    c10d = [f for f in in_torch if Path(f.filename).name == "distributed_c10d.py"]
    name = (c10d or in_torch)[-1].name
    plumbing = (("torch",), ("logitlab", "parallel"), ("logitlab", "model"))
    callers = [f for f in frames[:frames.index(in_torch[0])] if not any(_is_in(f.filename, *p) for p in plumbing)]
    # the innermost two: a hook's one-line lambda says little alone, the loop's function beside it does
    lines = [f"{_short_path(f.filename)}:{f.lineno} in {f.name}" for f in callers[::-1][:2]]
    return ", called from ".join([name, *lines])


def _is_in(filename: str, *package: str) -> bool:
    return os.sep + os.sep.join(package) + os.sep in filename


def _short_path(filename: str) -> str:
    """logitlab/train/loss.py for a file of this package, else the file's name."""
    parts = Path(filename).parts
    if "logitlab" not in parts:
        return parts[-1]
    return "/".join(parts[len(parts) - parts[::-1].index("logitlab") - 1:])   # from the innermost "logitlab"


# --------------------------------------------------------------------------------------------
# Means over ranks and rank 0
# --------------------------------------------------------------------------------------------

def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR'd over every rank (one all-reduce of len(flags) values; every rank must call
    it): ranks that must stop together (a signal that reached some of them, a time limit that
    some passed) agree on it before the next collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tuple(bool(f) for f in flags)
    out = torch.tensor([float(bool(f)) for f in flags], dtype=torch.float64, device=current_info().device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return tuple(bool(v > 0) for v in out.tolist())


def all_reduce_mean(value: torch.Tensor | float) -> torch.Tensor | float:
    """Mean over ranks of a tensor (a detached copy) or a Python float (a float, reduced in
    float64 on this rank's device). Every rank must call it. With equal per-rank batches, the
    mean of the per-rank mean losses is the loss of the whole global batch."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    if not isinstance(value, torch.Tensor):
        if not several:  # no tensor, so no device round trip in a single process
            return float(value)
        return float(all_reduce_mean(torch.tensor(float(value), dtype=torch.float64,
                                                  device=current_info().device)))
    out = value.detach().clone()
    if several:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        out /= dist.get_world_size()
    return out


def is_main_process() -> bool:
    """True on rank 0 (or without a process group), from the live group or torchrun's RANK."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0
