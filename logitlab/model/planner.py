"""Planning a training run from the accounting (accounting.py does the counting; this module
answers a planner's questions with it): when a step does not fit in memory, what would (the
largest batch at this context, the largest context at this batch, or how many ranks fully
sharded training needs); what the weights are under bf16 autocast; whether a step time was
measured at a rate that does not belong to the device being planned for; and the classic
12·D²·L estimate beside this model's own formula, part by part.

Every function returns plain values; the CLI (`logitlab params`) renders them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from logitlab.model import accounting as acc
from logitlab.model.config import ModelConfig

# A step planned at a CPU's measured rate is probably meant for an accelerator when it needs
# this much memory or takes this long even at 100% MFU.
GPU_SIZED_BYTES = 4 * 2**30
GPU_SIZED_SECONDS = 10.0
TYPICAL_MFU = 0.4          # a well-tuned dense training step reaches roughly 30-50% MFU
MAX_WORLD_SIZE = 4096


@dataclass(frozen=True)
class FitAdvice:
    """What fits in `memory_limit` bytes when the planned step does not (None: nothing does)."""

    memory_limit: int
    state_bytes: int                 # fp32 weights + gradients + AdamW moments: 16 bytes per parameter
    largest_batch: int | None        # at the planned context
    largest_context: int | None      # at the planned batch
    sharded_world_size: int | None   # ranks for fully sharded state (FSDP / ZeRO-3) at the planned batch
    sharded_micro_batch: int | None  # sequences per rank then

    def as_dict(self) -> dict:
        return asdict(self)


def _fits(config: ModelConfig, batch: int, context: int, dtype: str, n_params: int, limit: int) -> bool:
    return acc.plan_training(config, batch, context, dtype, n_params=n_params).total <= limit


def _largest(fits, high: int) -> int | None:
    """The largest n in [1, high] with fits(n) (fits is monotone: true up to some n), or None."""
    if not fits(1):
        return None
    lo, hi = 1, high
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def sharded_plan(config: ModelConfig, batch: int, context: int, dtype: str, n_params: int,
                 limit: int) -> tuple[int | None, int | None]:
    """(world size W, micro-batch per rank) of the smallest power-of-two W at which fully sharded
    training fits per rank: 16·N / W bytes of state plus the activations and logits of
    ceil(batch / W) sequences. (None, None) when no W up to MAX_WORLD_SIZE does."""
    world = 1
    while world <= MAX_WORLD_SIZE:
        micro = -(-batch // world)
        per_rank = acc.plan_training(config, micro, context, dtype, n_params=n_params)
        state = per_rank.weights + per_rank.gradients + per_rank.optimizer
        if state / world + per_rank.activations + per_rank.logits <= limit:
            return world, micro
        world *= 2
    return None, None


def fit_advice(config: ModelConfig, plan: acc.TrainingPlan) -> FitAdvice | None:
    """For a plan that does not fit its memory limit: the largest batch and context that do on
    one device, and the ranks fully sharded training would need. None when it fits (or has no limit)."""
    if plan.memory_limit is None or plan.fits:
        return None
    limit, N, dtype = plan.memory_limit, plan.n_params, plan.dtype
    batch = _largest(lambda b: _fits(config, b, plan.context, dtype, N, limit), plan.batch_size)
    context = _largest(lambda t: _fits(config, plan.batch_size, t, dtype, N, limit), plan.context)
    world, micro = sharded_plan(config, plan.batch_size, plan.context, dtype, N, limit)
    return FitAdvice(limit, plan.weights + plan.gradients + plan.optimizer, batch, context, world, micro)


def weights_note(dtype: str, n_params: int) -> dict | None:
    """Under a 16-bit compute dtype: the weights stay fp32 master copies (what AdamW updates) and
    autocast makes a 16-bit compute copy of each as a matmul uses it. None for fp32."""
    if dtype in ("fp32", "float32"):
        return None
    return dict(dtype=dtype, master_bytes=4 * n_params, compute_bytes=acc.dtype_bytes(dtype) * n_params)


def rate_note(plan: acc.TrainingPlan, measured_on_cpu: bool) -> bool:
    """Whether a step time measured at this CPU's matmul rate is for an accelerator-sized plan."""
    seconds = plan.seconds_per_step or 0.0
    return measured_on_cpu and (plan.total >= GPU_SIZED_BYTES or seconds >= GPU_SIZED_SECONDS
                                or (plan.memory_limit or 0) >= GPU_SIZED_BYTES)


def classic_table(config: ModelConfig) -> list[dict]:
    """The classic 12·D²·L beside this model's formula, per layer, with the reason they differ:
    rows attention (classic 4·D²), MLP (classic 8·D²) and all L layers (12·D²·L)."""
    c, f = config, acc.formula_count(config)
    D = c.d_model
    attention_why = []
    if c.n_kv_heads != c.n_heads:
        attention_why.append(f"GQA: k, v have {c.n_kv_heads} of {c.n_heads} heads")
    if c.n_heads * c.head_dim != D:
        attention_why.append(f"H·Dh = {c.n_heads * c.head_dim}, not D = {D}")
    if c.attn_gate != "none":
        attention_why.append(f"{c.attn_gate} output gate")
    width = 3 if c.mlp == "swiglu" else 2
    mlp_why = "" if width * c.d_ff == 8 * D else f"{c.mlp}: {width}·D·F with F = {c.d_ff}"
    mlp = f.mlp_per_layer
    if c.is_moe:   # an MoE layer (accounting_moe): router + E experts, K of them active
        mlp = f.moe_per_layer
        mlp_why = (f"MoE: router + {c.n_experts} experts of 3·D·F, F = {c.moe_d_ff}"
                   + (f" + a shared expert of F = {c.shared_expert_d_ff}" if c.shared_expert_d_ff else "")
                   + f"; a token uses {c.n_experts_per_token} of them")
    layers_why = "" if f.layers == f.classic else "the rows above, over all layers"
    if f.n_linear_layers:
        layers_why = f"{f.n_linear_layers} of {c.n_layers} layers are linear attention"
    return [dict(part="attention / layer", classic=4 * D * D, formula=f.attention_per_layer,
                 classic_rule="4·D² (MHA, H·Dh = D)", why="; ".join(attention_why) or "same shape"),
            dict(part="MLP / layer", classic=8 * D * D, formula=mlp,
                 classic_rule="8·D² (GELU, F = 4·D)", why=mlp_why or "same shape"),
            dict(part=f"all {c.n_layers} layers", classic=f.classic, formula=f.layers,
                 classic_rule="12·D²·L", why=layers_why or "same shape")]
