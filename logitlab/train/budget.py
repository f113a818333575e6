"""A training run that fits a time budget: measure what a step costs here, then choose the step
count so that the whole schedule (linear warmup, then the cosine decay to min_lr) ends inside the
budget, instead of being cut off part-way with the learning rate still high.

`time_training_step` times real forward + backward passes on random ids (the weights are not
updated); `muon_seconds` adds what Muon's Newton-Schulz products cost on top of AdamW's update;
`fit_steps_to_budget` turns that rate into a step count and an evaluation interval.
`logitlab train --time-limit-s` and `logitlab demo` both use them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from logitlab.train import runtime
from logitlab.train.loss import cross_entropy

# The share of the budget planned for steps and evaluations; the rest absorbs checkpoints, the
# final save and a machine that gets a little busier than when it was timed.
PLANNED_SHARE = 0.9
OPTIMIZER_SHARE = 1.05  # an AdamW update on top of forward + backward
FORWARD_SHARE = 1 / 3   # an evaluation window costs a forward pass, about 1/3 of forward + backward


def time_training_step(model, batch_size: int, seq_len: int, *, device: torch.device | None = None,
                       amp_dtype: torch.dtype | None = None, threads=None, repeats: int = 2) -> tuple[int, float]:
    """(torch threads, seconds per micro-step) for `model` on a (batch_size, seq_len) batch of
    random ids: forward, loss and backward, the fastest of `repeats` after a warm-up, plus an
    AdamW update's share. `threads` are the thread counts to try (runtime.fastest_thread_count;
    default: only the current one, which stays set). The weights are untouched and the gradients
    cleared afterwards."""
    device = device or next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), generator=g).to(device)  # (B, T+1)
    x, y = ids[:, :-1], ids[:, 1:]

    def step() -> None:
        with runtime.autocast(device, amp_dtype):
            logits = model(x)                                       # (B, T, V)
        cross_entropy(logits, y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    was_training = model.training
    model.train()
    try:
        chosen, seconds = runtime.fastest_thread_count(step, threads or (torch.get_num_threads(),), repeats)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return chosen, seconds * OPTIMIZER_SHARE


def muon_seconds(model, ns_steps: int = 5, method: str = "quintic", repeats: int = 2) -> float:
    """Seconds of Muon's updates of `model`'s hidden matrices (optim.param_roles' "matrix", each
    block of rows apart, muon.row_blocks) from random gradients, the fastest of `repeats`: the part
    of a Muon step that time_training_step's AdamW share does not hold. The model is untouched."""
    from logitlab.train.muon import muon_update, row_blocks
    from logitlab.train.optim import param_roles

    blocks, params = row_blocks(model), dict(model.named_parameters())
    matrices = [name for name, role in param_roles(model).items() if role == "matrix"]
    g = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(params[n].shape, generator=g).to(params[n].device) for n in matrices}
    buffers = {n: torch.zeros_like(grad) for n, grad in grads.items()}     # momentum, as the optimizer keeps it
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n, grad in grads.items():
            muon_update(grad, buffers[n], steps=ns_steps, method=method, blocks=blocks.get(n))
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass(frozen=True)
class StepBudget:
    """What fits in `budget_s`: `steps` optimizer steps evaluating every `eval_every` steps,
    planned at `step_s` seconds per step and `eval_s` per evaluation."""

    budget_s: float
    steps: int
    eval_every: int
    step_s: float
    eval_s: float

    @property
    def planned_s(self) -> float:
        evals = (self.steps // self.eval_every if self.eval_every else 0) + 1
        return self.steps * self.step_s + evals * self.eval_s


def eval_seconds(step_s: float, grad_accum: int, batch_size: int, seq_len: int, eval_tokens: int) -> float:
    """An evaluation's cost from a micro-step's: eval_tokens in windows of seq_len, forward only."""
    windows = max(1, eval_tokens // seq_len)
    return step_s / grad_accum * FORWARD_SHARE * windows / batch_size


def fit_steps_to_budget(budget_s: float, step_s: float, eval_s: float = 0.0, *, eval_every: int | None = None,
                        evals: int = 10, min_steps: int = 1, max_steps: int | None = None) -> StepBudget:
    """The most optimizer steps (at `step_s` seconds each, plus evaluations at `eval_s`) that fit
    in PLANNED_SHARE of `budget_s`, within [min_steps, max_steps]. With `eval_every` given the
    run evaluates that often (0: only at the end); without it about `evals` times."""
    for name, value in (("budget_s", budget_s), ("step_s", step_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if eval_s < 0 or evals < 1 or min_steps < 1:
        raise ValueError(f"eval_s ({eval_s}) must be >= 0, evals ({evals}) and min_steps ({min_steps}) >= 1")
    planned = PLANNED_SHARE * budget_s
    if eval_every is None:                       # `evals` evaluations, plus the final one
        steps = int((planned - (evals + 1) * eval_s) / step_s)
    elif eval_every == 0:                        # only the final one
        steps = int((planned - eval_s) / step_s)
    else:                                        # one per eval_every steps: eval_s / eval_every per step
        steps = int((planned - eval_s) / (step_s + eval_s / eval_every))
    steps = max(min_steps, steps if max_steps is None else min(max_steps, steps))
    every = -(-steps // evals) if eval_every is None else eval_every  # ceil: at most `evals` of them
    return StepBudget(budget_s, steps, every, step_s, eval_s)
