"""`logitlab train --recipe speedrun`: the recipe's model and training fields beneath the TOML's and the
flags', recorded in run.json; a resume keeps the run's own; an unknown name lists the known ones."""

from __future__ import annotations

import json

from test_cli_train import TEXT, _train_args

from logitlab import cli
from logitlab.train.recipes import RECIPES, SPEEDRUN, get_recipe


def test_train_with_the_speedrun_recipe_flags_override_it(tmp_path, capsys):
    (tmp_path / "code.txt").write_text(TEXT)
    (tmp_path / "c.toml").write_text('[train]\ndecay_fraction = 0.5\n')
    run = tmp_path / "run"
    assert cli.main(_train_args(tmp_path, "--recipe", "speedrun", "--config", str(tmp_path / "c.toml"),
                                "--matrix-lr", "0.05", "--steps", "2", "--out-dir", str(run))) == 0
    saved = json.loads((run / "run.json").read_text())
    train, model = saved["train"], saved["model"]
    assert (train["optimizer"], train["lr_schedule"], train["embedding_lr"]) == \
        ("muon", "wsd", SPEEDRUN.train["embedding_lr"])
    assert train["matrix_lr"] == 0.05 and train["decay_fraction"] == 0.5      # a flag, the TOML over the recipe
    assert (model["mlp"], model["value_embeddings"], model["tie_embeddings"], model["norm_affine"]) == \
        ("relu2", "alternate", True, True)
    assert model["qk_norm"] and model["zero_init_output"] and model["logit_softcap"] == 15.0
    assert model["d_ff"] == 64                                                  # the flag over the recipe's None
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run), "--recipe", "speedrun", "--progress", "false"]) == 2
    assert "--recipe (the run keeps its own)" in capsys.readouterr().err


def test_an_unknown_recipe_is_named_before_any_work(tmp_path, capsys):
    (tmp_path / "code.txt").write_text(TEXT)
    assert cli.main(_train_args(tmp_path, "--recipe", "fastest", "--out-dir", str(tmp_path / "run"))) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'fastest'" in err and "speedrun" in err and not (tmp_path / "run").exists()
    assert get_recipe("speedrun") is RECIPES["speedrun"]
