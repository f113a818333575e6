"""The training loop with the recipe's options: Muon (MuonAdamW) and warmup-stable-decay keep the
loop's exactness: resume bit for bit (also under bf16 autocast and with a rate per role), a WSD run
stopped in its stable phase continues with more steps exactly as a longer run, gradient
accumulation and clipping act on what Muon receives."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import test_train
import torch
from test_train import _cfg, _losses, tiny_model

from logitlab.data import tokens as data
from logitlab.io.checkpoint import latest_checkpoint, list_checkpoints, read_state
from logitlab.train.build import build_training_optimizer
from logitlab.train.loop import TrainConfig, cross_entropy, train
from logitlab.train.muon import MuonAdamW

corpus = test_train.corpus                                 # the fixture, shared


class Crash(Exception):
    pass


def _crash_after(step: int):
    def callback(event, record):
        if event == "checkpoint" and record["step"] == step:
            raise Crash
    return callback


# the speedrun recipe's model options (ModelConfig), all at once
MODEL_OPTIONS = dict(mlp="relu2", d_ff=None, qk_norm=True, tie_embeddings=False, value_embeddings="alternate",
                     logit_softcap=15.0, zero_init_output=True, norm_affine=False)
RECIPES = {  # name -> (TrainConfig fields, ModelConfig fields)
    "muon": (dict(optimizer="muon"), {}),
    "muon+wsd, rates per role, the recipe's model": (
        dict(optimizer="muon", lr_schedule="wsd", embedding_lr=1e-2, head_lr=2e-3, muon_ns="polar_express",
             muon_weight_decay=0.01), MODEL_OPTIONS),
    "adamw+wsd 1-sqrt, rates per role": (dict(lr_schedule="wsd", decay_shape="1-sqrt", matrix_lr=1e-2), {}),
    "muon bf16, the recipe's model": (dict(optimizer="muon", precision="bf16"), MODEL_OPTIONS),
}


@pytest.mark.parametrize("recipe", [r if r.startswith("muon+wsd") else pytest.param(r, marks=pytest.mark.slow)
                                    for r in RECIPES])
def test_resume_equals_uninterrupted_with_the_recipe(corpus, tmp_path, recipe):
    kw, model_kw = RECIPES[recipe]
    full = train(tiny_model(**model_kw), _cfg(corpus, tmp_path / "full", **kw))
    with pytest.raises(Crash):
        train(tiny_model(**model_kw), _cfg(corpus, tmp_path / "part", **kw), callback=_crash_after(6))
    resumed = train(tiny_model(seed=99, **model_kw), _cfg(corpus, tmp_path / "part", **kw), resume=True)
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "part")
    assert [a[s] for s in range(1, 13)] == [b[s] for s in range(1, 13)]   # exact float equality
    assert resumed.val_loss == full.val_loss and full.step == 12


@pytest.mark.slow
def test_wsd_run_stopped_in_its_stable_phase_continues_as_a_longer_run(corpus, tmp_path):
    """12 planned steps (decay from step 9), stopped at 6, resumed with --steps 20: every loss equals
    a run planned for 20 steps from the start; the checkpoint at the stable phase's last step is
    kept (state.json "kept" says why) whatever keep_last prunes."""
    kw = dict(optimizer="muon", lr_schedule="wsd", decay_fraction=0.25, keep_last=1)
    train(tiny_model(), _cfg(corpus, tmp_path / "long", steps=20, **kw))
    with pytest.raises(Crash):
        train(tiny_model(), _cfg(corpus, tmp_path / "run", steps=12, **kw), callback=_crash_after(6))
    train(tiny_model(seed=7), _cfg(corpus, tmp_path / "run", steps=20, **kw), resume=True)
    a, b = _losses(tmp_path / "long"), _losses(tmp_path / "run")
    assert [a[s] for s in range(1, 21)] == [b[s] for s in range(1, 21)]
    kept = [p.name for p in list_checkpoints(tmp_path / "long")]
    assert "ckpt-000015" in kept and latest_checkpoint(tmp_path / "long").name == "ckpt-000020"
    assert "stable phase" in read_state(tmp_path / "long" / "ckpt-000015")["kept"]
    lrs = [json.loads(x).get("lr") for x in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    lrs = [x for x in lrs if x is not None]
    assert lrs[1:16] == [3e-3] * 15 and lrs[-1] < lrs[16] < 3e-3      # constant, then the decay


def _grads_of(model, batches):
    for x, y in batches:
        (cross_entropy(model(x), y) / len(batches)).backward()


def test_grad_accumulation_and_clipping_reach_muon_as_one_big_batch(corpus, tmp_path):
    """Two micro-batches of 4 accumulated, clipped, stepped by MuonAdamW equal one batch of 8 (up to
    float rounding): the optimizer sees the same clipped gradient either way."""
    cfg = _cfg(corpus, tmp_path / "unused", optimizer="muon", lr=3e-3)
    s = data.RandomWindows(data.load_tokens(corpus, "train"), 32, 4, seed=1)
    (x1, y1), (x2, y2) = s.next(), s.next()
    m1, m2 = tiny_model(dropout=0.0), tiny_model(dropout=0.0)
    o1, o2 = build_training_optimizer(m1, cfg), build_training_optimizer(m2, cfg)
    assert isinstance(o1, MuonAdamW)
    _grads_of(m1, [(x1, y1), (x2, y2)])
    _grads_of(m2, [(torch.cat([x1, x2]), torch.cat([y1, y2]))])
    n1 = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)
    n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05)
    assert float(n1) > 0.05 and float(n1) == pytest.approx(float(n2), rel=1e-4)
    o1.step()
    o2.step()
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5, msg=name)


def test_recipe_settings_are_validated(corpus, tmp_path):
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="decay_fraction"):
        TrainConfig(decay_fraction=1.5)
    with pytest.raises(ValueError, match="matrix_lr"):
        TrainConfig(matrix_lr=-1.0)
    with pytest.raises(ValueError, match="muon.*--tp"):
        TrainConfig(optimizer="muon", tp=2)
    with pytest.raises(ValueError, match="head_lr needs an untied"):
        train(tiny_model(), _cfg(corpus, tmp_path / "r", head_lr=1e-3))
    assert TrainConfig(lr=1e-3, lr_schedule="wsd").schedule().min_lr == 0.0      # decays to zero
    assert TrainConfig(lr=1e-3).schedule().min_lr == pytest.approx(1e-4)          # cosine: lr / 10
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {"optimizer", "lr_schedule", "matrix_lr", "muon_ns"} <= fields


def test_a_muon_checkpoint_does_not_resume_as_adamw(corpus, tmp_path):
    train(tiny_model(), _cfg(corpus, tmp_path / "run", steps=3, warmup_steps=1, optimizer="muon"))
    with pytest.raises(ValueError, match="optimizer"):
        train(tiny_model(), _cfg(corpus, tmp_path / "run", steps=5, warmup_steps=1), resume=True)
    assert Path(tmp_path / "run" / "ckpt-000003").is_dir()
