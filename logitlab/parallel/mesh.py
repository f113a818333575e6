"""The N-D layout of a job: how many ranks each kind of parallelism takes, checked against the
world size, and the DeviceMesh whose named dimensions the other modules shard over.

    dims (outer to inner)  pp, dp_replicate, dp_shard, tp
    world size             pp x dp_replicate x dp_shard x tp

The innermost dimension is tensor parallelism, whose collectives run inside every layer: on a
GPU cluster its ranks should share a node (NVLink); pipeline stages exchange only activations
at their borders and sit outermost. dp_shard ranks shard weights, gradients and optimizer state
(FSDP2); dp_replicate ranks hold replicas of those shards (HSDP when both are > 1). A plan
with dp_shard = -1 takes every rank the other dimensions leave.

Expert parallelism borrows data-parallel ranks, as torchtitan does: the dp_shard ranks of a
mixture-of-experts model split into dp_shard / ep groups of ep consecutive ranks, each group
holding every expert once (E / ep per rank) and trading tokens by all-to-all (expert.py). The
other weights stay sharded over all dp_shard ranks; the experts are sharded over the rest
(`efsdp` = dp_shard / ep, and dp_replicate). expert_mesh gives that view of the same ranks:

    dims (outer to inner)  pp, dp_replicate, efsdp, ep, tp      (efsdp x ep = dp_shard)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from logitlab.parallel.activation import AC_MODES
from logitlab.parallel.setup import DistInfo
from logitlab.parallel.zero import ZERO_STAGES

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_FLAGS = {"pp": "--pp", "dp_replicate": "--dp-replicate", "dp_shard": "--dp-shard", "tp": "--tp", "ep": "--ep"}


@dataclass(frozen=True)
class ParallelPlan:
    """One job's parallel layout and the options that go with it.

    parallel: the data-parallel method over dp ranks (ddp, zero1, zero2, fsdp); with tp or pp
    > 1 it must be an FSDP2 stage (zero2 or fsdp) or, with a single dp rank, anything.
    n_microbatches: pipeline micro-batches per step (default: 2 x pp).
    ep: expert-parallel degree, a divisor of dp_shard (see the module docstring); with ep > 1
    `parallel` must be an FSDP2 stage."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    parallel: str = "fsdp"
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    pp_schedule: str = "1f1b"
    n_microbatches: int | None = None
    virtual_stages: int = 1
    compile: bool = False
    ep: int = 1

    def __post_init__(self):
        for name in ("pp", "dp_replicate", "tp", "virtual_stages", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({_FLAGS.get(name, name)}) must be a positive integer, got {value!r}")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"dp_shard (--dp-shard) must be a positive integer or -1 (the rest), "
                             f"got {self.dp_shard!r}")
        if self.parallel not in ZERO_STAGES:
            raise ValueError(f"parallel must be one of {ZERO_STAGES}, got {self.parallel!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, "
                             f"got {self.activation_checkpointing!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        if (self.pp_schedule == "interleaved_1f1b") != (self.virtual_stages > 1) and self.pp > 1:
            raise ValueError(f"pp_schedule {self.pp_schedule!r} with virtual_stages={self.virtual_stages}: the "
                             "interleaved schedule needs virtual_stages >= 2, the others exactly 1")
        if self.n_microbatches is not None and self.n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {self.n_microbatches}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it shards the sequence over the TP ranks)")

    def resolve(self, world_size: int) -> "ParallelPlan":
        """The plan with dp_shard filled in, or ValueError naming the flags when the product of
        the dimensions is not the world size."""
        others = self.pp * self.dp_replicate * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(f"world size {world_size} is not divisible by --pp {self.pp} x --dp-replicate "
                                 f"{self.dp_replicate} x --tp {self.tp} = {others}")
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            raise ValueError(f"--pp {self.pp} x --dp-replicate {self.dp_replicate} x --dp-shard {dp_shard} x --tp "
                             f"{self.tp} = {product}, but the world size is {world_size} (torchrun "
                             "--nproc_per_node x --nnodes); make the product equal it")
        plan = dataclasses.replace(self, dp_shard=dp_shard)
        _check_ep(plan)
        if plan.parallel in ("ddp", "zero1") and (plan.tp > 1 or plan.pp > 1 or plan.dp_replicate > 1) \
                and plan.dp > 1:
            raise ValueError(f"parallel {plan.parallel!r} is plain data parallelism over every rank; with --tp, "
                             "--pp or --dp-replicate use 'fsdp' or 'zero2' (FSDP2 over the dp dimensions)")
        return plan

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different rows of the global batch."""
        return self.dp_replicate * max(self.dp_shard, 1)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def microbatches(self) -> int:
        return self.n_microbatches or 2 * self.pp * self.virtual_stages


def _check_ep(plan: ParallelPlan) -> None:
    if plan.ep == 1:
        return
    if plan.dp_shard % plan.ep:
        raise ValueError(f"--ep {plan.ep} must divide --dp-shard {plan.dp_shard}: expert parallelism splits the "
                         "data-parallel shard ranks into groups of ep ranks that hold every expert once")
    if plan.parallel not in ("fsdp", "zero2"):
        raise ValueError(f"--ep {plan.ep} composes with FSDP2 ('fsdp' or 'zero2'), not parallel {plan.parallel!r}: "
                         "the experts are sharded over the ep ranks and the rest over the dp ranks")
    if plan.pp > 1 or plan.tp > 1:
        raise ValueError(f"--ep {plan.ep} with --pp {plan.pp} / --tp {plan.tp}: expert parallelism composes with "
                         "data parallelism here (FSDP, HSDP), not yet with tensor or pipeline parallelism")


def build_mesh(plan: ParallelPlan, info: DistInfo):
    """The 4-D DeviceMesh (pp, dp_replicate, dp_shard, tp) of a resolved plan (size-1 dims included,
    so every module can ask for any dim by name)."""
    from torch.distributed.device_mesh import init_device_mesh

    plan = plan.resolve(info.world_size)
    return init_device_mesh(info.device.type, plan.shape, mesh_dim_names=MESH_DIMS)


def dp_coordinates(plan: ParallelPlan, mesh) -> DistInfo:
    """This rank as a data-parallel rank: DistInfo(rank=its dp index, world_size=dp), for
    wrap.shard_for_rank. TP ranks and pipeline stages of one replica share the dp index."""
    rank = mesh["dp_replicate"].get_local_rank() * plan.dp_shard + mesh["dp_shard"].get_local_rank()
    return DistInfo(rank=rank, world_size=plan.dp)


def dp_mesh(plan: ParallelPlan, mesh):
    """The DeviceMesh FSDP2 shards over: (dp_replicate, dp_shard), HSDP, when dp_replicate > 1
    (replicas of dp_shard-way shards), else the 1-D dp_shard one."""
    return mesh["dp_replicate", "dp_shard"] if plan.dp_replicate > 1 else mesh["dp_shard"]


def expert_mesh(plan: ParallelPlan, mesh):
    """The same ranks as `mesh` with dp_shard split into (efsdp, ep), ep innermost (an ep group is
    ep consecutive ranks: one node on a GPU cluster), or None when ep is 1. expert.py's
    all-to-all runs over mesh["ep"]; the experts' FSDP2 shards over expert_dp_mesh."""
    if plan.ep == 1:
        return None
    return mesh._unflatten("dp_shard", (plan.dp_shard // plan.ep, plan.ep), ("efsdp", "ep"))


def expert_dp_mesh(plan: ParallelPlan, emesh):
    """The mesh the experts' FSDP2 shards over: (dp_replicate, efsdp) when dp_replicate > 1, else efsdp."""
    return emesh["dp_replicate", "efsdp"] if plan.dp_replicate > 1 else emesh["efsdp"]
