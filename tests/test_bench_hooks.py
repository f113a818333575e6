"""bench/hooks.py at a tiny size: the unused-hook measurement counts every point a forward reaches,
and the report renders (the TransformerLens side runs in the benchmark itself)."""

from __future__ import annotations

import torch

from bench import hooks as hooks_bench
from logitlab.model.hooks import EAGER_ONLY, hook_points
from tests.test_hooks import build, ids


def test_idle_counts_every_point_and_renders():
    model = build("llama-gqa")
    idle = hooks_bench.bench_idle(model, ids(B=1), repeats=1)
    assert idle["calls"] == len([p for p in hook_points(model) if p.name.rpartition(".")[2] not in EAGER_ONLY])
    assert idle["per_call_s"] > 0 and idle["forward_s"] > 0 and 0 < idle["share"]
    text = hooks_bench.render({"machine": {"cpu": "test"}, "threads": 1, "shape": "tiny", "idle": idle})
    assert f"{idle['calls']} hook points reached per forward" in text
    assert all(m.__dict__.get("_taps") is None for m in model.modules())
    assert torch.is_grad_enabled()
