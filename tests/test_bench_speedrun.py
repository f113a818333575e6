"""bench.speedrun without its runs (nanoGPT lives outside the repository and the runs take minutes):
the recipes and ablations it builds, the budget in FLOPs, the target's interpolation, the summary
and the table, and nanoGPT's command line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import speedrun
from bench import speedrun_sides as sides
from logitlab.model.transformer import ModelConfig
from logitlab.train.config import TrainConfig
from logitlab.train.recipes import SPEEDRUN

MACHINE = dict(nproc=2, cpu="cpu", torch="t", torch_threads=1, commit="c", load_avg_1m=1.0)


def test_a_folder_without_nanogpt_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        speedrun.main(["--nanogpt", str(tmp_path), "--no-doc"])
    assert exc.value.code == 2 and str(tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("name", ["baseline", "speedrun", *(f"speedrun, {a}" for a in speedrun.ABLATIONS)])
def test_every_recipe_and_ablation_builds_valid_configs(name, tmp_path):
    spec = speedrun.logitlab_spec(name, "demo", 1, 100, tmp_path / "run", {"data": str(tmp_path)}, 4097, None)
    model = ModelConfig.from_dict(spec["model"])
    train = TrainConfig(**spec["train"])
    assert (model.d_model, model.n_layers, model.context_length) == (128, 4, 128)
    assert train.steps == 100 and train.eval_every == 10 and train.seq_len == 128
    if name == "baseline":
        assert (train.optimizer, train.lr_schedule, model.mlp) == ("adamw", "cosine", "swiglu")
    elif name == "speedrun":
        assert train.optimizer == "muon" and model.value_embeddings == "alternate" and model.d_ff == 512
    ablation = speedrun.ABLATIONS.get(name.removeprefix("speedrun, "), {})
    for field, value in ablation.get("train", {}).items():
        assert getattr(train, field) == value
    for field, value in ablation.get("model", {}).items():
        assert getattr(model, field) == (384 if value == "size" else value)
    kept = {k: v for k, v in SPEEDRUN.model.items() if k not in ablation.get("model", {}) and k != "d_ff"}
    if name.startswith("speedrun"):
        assert all(getattr(model, k) == v for k, v in kept.items())


def test_muon_flops_are_counted_per_block_and_only_for_muon():
    spec = speedrun.logitlab_spec("speedrun", "demo", 1, 10, Path("/tmp/x"), {"data": "d"}, 4097, None)
    flops = sides.muon_flops_per_step(spec["model"], spec["train"])
    # one 128 x 128 o_proj: 5 iterations of 4·m²·n + 2·m³ with m = n = 128
    assert flops > 4 * 5 * 6 * 128 ** 3
    base = speedrun.logitlab_spec("baseline", "demo", 1, 10, Path("/tmp/x"), {"data": "d"}, 4097, None)
    assert sides.muon_flops_per_step(base["model"], base["train"]) == 0.0


def test_reach_interpolates_between_evaluations():
    curve = [[10.0, 100, 3.0], [20.0, 200, 2.0], [30.0, 300, 1.5]]
    assert speedrun.reach(curve, 2.5) == (15.0, 150.0)
    assert speedrun.reach(curve, 3.5) == (10.0, 100)
    assert speedrun.reach(curve, 1.0) is None


def test_summary_and_table():
    def run(name, fraction, final, curve):
        return dict(name=name, fraction=fraction, final_bpb=final, train_s=curve[-1][0], bpb=curve, params=10)

    runs = [run("nanogpt", 1, 2.0, [[50, 500, 2.5], [100, 1000, 2.0]]),
            run("speedrun", 1, 1.6, [[40, 500, 1.9], [80, 1000, 1.6]]),
            run("speedrun", 0.5, 1.9, [[40, 500, 1.9]]),
            run("baseline", 1, 2.2, [[45, 500, 2.4], [90, 1000, 2.2]])]
    s = speedrun.summarize(runs, {"nanogpt": 10, "speedrun": 10, "baseline": 10}, (1000, 3000))
    assert s["target_bpb"] == 2.0 and s["nanogpt_train_s"] == 100
    fast = s["recipes"]["speedrun"]
    assert fast["time_to_target"] == [40] and fast["share_of_budget"] == [0.4] and fast["token_share"] == [0.5]
    assert fast["shorter_runs"] == {0.5: [1.9]} and s["recipes"]["baseline"]["time_to_target"] == [None]
    text = speedrun.render({"command": "python3 -m bench.speedrun", "machine": MACHINE, "budget": "1,000 tokens",
                            "sizes": {"demo": s}})
    assert "| speedrun | 10 | 10 | 80 | 1.6000 | 0.40 (40 s); tokens 0.50 | x0.5: 1.9000 |" in text
    assert "not reached in 1 of 1" in text and "target 2.0000 bpb" in text


def test_bits_per_byte_and_nanogpt_command_line():
    assert sides.bits_per_byte(math.log(2), 10, 10) == pytest.approx(1.0)
    args = sides.nanogpt_args(Path("/peer"), speedrun.SIZES["demo"], 300, 16, 30, 8)
    assert args[1:3] == ["/peer/train.py", "/peer/config/train_shakespeare_char.py"]   # its small-model recipe
    assert {"--max_iters=300", "--lr_decay_iters=300", "--n_embd=128", "--block_size=128", "--dropout=0.0",
            "--compile=False", "--device=cpu", "--warmup_iters=30"} <= set(args)


def test_a_budget_in_steps_of_one_recipe_gives_every_recipe_that_time(monkeypatch):
    # baseline steps take 0.5 s here and speedrun's 0.625 s: 1,000 baseline steps' 500 s fit 800 of speedrun's
    monkeypatch.setattr(speedrun, "step_seconds", lambda *a: {"nanogpt": 0.4, "baseline": 0.5, "speedrun": 0.625})
    args = speedrun.argparse.Namespace(budget_tokens=None, budget_flops=None, budget_s=240.0,
                                       budget_steps_of=["baseline", "1000"])
    steps = speedrun.planned_steps(args, ["nanogpt", "baseline", "speedrun"], "demo", {}, 4097)
    assert steps == {"nanogpt": 1250, "baseline": 1000, "speedrun": 800}
    assert speedrun.budget_words(args) == "the training time of 1,000 baseline steps (wall clock)"
    args.budget_steps_of = None
    assert speedrun.planned_steps(args, ["baseline"], "demo", {}, 4097) == {"nanogpt": 600, "baseline": 480,
                                                                          "speedrun": 384}   # 240 s each


@pytest.mark.parametrize("anchor", [["gpt", "100"], ["baseline", "0"], ["speedrun", "ten"]])
def test_a_budget_in_steps_of_a_recipe_not_run_is_a_usage_error(anchor, tmp_path, capsys):
    (tmp_path / "train.py").write_text("")
    with pytest.raises(SystemExit) as exc:
        speedrun.main(["--nanogpt", str(tmp_path), "--no-doc", "--budget-steps-of", *anchor])
    assert exc.value.code == 2 and f"--budget-steps-of {' '.join(anchor)}" in capsys.readouterr().err
