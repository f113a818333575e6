"""Per-rank memory and communication of each parallel layout, from the ZeRO paper's arithmetic
(Rajbhandari et al. 2020, section 3): with Psi parameters trained by Adam,

    mixed precision (bf16/fp16 compute):  weights 2·Psi  gradients 2·Psi  optimizer K·Psi, K = 12
                                          (fp32 master weights, first and second moments)
    float32 (what a CPU rank trains in):  weights 4·Psi  gradients 4·Psi  optimizer K·Psi, K = 8

ZeRO-1 divides the optimizer term by the data-parallel degree N, ZeRO-2 also the gradients,
ZeRO-3 (FSDP) also the weights. Tensor parallelism divides the block matrices by the TP degree
and pipeline parallelism the layers by the PP degree (both approximately: embeddings, norms and
the head sit on some ranks only). Activations follow accounting.activation_elements_per_token
for this rank's micro-batch, divided by TP under sequence parallelism, and shrink with
activation checkpointing. Communication is per rank per step, ring algorithms: an all-reduce
moves 2·(N-1)/N of the buffer, a reduce-scatter or all-gather (N-1)/N.

Everything here is arithmetic on a ModelConfig: no process group, no tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from logitlab.model import accounting as acc
from logitlab.model.config import ModelConfig

AC_MODES = ("none", "selective", "full")
_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds during a training step (`total`), by kind, and the bytes it sends and
    receives per step for gradients and weights (`comm`: collective name -> bytes)."""

    parallel: str
    world_size: int
    n_params: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    comm: dict

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _check(parallel: str, world_size: int, tp: int, pp: int, ac: str) -> None:
    if parallel not in _STAGES:
        raise ValueError(f"parallel must be one of {tuple(_STAGES)}, got {parallel!r}")
    for name, value in (("world_size", world_size), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp):
        raise ValueError(f"world_size ({world_size}) must be divisible by tp ({tp}) x pp ({pp})")
    if ac not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, got {ac!r}")


def state_bytes_per_param(mixed_precision: bool) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter before any sharding: (2, 2, 12) in
    mixed precision, (4, 4, 8) in float32."""
    return (2, 2, 12) if mixed_precision else (4, 4, 8)


def activation_bytes(config: ModelConfig, tokens: int, dtype_bytes: int, ac: str = "none",
                     tp: int = 1, pp: int = 1) -> int:
    """Activations one rank keeps for backward: `tokens` of its micro-batch, its L / pp layers.
    none: every layer's values; full: each layer's input (D per token) and the final norm's
    values (backward then rebuilds one layer's values at a time on top of this); selective:
    matrix products' outputs kept, norms and pointwise values recomputed (the norms' 4·D and the
    MLP's activation values drop out). Sequence/tensor parallelism divides by tp."""
    per_token = acc.activation_elements_per_token(config)
    layers = max(1, config.n_layers // pp)
    per_layer = per_token / config.n_layers
    if ac == "full":
        kept = layers * config.d_model + 2 * config.d_model
    elif ac == "selective":
        recomputed = 4 * config.d_model + (2 * config.d_ff if config.mlp == "swiglu" else config.d_ff)
        kept = layers * max(per_layer - recomputed, config.d_model)
    else:
        kept = layers * per_layer
    return int(tokens * kept * dtype_bytes / tp)


def plan_rank_memory(config: ModelConfig, world_size: int, parallel: str = "ddp", *, micro_batch: int = 1,
                     context: int | None = None, mixed_precision: bool = True, tp: int = 1, pp: int = 1,
                     activation_checkpointing: str = "none", n_params: int | None = None) -> RankMemory:
    """Per-rank memory (and communication) of training `config` on `world_size` ranks with ZeRO
    stage `parallel` over the data-parallel ranks (world_size / (tp x pp) of them), each running
    `micro_batch` sequences of `context` tokens per micro-step."""
    _check(parallel, world_size, tp, pp, activation_checkpointing)
    psi = n_params if n_params is not None else acc.count_parameters(config).total
    dp = world_size // (tp * pp)
    local = psi / (tp * pp)                                   # parameters in this rank's model part
    wb, gb, ob = state_bytes_per_param(mixed_precision)
    stage = _STAGES[parallel]
    weights = wb * local / (dp if stage >= 3 else 1)
    grads = gb * local / (dp if stage >= 2 else 1)
    opt = ob * local / (dp if stage >= 1 else 1)
    T = context or config.context_length
    act_dtype = 2 if mixed_precision else 4
    acts = activation_bytes(config, micro_batch * T, act_dtype, activation_checkpointing, tp, pp)
    logits = 2 * micro_batch * T * config.vocab_size * 4 // tp   # fp32 logits and their gradient
    return RankMemory(parallel, world_size, psi, int(weights), int(grads), int(opt), acts,
                      logits if pp == 1 else logits // pp, _comm(stage, local * gb, dp))


def _comm(stage: int, grad_bytes: float, dp: int) -> dict:
    """Bytes each rank sends (and receives) per step over the data-parallel group, ring algorithms."""
    if dp == 1:
        return {}
    share = (dp - 1) / dp
    if stage <= 1:  # ZeRO-1 reduce-scatters gradients and all-gathers the updated weights: the same
        return {"all_reduce": int(2 * share * grad_bytes)}
    if stage == 2:
        return {"reduce_scatter": int(share * grad_bytes), "all_gather": int(share * grad_bytes)}
    return {"reduce_scatter": int(share * grad_bytes), "all_gather": int(2 * share * grad_bytes)}


def plan_all_stages(config: ModelConfig, world_size: int, **kw) -> list[RankMemory]:
    """plan_rank_memory for ddp, zero1, zero2 and fsdp side by side (the planner's table)."""
    return [plan_rank_memory(config, world_size, stage, **kw) for stage in _STAGES]


def bubble_fraction(pp: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step: (p - 1) / (m + p - 1) for GPipe and 1F1B; an interleaved
    schedule with v stages per rank divides the warm-up by v: (p - 1) / (v·m + p - 1)."""
    if pp < 1 or n_microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pp ({pp}), n_microbatches ({n_microbatches}) and virtual_stages ({virtual_stages}) "
                         "must be >= 1")
    return (pp - 1) / (virtual_stages * n_microbatches + pp - 1)
