"""Several processes, one model: torch.distributed set-up and data/fully-sharded parallel wrapping.

parallel.py owns everything that differs between one process and many. It uses PyTorch's own
engine only (torchrun, torch.distributed, DDP, FSDP2) and keeps the model single-device: the
Transformer is built as usual and wrapped from outside. The training loop becomes distributed
with a handful of calls, each of which is a no-op in a plain single process:

    info = init_distributed()                    # reads torchrun's RANK / WORLD_SIZE / ...
    model = wrap_model(model.to(info.device), mode, mixed_precision)   # "none" | "ddp" | "fsdp"
    optimizer = ...                              # built AFTER wrap_model (FSDP2 swaps parameters)
    x = shard_for_rank(global_rows, info, micro_step, grad_accum)  # this rank's rows
    with sync_gradients(model, micro_step == grad_accum - 1): loss.backward()
    log(all_reduce_mean(loss))                   # the loss of the whole global batch
    state = full_state_dict(model)               # gathered to rank 0, unwrapped keys
    if info.is_main: save(...)                   # only rank 0 prints, logs and writes

Global batch: global_batch = micro_batch x grad_accum x world_size rows per optimizer step.
Every rank draws the same global batch (same seed) and keeps its own deterministic slice, so
the optimizer sees the same data for any world size and the schedule means the same thing.

Checkpoints hold full (unsharded) tensors in the single-process layout, so a run saved with N
ranks resumes with M. Reading, writing and the file layout are checkpoint.py's; the training
loop is train.py's.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn

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

    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=dev if backend == "nccl" else None)
    _STATE["timeout_s"] = timeout_s
    return current_info()


_STATE = {"timeout_s": DEFAULT_TIMEOUT_S}


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
    whose message names this rank and says why, instead of a backend error from deep inside
    backward or all_reduce. Other exceptions pass through unchanged."""
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
        raise RankFailureError(
            f"rank {info.rank} of {info.world_size}: a collective operation failed, so another rank "
            f"crashed, was killed, or did not answer within the {info.timeout_s:g} s timeout; stopping "
            f"this rank too. The last checkpoint written before the failure is intact. "
            f"Backend said: {first[:300]}") from exc


# --------------------------------------------------------------------------------------------
# Wrapping the model
# --------------------------------------------------------------------------------------------

def fsdp_bf16_supported(device: torch.device) -> bool:
    """bf16 mixed precision under FSDP2 is used on CUDA devices that support bf16 only."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def wrap_model(model: nn.Module, mode: ParallelMode, mixed_precision: bool = False,
               info: DistInfo | None = None) -> nn.Module:
    """Apply data parallelism to a built model, from outside; build the optimizer afterwards.

    "none": the model itself (one process only). "ddp": DistributedDataParallel (rank 0's weights
    broadcast, gradients averaged). "fsdp": FSDP2 `fully_shard` on each of `model.blocks`, then on
    the root (embeddings, final norm, a tied head as one parameter); each rank keeps 1/world_size
    of every parameter, gradient and optimizer moment, as sharded DTensors replacing the
    parameters. mixed_precision: FSDP2 gathers weights in bf16 and reduces gradients in fp32 on
    CUDA devices with bf16, else fp32 with a warning; for "ddp" precision is the loop's autocast."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel mode must be one of {PARALLEL_MODES}, got {mode!r}")
    info = info or current_info()
    if mode == "none":
        if info.distributed:
            raise ValueError(f"parallel mode 'none' with world_size {info.world_size} would train "
                             f"{info.world_size} unrelated copies; use 'ddp' or 'fsdp'")
        return model
    if not dist.is_initialized():
        raise ValueError(f"parallel mode {mode!r} needs a process group: launch with torchrun "
                         "and call init_distributed() first (or use mode 'none')")
    model = model.to(info.device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"fsdp needs the model's layers in `model.blocks` (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    # fully_shard keeps each rank's own slice of the tensor it finds there, so every rank must
    # start from the same weights; copy rank 0's (DDP does the same at construction).
    _broadcast_from_rank0(model)
    policy = MixedPrecisionPolicy()
    if mixed_precision:
        if fsdp_bf16_supported(info.device):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            warnings.warn(f"mixed_precision: bf16 is not supported for FSDP on {info.device}; "
                          "training in fp32", stacklevel=2)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module) -> None:
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile (FSDP2 wraps in place: the same object)."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        model = model.module if ddp else model._orig_mod  # DDP / torch.compile's OptimizedModule
    return model


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


