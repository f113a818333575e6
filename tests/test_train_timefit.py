"""A run's steps re-planned to its time limit from its own first steps (train/timefit.py): the
arithmetic against hand-computed plans, and the loop under a fake clock (no real time is
measured, so nothing here depends on the machine's speed or load)."""

from __future__ import annotations

import json

import pytest
import test_train
from test_train import _cfg, tiny_model

from logitlab.io.checkpoint import latest_checkpoint, read_state
from logitlab.train import budget
from logitlab.train.loop import train
from logitlab.train.timefit import TimeFit, replan

corpus = test_train.corpus                                 # the fixture, shared


class StepClock:
    """A clock under which every training step takes `step_s` seconds and nothing else takes any:
    the loop reads it once when it starts, then at each step's start and end, so it moves on at
    every second reading after the first."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.readings = step_s, 0

    def __call__(self) -> float:
        self.readings += 1
        return self.step_s * ((self.readings - 1) // 2)


def test_replan_fits_what_is_left_of_the_limit_at_the_median_step_time():
    fit = TimeFit()
    # 3 steps of 1 s after a slow first one (5 s): 8 s gone, 0.9 x 100 - 8 = 82 s left at 1 s a step
    # and 10 + 1 evaluations of 0.5 s: 82 - 5.5 = 76.5 -> 76 more steps
    assert replan(fit, 100.0, 8.0, [5.0, 1.0, 1.0], 3, eval_share=0.5) == (79, 8, 1.0)
    assert replan(fit, 100.0, 5.0, [5.0], 1)[2] == 5.0                  # the first step alone: its own time
    assert replan(TimeFit(max_steps=20), 100.0, 8.0, [5.0, 1.0, 1.0], 3)[0] == 20
    assert replan(TimeFit(eval_every=7), 100.0, 8.0, [5.0, 1.0, 1.0], 3)[1] == 7
    assert replan(fit, 100.0, 89.5, [1.0, 1.0], 2) == (2, 1, 1.0)          # no step fits: it ends here
    with pytest.raises(ValueError, match="times of the steps done"):
        replan(fit, 100.0, 1.0, [], 0)
    with pytest.raises(ValueError, match="TimeFit.replan_steps"):
        TimeFit(replan_steps=0)


def _events(sink: list):
    return lambda event, record: sink.append((event, record))


def test_a_run_re_plans_its_steps_and_ends_its_schedule_inside_the_limit(corpus, tmp_path):
    events, run = [], tmp_path / "fit"
    cfg = _cfg(corpus, run, steps=40, time_limit_s=100.0, save_every=0)
    result = train(tiny_model(), cfg, callback=_events(events), time_fit=TimeFit(clock=StepClock(5.0)))
    share = budget.eval_seconds(1.0, 1, cfg.batch_size, cfg.seq_len, cfg.eval_tokens)
    steps, every, _ = replan(TimeFit(), 100.0, 15.0, [5.0] * 3, 3, share)   # the plan after step 3
    plans = [r for e, r in events if e == "plan"]
    assert [p["step"] for p in plans] == [1, 2, 3] and plans[-1]["final"] and not plans[0]["final"]
    assert plans[-1]["steps"] == steps < 40 and plans[-1]["few"]
    assert result.step == steps and result.stopped == "done"           # not cut off by the limit
    saved = json.loads((run / "run.json").read_text())["train"]
    assert (saved["steps"], saved["eval_every"]) == (steps, every)      # a resume continues this plan
    state = read_state(latest_checkpoint(run))
    assert state["schedule"]["total_steps"] == steps and state["train_config"]["steps"] == steps
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["planned_steps"] for r in records if "planned_steps" in r][-1] == steps


def test_a_one_step_first_plan_grows_to_what_fits_and_the_steps_given_bound_it(corpus, tmp_path):
    events = []
    cfg = _cfg(corpus, tmp_path / "grow", steps=1, warmup_steps=0, time_limit_s=100.0, save_every=0)
    result = train(tiny_model(), cfg, callback=_events(events),
                   time_fit=TimeFit(max_steps=9, clock=StepClock(0.01)))
    assert result.step == 9 and result.stopped == "done"
    assert [r["steps"] for e, r in events if e == "plan"] == [9, 9, 9]


def test_slow_steps_end_the_run_where_the_plan_runs_out(corpus, tmp_path):
    events = []
    cfg = _cfg(corpus, tmp_path / "slow", steps=30, time_limit_s=100.0, save_every=0, eval_every=0)
    fit = TimeFit(eval_every=0, clock=StepClock(30.0))                # the final evaluation: 20 s (2/3 of a step)
    result = train(tiny_model(), cfg, callback=_events(events), time_fit=fit)
    # step 1 at 30 s: 60 s of the planned 90 left, one more step and the evaluation fit; step 2 at 60 s:
    # 30 s left, no more -> the run ends at step 2, its schedule with it
    assert result.step == 2 and result.stopped == "done"
    assert [(r["step"], r["steps"], r["final"]) for e, r in events if e == "plan"] == [(1, 2, False), (2, 2, True)]


def test_a_time_fit_needs_a_time_limit(corpus, tmp_path):
    with pytest.raises(ValueError, match="time_limit_s"):
        train(tiny_model(), _cfg(corpus, tmp_path / "x", steps=2), time_fit=TimeFit())
