"""`logitlab train --time-limit-s`: the step count, warmup and evaluation interval of a new run
fitted to a time budget (the library's train.budget does the arithmetic; this module times the
step here, decides what the user set and prints the plan)."""

from __future__ import annotations

import dataclasses


def given(args, table: dict, name: str) -> bool:
    """Whether the user set TrainConfig field `name`, by a flag or in the TOML [train] table."""
    return hasattr(args, name) or name in table.get("train", {})


def fit_time_budget(args, table: dict, train_cfg, model, con, hooks):
    """--time-limit-s S on a new run: time a training step here, then choose the step count (at
    most --steps when given) and, unless given, the warmup and evaluation interval, so that the
    whole warmup + cosine schedule ends inside S (train.budget). The limit still stops the run."""
    from logitlab.train import budget, runtime

    limit = train_cfg.time_limit_s
    if limit is None:
        return train_cfg
    if hooks is not None:  # ranks timing on their own could choose different step counts
        con.print(f"[yellow]under torchrun --time-limit-s stops the run at {limit:g} s; the schedule is not "
                  "fitted to it (set --steps)[/yellow]")
        return train_cfg
    device = runtime.pick_device(train_cfg.device)
    seq_len = train_cfg.seq_len or model.config.context_length
    _, micro_s = budget.time_training_step(model.to(device), train_cfg.batch_size, seq_len, device=device,
                                           amp_dtype=runtime.autocast_dtype(device, train_cfg.precision))
    step_s = micro_s * train_cfg.grad_accum
    eval_s = budget.eval_seconds(micro_s, 1, train_cfg.batch_size, seq_len, train_cfg.eval_tokens)
    fit = budget.fit_steps_to_budget(limit, step_s, eval_s,
                                     eval_every=train_cfg.eval_every if given(args, table, "eval_every") else None,
                                     max_steps=train_cfg.steps if given(args, table, "steps") else None)
    warmup = min(train_cfg.warmup_steps, fit.steps) if given(args, table, "warmup_steps") else None
    fitted = dataclasses.replace(train_cfg, steps=fit.steps, eval_every=fit.eval_every, warmup_steps=warmup)
    decay = "the cosine" if fitted.lr_schedule == "cosine" else "constant, then the decay"
    con.print(f"time budget {limit:g} s: a step takes {step_s:.3g} s here, so {fit.steps:,} steps fit (warmup "
              f"{fitted.warmup_steps}, then {decay} to step {fit.steps}; evaluating every {fit.eval_every}); "
              f"the run still stops at {limit:g} s")
    return fitted
