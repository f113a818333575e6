"""Pipeline parallelism through torch.distributed.pipelining: a built Transformer cut into
stages by layer (the embedding goes with the first stage, the final norm and LM head with the
last), each rank running its stage(s), and a schedule moving micro-batches through them.

    gpipe             every micro-batch forward, then every backward (activations of all m kept)
    1f1b              after a warm-up of p - 1 forwards, one forward then one backward
                      (at most p micro-batches of activations in flight)
    interleaved_1f1b  v stages per rank (stage s on rank s mod p), shorter warm-up and bubble

With p stages and m micro-batches the plain schedules leave a rank idle for a share
(p - 1) / (m + p - 1) of the step (planner.bubble_fraction); `StageTimer` measures the time
each stage spends computing, so the idle share of a real step can be put beside it. The loss is
computed on the last stage, per micro-batch, and the schedule divides gradients by m, so the
gradients are those of the mean loss over the global batch, as in one process.

A stage module keeps the model's keys for the parts it holds (blocks.{i}... with the original
i), so sharded checkpoints of a pipeline and of any other layout hold the same names.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.parallel.planner import bubble_fraction


class StageModule(nn.Module):
    """The layers `layer_ids` of a Transformer, with its embeddings when `first` and its final
    norm and head when `last`. forward: ids (B, T) (first) or h (B, T, D) -> h (B, T, D), or
    logits (B, T, V) on the last stage."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.config, self.attn_impl, self.first, self.last = model.config, model.attn_impl, first, last
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.rope = model.rope
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layer_ids})
        self.final_norm = model.final_norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            ids = x                                                  # (B, T)
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)   # (1, T)
            x = self.tok_emb(ids)                                    # (B, T, D)
            if self.pos_emb is not None:
                x = x + self.pos_emb(positions)
        T = x.shape[1]
        positions = torch.arange(T, device=x.device).unsqueeze(0)   # (1, T)
        rope = None
        if self.rope is not None:
            cos, sin = self.rope(positions)                          # (1, T, 1, R)
            rope = (cos.to(x.dtype), sin.to(x.dtype))
        slots = torch.arange(T, device=x.device)
        for name, block in self.blocks.items():
            window = block.layer_type == "sliding_attention"
            x, _ = block(x, rope, layer=int(name), mask=(None, slots) if window else None,
                         is_causal=not window, impl=self.attn_impl)
        if not self.last:
            return x                                                 # (B, T, D)
        h = self.final_norm(x)
        V = self.config.vocab_size
        if self.lm_head.weight.shape[0] == V:
            return self.lm_head(h)                                   # (B, T, V); a TP head gathers V
        return F.linear(h, self.lm_head.weight[:V])                  # (B, T, V) of a padded head


def split_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """Layer ids of each stage: consecutive, as equal as possible (earlier stages take the extra
    layer, the last also computes the head)."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} pipeline stages "
                         "(need n_layers >= pp x virtual_stages)")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def build_stages(model: nn.Module, pp_rank: int, pp: int, virtual_stages: int = 1) -> list[tuple[int, StageModule]]:
    """(stage index, StageModule) of every stage rank `pp_rank` runs: stage s runs on rank s mod pp."""
    if model.config.tie_embeddings and pp > 1:
        raise ValueError("pipeline parallel with tie_embeddings=True is not supported: the embedding (first "
                         "stage) and the LM head (last stage) would be one parameter on two ranks; untie them")
    n_stages = pp * virtual_stages
    layers = split_layers(model.config.n_layers, n_stages)
    return [(s, StageModule(model, layers[s], s == 0, s == n_stages - 1))
            for s in range(pp_rank, n_stages, pp)]


class PipelineLoss:
    """The last stage's loss of one micro-batch: mean cross-entropy of logits (b, T, V) against
    targets (b, T), times `weight`. The schedule is built with scale_grads=False (it would divide
    the accumulated gradients again on every step of a gradient accumulation), so the weight
    carries both the 1 / m of the micro-batches and the caller's own scale (1 / grad_accum)."""

    def __init__(self, n_microbatches: int):
        self.n_microbatches = n_microbatches
        self.weight = 1.0 / n_microbatches

    def set_scale(self, scale: float) -> None:
        self.weight = scale / self.n_microbatches

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) * self.weight


def build_schedule(stages: list[tuple[int, nn.Module]], n_stages: int, schedule: str, n_microbatches: int,
                   device: torch.device, group=None):
    """The torch.distributed.pipelining schedule over this rank's stage modules (already wrapped
    by FSDP2 when data parallel)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pipe_stages = [PipelineStage(module, index, n_stages, device, group=group) for index, module in stages]
    loss = PipelineLoss(n_microbatches)
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(pipe_stages, n_microbatches, loss_fn=loss, scale_grads=False)
    if len(pipe_stages) != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank, got {len(pipe_stages)}")
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(schedule)
    if kind is None:
        raise ValueError(f"pipeline schedule must be gpipe, 1f1b or interleaved_1f1b, got {schedule!r}")
    return kind(pipe_stages[0], n_microbatches, loss_fn=loss, scale_grads=False)


def run_schedule(schedule, stages, n_stages: int, x: torch.Tensor, y: torch.Tensor,
                 scale: float = 1.0) -> list[torch.Tensor]:
    """One forward and backward over this replica's batch x, y (B, T), cut into the schedule's
    micro-batches, gradients scaled by `scale` and accumulated -> the micro-batches' mean
    cross-entropies (on the last stage's rank; [] elsewhere). B must divide by m."""
    m = schedule._n_microbatches
    if x.shape[0] % m:
        raise ValueError(f"pipeline: batch of {x.shape[0]} rows cannot be cut into {m} equal micro-batches")
    indices = {index for index, _ in stages}
    has_first, has_last = 0 in indices, (n_stages - 1) in indices
    losses: list[torch.Tensor] = []
    args = (x,) if has_first else ()
    kwargs = {"target": y, "losses": losses} if has_last else {}
    loss_fn = schedule._loss_fn
    loss_fn.set_scale(scale)
    schedule.step(*args, **kwargs)
    return [v.detach() / loss_fn.weight for v in losses]


class StageTimer:
    """Time a stage module spends in forward (hooks around its call) and in backward (hooks on
    its output's gradient), summed; `idle_fraction(step_seconds)` is the rest of a step's wall
    time, to set beside planner.bubble_fraction."""

    def __init__(self, module: nn.Module):
        self.forward_s = self.backward_s = 0.0
        self._t0 = None
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)
        module.register_full_backward_pre_hook(lambda m, g: self._start(m, None))
        module.register_full_backward_hook(lambda m, gi, go: self._stop_backward())

    def _start(self, module, args):
        self._t0 = time.perf_counter()

    def _stop(self, module, args, out):
        if self._t0 is not None:
            self.forward_s += time.perf_counter() - self._t0
            self._t0 = None

    def _stop_backward(self):
        if self._t0 is not None:
            self.backward_s += time.perf_counter() - self._t0
            self._t0 = None

    def reset(self) -> None:
        self.forward_s = self.backward_s = 0.0

    def idle_fraction(self, step_seconds: float) -> float:
        busy = self.forward_s + self.backward_s
        return max(0.0, 1.0 - busy / step_seconds) if step_seconds > 0 else 0.0


__all__ = ["StageModule", "StageTimer", "bubble_fraction", "build_schedule", "build_stages", "run_schedule",
           "split_layers"]
