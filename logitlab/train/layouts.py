"""Which ParallelHooks a training process gets: parallel_hooks(config) chooses them from the
layout in the config and whether the run resumes a sharded checkpoint; sharded_hooks runs an
N-D layout (tensor / pipeline parallel, ZeRO stages, hybrid meshes) through the main loop with
sharded checkpoints (sharded_run.NDLayout); nd_hooks runs a data-parallel N-D layout (zero2,
HSDP, activation checkpointing) with the main loop's gathered checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

from logitlab.parallel.apply import parallelize
from logitlab.parallel.mesh import ParallelPlan
from logitlab.parallel.setup import DistInfo, init_distributed
from logitlab.train import runtime
from logitlab.train.config import TrainConfig
from logitlab.train.hooks import ParallelHooks, _launched_distributed
from logitlab.train.sharded_run import CKPT_PREFIX, NDLayout, dp_coordinates, resumes_sharded


def parallel_hooks(config: TrainConfig, run_dir: str | os.PathLike | None = None,
                   resume: bool = False) -> ParallelHooks:
    """The hooks of this process for `config`, chosen in this order:

    - a run resumed from a sharded checkpoint (RUN/dcp-STEP), or a layout only the N-D hooks
      run (tensor or pipeline parallel, ZeRO-1): sharded_hooks, sharded
      checkpoints, on whatever mesh this job has (one process included);
    - other N-D data-parallel layouts (zero2, HSDP, activation checkpointing) under torchrun:
      nd_hooks, gathered checkpoints;
    - ddp / fsdp under torchrun: parallel.py's wrappers; a plain process: the defaults."""
    sharded = resume and run_dir is not None and resumes_sharded(Path(run_dir))
    if not _launched_distributed():
        return sharded_hooks(config, None, resume=resume) if (sharded or config.needs_nd_loop()) else ParallelHooks()
    from logitlab import parallel as P

    info = P.init_distributed(device="cpu" if config.device == "cpu" else None, timeout_s=config.dist_timeout)
    if sharded or config.needs_nd_loop():
        return _watching(sharded_hooks(config, info if info.distributed else None, resume=resume))
    mode = config.data_parallel
    if mode == "none" or not info.distributed:
        return _watching(ParallelHooks())
    plan = config.parallel_plan().resolve(info.world_size)   # the mesh flags checked against the world size
    if mode == "zero2" or plan.dp_replicate > 1 or config.activation_checkpointing != "none":
        return _watching(nd_hooks(config, plan, info))
    mixed = config.precision == "bf16" or (config.precision == "auto" and info.device.type == "cuda")
    return _watching(ParallelHooks(
        rank=info.rank, world_size=info.world_size,
        wrap=lambda m: P.wrap_model(m, mode, mixed_precision=mixed, info=info),
        all_reduce=lambda v: float(P.all_reduce_mean(float(v))), clip=P.clip_grad_norm,
        model_state=P.full_state_dict, optimizer_state=P.full_optimizer_state_dict,
        load_state=P.load_full_state_dict, barrier=P.barrier, sync=P.sync_gradients, agree=P.any_rank))


def _watching(hooks: ParallelHooks) -> ParallelHooks:
    """The hooks of a process torchrun started, with launcher_gone set (parallel.setup.launcher_gone):
    the loop stops, as for SIGTERM, after the step in which any rank saw its launcher die."""
    from logitlab.parallel import setup

    if setup.launched_by_torchrun():
        hooks.launcher_gone = setup.launcher_gone
    return hooks


