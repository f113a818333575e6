"""A run's step count fitted to its time limit from its own steps.

budget.py plans a run from a timing taken before it (a few steps on random ids); on a machine that
gets busier or quieter than when it was timed, that plan is wrong: under load it once planned one
step for a 60 s budget and overran it. Here the plan is made again from the run's own first steps,
so that the schedule (warmup, then the decay to its end) still ends at the run's last step and
inside the limit.

timefit.py owns that re-plan: TimeFit (what the caller fixed, and the clock), `replan` (the
arithmetic, a pure function) and Replanner (the loop's side: the step times, the run's config and
schedule swapped for the new plan, run.json rewritten so that a resume continues that plan). The
loop (loop.py) calls Replanner.after_step; what to print is the caller's ("plan" events).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from logitlab.train import budget
from logitlab.train.build import Run, write_run_files

# Below this many steps a run stays far from what its model reaches with a full schedule: the
# tiny preset (1.3 M parameters, AdamW and the cosine) went from ln V = 8.32 to 3.63 in 1,016 steps on
# an idle 2-core machine (docs/training.md), and after 300 it is still well above that.
FEW_STEPS = 300


@dataclass(frozen=True)
class TimeFit:
    """How a new run fits its step count to TrainConfig.time_limit_s: after each of its first
    `replan_steps` steps it plans again from the median time of the steps so far (the first
    step, which pays one-time costs, left out once others are timed), and the last of these
    plans stands. max_steps, eval_every and warmup_steps are the caller's own, kept (None:
    chosen here: no bound, about `evals` evaluations, TrainConfig's default warmup). A plan
    under `few_steps` steps is marked `few`. `clock` is the time source of the plan and of the
    limit (time.perf_counter; tests pass their own)."""

    max_steps: int | None = None
    eval_every: int | None = None
    warmup_steps: int | None = None
    evals: int = 10
    replan_steps: int = 3
    few_steps: int = FEW_STEPS
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        for name in ("max_steps", "evals", "replan_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"TimeFit.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "warmup_steps", "few_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"TimeFit.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Plan:
    """A plan made after `step` steps: `steps` in all, evaluating every `eval_every`, at
    `step_s` seconds a step (measured) within `limit_s`. `final`: the plan that stands (the last
    re-plan, or one that ends the run at this step); `few`: fewer than TimeFit.few_steps."""

    step: int
    steps: int
    eval_every: int
    warmup_steps: int
    step_s: float
    limit_s: float
    final: bool
    few: bool


def replan(fit: TimeFit, limit_s: float, elapsed_s: float, step_times: list[float], done: int,
           eval_share: float = 0.0) -> tuple[int, int, float]:
    """-> (steps in all, evaluation interval, seconds a step) for a run that has done `done`
    steps taking `step_times` seconds each and `elapsed_s` in all (evaluations included): `done`
    plus what still fits in budget.PLANNED_SHARE of `limit_s` at the median step time (the first
    left out once others are timed), an evaluation costing `eval_share` steps. No step fits:
    the run ends at `done`."""
    if not step_times or done < 1:
        raise ValueError(f"replan needs the times of the steps done, got {step_times} for {done} steps")
    step_s = statistics.median(step_times[1:] or step_times)
    eval_s = step_s * eval_share
    room = budget.PLANNED_SHARE * limit_s - elapsed_s              # seconds the plan still has
    more = 0
    if step_s > 0 and room >= step_s + eval_s:
        left = budget.fit_steps_to_budget(room / budget.PLANNED_SHARE, step_s, eval_s, eval_every=fit.eval_every,
                                          evals=fit.evals)
        more = left.steps
    steps = done + more if fit.max_steps is None else max(done, min(fit.max_steps, done + more))
    every = fit.eval_every if fit.eval_every is not None else -(-steps // fit.evals)   # ceil
    return steps, every, step_s


class Replanner:
    """The loop's side of a TimeFit, for a run starting at step 0: `after_step` re-plans after
    each of the first fit.replan_steps steps and swaps the run's config and schedule for the
    plan (run.json rewritten)."""

    def __init__(self, fit: TimeFit, run: Run, started: float) -> None:
        c = run.config
        if c.time_limit_s is None:
            raise ValueError("a TimeFit needs TrainConfig.time_limit_s (the budget it fits the steps to)")
        self.fit, self.started, self.times = fit, started, []
        # an evaluation's cost in steps (a forward pass over eval_tokens; budget.eval_seconds)
        self.eval_share = (budget.eval_seconds(1.0, c.grad_accum, c.batch_size, run.seq_len, c.eval_tokens)
                           if run.has_val else 0.0)

    def after_step(self, run: Run, step_s: float, now: float) -> Plan | None:
        """After step run.step took `step_s` seconds (at time `now`): the new plan, applied, while
        the first fit.replan_steps steps run; None after them."""
        fit, c = self.fit, run.config
        if run.step > fit.replan_steps:
            return None
        self.times.append(step_s)
        steps, every, measured = replan(fit, c.time_limit_s, now - self.started, self.times, run.step,
                                        self.eval_share)
        warmup = None if fit.warmup_steps is None else min(fit.warmup_steps, steps)
        new = dataclasses.replace(c, steps=steps, eval_every=every, warmup_steps=warmup)
        if new != c:
            run.config, run.schedule = new, new.schedule()
            write_run_files(run)                                   # a resume continues this plan
        final = run.step == fit.replan_steps or steps <= run.step
        return Plan(run.step, steps, every, new.warmup_steps, measured, c.time_limit_s, final, steps < fit.few_steps)
