"""`logitlab train --time-limit-s`: the step count, warmup and evaluation interval of a new run
fitted to a time budget. The library does the arithmetic and the re-plan (train.budget,
train.timefit); this module times a step here for the first plan, decides what the user set
(kept through the re-plan), and prints the plans, with a warning when few steps fit."""

from __future__ import annotations

import dataclasses

# The tiny preset with `logitlab train`'s own training (AdamW, the cosine), as `logitlab demo --recipe none`
# trains it, measured on an idle 2-core machine from a fresh clone (docs/training.md): the reference a
# short run's warning names for scale (the demo's speedrun recipe has its own, cli/demo.py).
REFERENCE = {"steps": 1016, "val_loss": 3.63, "ln_v": 8.32, "machine": "an idle 2-core machine"}


def given(args, table: dict, name: str) -> bool:
    """Whether the user set TrainConfig field `name`, by a flag or in the TOML [train] table."""
    return hasattr(args, name) or name in table.get("train", {})


def fit_time_budget(args, table: dict, train_cfg, model, con, hooks):
    """--time-limit-s S on a new run: time a training step here, then choose the step count (at
    most --steps when given) and, unless given, the warmup and evaluation interval, so that the
    whole schedule ends inside S (train.budget). -> (the config, a train.timefit.TimeFit that
    re-plans the same way from the run's own first steps; None when nothing is fitted). The
    limit still stops the run."""
    from logitlab.train import budget, runtime
    from logitlab.train.timefit import TimeFit

    limit = train_cfg.time_limit_s
    if limit is None:
        return train_cfg, None
    if hooks is not None:  # ranks timing on their own could choose different step counts
        con.print(f"[yellow]under torchrun --time-limit-s stops the run at {limit:g} s; the schedule is not "
                  "fitted to it (set --steps)[/yellow]")
        return train_cfg, None
    device = runtime.pick_device(train_cfg.device)
    seq_len = train_cfg.seq_len or model.config.context_length
    _, micro_s = budget.time_training_step(model.to(device), train_cfg.batch_size, seq_len, device=device,
                                           amp_dtype=runtime.autocast_dtype(device, train_cfg.precision))
    step_s = micro_s * train_cfg.grad_accum
    eval_s = budget.eval_seconds(micro_s, 1, train_cfg.batch_size, seq_len, train_cfg.eval_tokens)
    kept = TimeFit(max_steps=train_cfg.steps if given(args, table, "steps") else None,
                   eval_every=train_cfg.eval_every if given(args, table, "eval_every") else None,
                   warmup_steps=train_cfg.warmup_steps if given(args, table, "warmup_steps") else None)
    fit = budget.fit_steps_to_budget(limit, step_s, eval_s, eval_every=kept.eval_every, max_steps=kept.max_steps)
    warmup = None if kept.warmup_steps is None else min(kept.warmup_steps, fit.steps)
    fitted = dataclasses.replace(train_cfg, steps=fit.steps, eval_every=fit.eval_every, warmup_steps=warmup)
    decay = "the cosine" if fitted.lr_schedule == "cosine" else "constant, then the decay"
    con.print(f"time budget {limit:g} s: a step takes {step_s:.3g} s here, so {fit.steps:,} steps fit (warmup "
              f"{fitted.warmup_steps}, then {decay} to step {fit.steps}; evaluating every {fit.eval_every}); "
              f"planned again from the run's own first {kept.replan_steps} steps; the run still stops at {limit:g} s")
    return fitted, kept


def few_steps_warning(steps: int) -> str:
    """What a run of only `steps` steps can expect, against the reference run."""
    ref = REFERENCE
    return (f"only {steps:,} steps: expect a validation loss far above a full run's. For scale, the tiny "
            f"preset (1.3 M parameters, `logitlab demo --recipe none`) went from ln V = {ref['ln_v']:.2f} to "
            f"{ref['val_loss']:.2f} in {ref['steps']:,} steps on {ref['machine']}, and is still well above that "
            "after a few hundred. Give more time, or a fixed number of steps (--steps N without --time-limit-s), "
            "which run however long they take")


class PlanView:
    """A train callback: the plan that stands after the run's first steps (train.timefit), as a
    line, and a warning (few_steps_warning) when few steps fit; `warned` says whether it was given."""

    def __init__(self, con) -> None:
        self.con, self.warned, self.steps = con, False, None

    def __call__(self, event: str, r: dict) -> None:
        if event != "plan":
            return
        self.steps = r["steps"]
        if not r["final"]:
            return
        self.con.print(f"re-planned after {r['step']} step(s) at {r['step_s']:.3g} s a step: {r['steps']:,} steps fit "
                       f"{r['limit_s']:g} s (warmup {r['warmup_steps']}, the schedule ending at step {r['steps']}; "
                       f"evaluating every {r['eval_every']})")
        if r["few"]:
            self.con.print(f"[yellow]warning: {few_steps_warning(r['steps'])}[/yellow]")
            self.warned = True