def sharded_hooks(config: TrainConfig, info: DistInfo | None = None, *, resume: bool = False,
                  plan: ParallelPlan | None = None):
    """ParallelHooks that run `plan` (default: config.parallel_plan()) through the main loop with
    sharded checkpoints. info: this job (None: one plain process). A resume in one process
    trains there whatever layout the run was started with (a sharded checkpoint loads into any
    mesh); a new run in one process must have a layout that fits it."""
    from logitlab.parallel import setup

    plan = plan or config.parallel_plan()
    unsupported = [flag for flag, on in (("--compile", config.compile),
                                         ("--attention-kernel triton", config.attention_kernel == "triton")) if on]
    if unsupported:
        raise ValueError(f"{' and '.join(unsupported)}: not available with sharded layouts (--tp, --pp, "
                         "--parallel zero1, or a resume from dcp-* checkpoints) yet; their steps run eager with SDPA")
    if info is None or not info.distributed:
        info = DistInfo(device=runtime.pick_device(config.device))
        if resume:
            plan = ParallelPlan(parallel="ddp", activation_checkpointing=plan.activation_checkpointing)
    layout = NDLayout(config, plan, info)
    dp_rank, dp = dp_coordinates(layout.plan, info.rank)
    pp_, rep, shard, tp = layout.plan.shape
    ep = f" (ep {layout.plan.ep})" if layout.plan.ep > 1 else ""
    words = (f"pp {pp_} x dp_replicate {rep} x dp_shard {shard}{ep} x tp {tp} ({layout.plan.parallel} over dp) on "
             f"{info.world_size} process(es); sharded checkpoints RUN/{CKPT_PREFIX}STEP")
    return ParallelHooks(
        rank=dp_rank, world_size=dp, is_main=info.is_main, devices=info.world_size, layout=words,
        wrap=layout.wrap, all_reduce=layout.global_mean, clip=layout.clip, barrier=setup.barrier,
        agree=setup.any_rank if info.world_size > 1 else None, setup=layout.setup,
        forward_backward=layout.forward_backward, evaluate=layout.evaluate, save=layout.save)


def nd_hooks(config: TrainConfig, plan: ParallelPlan, info: DistInfo | None = None):
    """ParallelHooks that let the main loop (loop.train) run a data-parallel layout of a plan:
    ddp, zero2, fsdp over dp_shard, HSDP over dp_replicate x dp_shard, with activation
    checkpointing. Checkpoints stay the gathered format (full states on rank 0, fused keys)."""
    from logitlab.parallel import setup, state, tensor, wrap
    from logitlab.parallel.apply import clip_grad_norm_nd

    info = info or init_distributed(device="cpu" if config.device == "cpu" else None)
    plan = plan.resolve(info.world_size)
    if plan.pp > 1 or plan.tp > 1:
        raise ValueError("nd_hooks: --pp and --tp run through sharded_hooks (sharded checkpoints): TP ranks "
                         "share rows, and a pipeline rank holds only its stages, so there is no full state to gather")
    if plan.parallel == "zero1" and plan.dp > 1:
        raise ValueError("nd_hooks: zero1 needs the loop to build parallel.zero.build_zero_optimizer "
                         "(ZeroRedundancyOptimizer); use sharded_hooks")
    holder = {}

    def wrap_model(model):
        holder["par"] = parallelize(model, plan, info, seq_len=config.seq_len,
                                    mixed_precision=config.precision == "bf16")
        return holder["par"].model

    def model_state(wrapped):
        return tensor.join_fused_state(state.full_state_dict(wrapped))

    def load_state(wrapped, full, optimizer, optimizer_state):
        config_ = wrap.unwrap(wrapped).config
        state.load_full_state_dict(wrapped, tensor.split_fused_state(full, config_), optimizer, optimizer_state)

    return ParallelHooks(
        rank=info.rank, world_size=info.world_size, wrap=wrap_model,
        all_reduce=lambda v: float(setup.all_reduce_mean(float(v))),
        clip=lambda wrapped, max_norm: clip_grad_norm_nd(list(wrapped.parameters()), max_norm),
        model_state=model_state, optimizer_state=state.full_optimizer_state_dict, load_state=load_state,
        barrier=setup.barrier, sync=wrap.sync_gradients, agree=setup.any_rank)