@contextlib.contextmanager
def sync_gradients(model: nn.Module, sync: bool) -> Iterator[None]:
    """Run one micro-step's backward inside this; `sync` is True only on the last micro-step.

    On the other micro-steps gradients are accumulated locally without communication (DDP:
    no_sync(); FSDP2: set_requires_gradient_sync(False)); the last one averages the accumulated
    sum across ranks once. Numerically the same as syncing every micro-step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with (contextlib.nullcontext() if sync else model.no_sync()):
            yield
    elif _is_fsdp(model):
        inner = unwrap(model)
        inner.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip gradients to a global L2 norm of max_norm (None or <= 0: measure only) and return
    the norm before clipping. Same value on every rank: under DDP the gradients are already
    averaged; under FSDP2 the shards' squares are summed over ranks (a DTensor, made full here)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm and max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# --------------------------------------------------------------------------------------------
# Data: the same global batch for every world size
# --------------------------------------------------------------------------------------------

def plan_grad_accum(global_batch: int, micro_batch: int, world_size: int) -> int:
    """grad_accum so that micro_batch x grad_accum x world_size == global_batch (else ValueError)."""
    if min(global_batch, micro_batch, world_size) <= 0:
        raise ValueError(f"global_batch ({global_batch}), micro_batch ({micro_batch}) and world_size "
                         f"({world_size}) must be > 0")
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ValueError(f"global_batch ({global_batch}) must be divisible by micro_batch ({micro_batch}) "
                         f"x world_size ({world_size}) = {per_step}")
    return global_batch // per_step


def rank_slice(n_rows: int, info: DistInfo, micro_step: int = 0, grad_accum: int = 1) -> slice:
    """Rows of a global batch of n_rows that this rank uses on micro-step `micro_step`.

    The global batch is cut into grad_accum consecutive chunks of world_size x b rows, and
    chunk k into world_size consecutive pieces of b rows: rank r's rows on micro-step k are
    [(k·W + r)·b, (k·W + r + 1)·b). Every row is used once per step, whatever W is."""
    parts = grad_accum * info.world_size
    if n_rows % parts:
        raise ValueError(f"global batch of {n_rows} rows cannot be split into grad_accum ({grad_accum}) "
                         f"x world_size ({info.world_size}) = {parts} equal parts")
    if not 0 <= micro_step < grad_accum:
        raise ValueError(f"micro_step ({micro_step}) must be in [0, grad_accum={grad_accum})")
    b = n_rows // parts
    start = (micro_step * info.world_size + info.rank) * b
    return slice(start, start + b)


def shard_for_rank(rows, info: DistInfo, micro_step: int = 0, grad_accum: int = 1):
    """This rank's part of the global batch `rows` (a tensor, array or list; first dim = rows).

    Pass the cheap thing when possible: the global batch's window start offsets, drawn with the
    same seed on every rank, so each rank reads only its own windows from the token file."""
    return rows[rank_slice(len(rows), info, micro_step, grad_accum)]


# --------------------------------------------------------------------------------------------
# Logging and rank 0
# --------------------------------------------------------------------------------------------

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


def main_process_only(fn: Callable) -> Callable:
    """Decorator: run `fn` on rank 0 only; other ranks get None and do nothing."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs) if is_main_process() else None

    return inner


@main_process_only
def print_main(*args: Any, **kwargs: Any) -> None:
    print(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Full state dicts: saved by N ranks, loaded by M
# --------------------------------------------------------------------------------------------

def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _use_dcp(model: nn.Module) -> bool:
    return dist.is_initialized() and (
        isinstance(model, nn.parallel.DistributedDataParallel) or _is_fsdp(model))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Model weights as full CPU tensors with the unwrapped model's keys, on rank 0 ({} on the
    others). Every rank must call it (FSDP2 all-gathers the shards)."""
    if not _use_dcp(model):
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Optimizer state on rank 0 ({} on the others) in torch.optim's own layout (parameters
    numbered 0.. in param-group order), exactly what `optimizer.state_dict()` gives in a single
    process, so one checkpoint format serves every world size."""
    if not _use_dcp(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not by_name:
        return {}
    ids = {name: i for i, name in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
    groups = [{**g, "params": [ids[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {ids[name]: value for name, value in by_name["state"].items()}, "param_groups": groups}


def _fill_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add keys of tied parameters stored once (e.g. lm_head.weight beside tok_emb.weight)."""
    aliases: dict[int, list[str]] = {}
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    state = dict(state)
    for names in aliases.values():
        present = [n for n in names if n in state]
        for n in names:
            if present and n not in state:
                state[n] = state[present[0]]
    return state


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor],
                         optimizer: torch.optim.Optimizer | None = None,
                         optimizer_state: dict | None = None) -> None:
    """Load full tensors written by `full_state_dict` / `full_optimizer_state_dict` (any world size)
    into a wrapped or plain model and its optimizer. Every rank passes the same full dicts (read
    from the checkpoint, so the run directory must be visible to every node); each keeps its shard."""
    state = _fill_tied(model, state)
    if not _use_dcp(model):
        unwrap(model).load_state_dict(state)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, state, options=_options())
    if optimizer is None or optimizer_state is None:
        return
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's: build it after wrap_model")
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved = optimizer_state["param_groups"]
    if [len(g) for g in groups] != [len(g["params"]) for g in saved]:
        raise ValueError(f"optimizer state has param groups of sizes {[len(g['params']) for g in saved]}, "
                         f"the optimizer has {[len(g) for g in groups]}")
    name_of = {i: n for g_saved, g_names in zip(saved, groups) for i, n in zip(g_saved["params"], g_names)}
    by_name = {"state": {name_of[int(i)]: v for i, v in optimizer_state["state"].items()},
               "param_groups": [{**g, "params": names} for g, names in zip(saved, groups)]}
    set_optimizer_state_dict(model, optimizer, by_name, options=_options())
