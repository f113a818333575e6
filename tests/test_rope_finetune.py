"""Extending a trained run's context (`logitlab train --resume RUN --context-length N --rope-scaling
KIND:F`): the weights and optimizer state carry over, the run records the change, a later resume,
export and `eval long` see the extended model; the errors name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from logitlab import cli
from logitlab.cli.extend import parse_rope_scaling
from logitlab.io import checkpoint as ckpt_io
from logitlab.model import ModelConfig, Transformer
from logitlab.model.positions import extended_config
from logitlab.train.build import context_extension

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


def _train(tmp_path: Path, out: str, *extra: str) -> Path:
    (tmp_path / "code.txt").write_text(TEXT)
    run = tmp_path / out
    assert cli.main(["train", "--data", str(tmp_path / "code.txt"), "--tokenizer-vocab", "300",
                     "--context-length", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
                     "--n-kv-heads", "1", "--d-ff", "64", "--batch-size", "4", "--warmup-steps", "1",
                     "--eval-every", "3", "--eval-tokens", "256", "--val-fraction", "0.2", "--workers", "1",
                     "--progress", "false", "--device", "cpu", "--steps", "3", "--out-dir", str(run), *extra]) == 0
    return run


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("rope"), "run")


def test_parse_rope_scaling():
    assert parse_rope_scaling("yarn:4") == ("yarn", 4.0)
    assert parse_rope_scaling("linear") == ("linear", None)
    assert parse_rope_scaling("none") == ("none", None)
    for bad, msg in (("pi:4", "unknown kind 'pi'"), ("yarn:x", "'x' is not a number"), ("ntk:0", "> 0"),
                     ("none:2", "takes no factor"), ("yarn:inf", "> 0")):
        with pytest.raises(ValueError, match=msg):
            parse_rope_scaling(bad)


def test_context_extension_names_what_differs():
    base = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=2, positions="rope")
    assert context_extension(base, base, "ckpt") is None
    ext = context_extension(base, extended_config(base, 64, "yarn", 2.0), "ckpt")
    assert ext["context_length"] == [16, 64] and ext["rope_scaling"][0] is None
    assert ext["rope_scaling"][1]["rope_type"] == "yarn" and ext["rope_scaling"][1]["factor"] == 2.0
    with pytest.raises(ValueError, match="d_model: 32 -> 64"):
        context_extension(base, ModelConfig(**{**base.to_dict(), "d_model": 64}), "ckpt")
    with pytest.raises(ValueError, match="not shorten"):
        context_extension(extended_config(base, 64), base, "ckpt")
    learned = ModelConfig(**{**base.to_dict(), "positions": "learned"})
    with pytest.raises(ValueError, match="cannot be extended"):
        context_extension(learned, ModelConfig(**{**learned.to_dict(), "context_length": 32}), "ckpt")


def test_resume_at_a_longer_context_with_yarn_keeps_weights_and_records_the_change(run, tmp_path, capsys):
    before = ckpt_io.latest_checkpoint(run)
    old_model, _ = ckpt_io.load_for_inference(before)
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run), "--context-length", "64", "--rope-scaling", "yarn:2",
                     "--steps", "5", "--batch-size", "2", "--progress", "false"]) == 0
    out = capsys.readouterr().out
    assert "extended at step 3 (context_length 32 -> 64, rope_scaling none -> yarn:2" in out
    saved = json.loads((run / "run.json").read_text())
    assert saved["model"]["context_length"] == 64 and saved["model"]["rope_scaling"]["rope_type"] == "yarn"
    assert saved["model"]["rope_scaling"]["original_context_length"] == 32
    assert saved["train"]["seq_len"] is None and saved["train"]["batch_size"] == 2
    latest = ckpt_io.latest_checkpoint(run)
    assert latest.name == "ckpt-000005" and ckpt_io.read_model_config(latest).context_length == 64
    # the optimizer state carried over: AdamW's step count continues from the checkpoint's
    opt = ckpt_io.load_optimizer_state(latest)
    assert {int(s["step"]) for s in opt["state"].values()} == {5}
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ext = [r for r in records if "extended" in r]
    assert len(ext) == 1 and ext[0]["step"] == 3
    assert ext[0]["extended"]["seq_len"] == [32, 64] and ext[0]["extended"]["batch_size"] == [4, 2]
    assert ext[0]["val_loss_before"] == [r for r in records if r["step"] == 3 and "loss" in r][0]["val_loss"]
    # the best checkpoint is chosen among the extended ones: losses at 32 do not compare with those at 64
    assert ckpt_io.read_model_config(ckpt_io.best_checkpoint(run)).context_length == 64
    # tokens count each step at its own shape: 3 steps of 4 x 32, then 2 of 2 x 64
    assert [r["tokens"] for r in records if "loss" in r][-2:] == [3 * 4 * 32 + 2 * 64, 3 * 4 * 32 + 2 * 2 * 64]
    # the record's loss at the new length is the checkpoint's weights, extended and not yet trained
    wide = Transformer(extended_config(old_model.config, 64, "yarn", 2.0)).eval()
    wide.load_state_dict(old_model.state_dict())
    from logitlab.data.tokens import load_tokens
    from logitlab.train.loss import evaluate

    val = load_tokens(run / "data", "val")
    assert ext[0]["val_loss"] == pytest.approx(evaluate(wide, val, 64, 2, 256, torch.device("cpu")), rel=1e-5)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]

    # a plain resume keeps the extended model; repeating the same flags is no change
    assert cli.main(["train", "--resume", str(run), "--steps", "6", "--progress", "false"]) == 0
    assert cli.main(["train", "--resume", str(run), "--context-length", "64", "--rope-scaling", "yarn:2",
                     "--steps", "7", "--progress", "false"]) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum("extended" in r for r in records) == 1
    assert ckpt_io.read_model_config(ckpt_io.latest_checkpoint(run)).rope_scaling.factor == 2.0

    # export writes the scaling; eval long reads the run's validation split and marks its length
    hf = tmp_path / "hf"
    assert cli.main(["export", str(run), "--out", str(hf)]) == 0
    config = json.loads((hf / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 2.0
    assert config["rope_scaling"]["original_max_position_embeddings"] == 32
    capsys.readouterr()
    assert cli.main(["eval", "long", str(run), "--lengths", "32,64,128", "--scaling", "none,linear",
                     "--tokens", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["trained_length"] == 64 and "validation split" in result["data"]
    cells = {(s["length"], s["scaling"]): s for s in result["scores"]}
    assert cells[(128, "none")]["perplexity"] > 1 and cells[(128, "linear")]["perplexity"] is None


def test_extension_errors_name_the_problem(tmp_path, capsys):
    run = _train(tmp_path, "r")
    cases = [
        (["--context-length", "16", "--steps", "5"], "not shorten"),
        (["--rope-scaling", "yarn:2", "--steps", "5"], "give a --context-length longer than the run's 32"),
        (["--context-length", "64", "--rope-scaling", "pi:2", "--steps", "5"], "unknown kind 'pi'"),
        (["--context-length", "64", "--rope-scaling", "yarn:2"], "needs steps beyond it"),
        (["--context-length", "64", "--d-model", "64", "--steps", "5"], "--d-model 64 (the run has 32)"),
    ]
    for flags, message in cases:
        assert cli.main(["train", "--resume", str(run), *flags, "--progress", "false"]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert ckpt_io.latest_checkpoint(run).name == "ckpt-000003"                # nothing was trained
    assert json.loads((run / "run.json").read_text())["model"]["context_length"] == 32
    # a new run refuses the flag; a learned table cannot be extended; alibi extends without a scaling
    assert cli.main(["train", "--data", str(tmp_path / "code.txt"), "--rope-scaling", "yarn:2",
                     "--out-dir", str(tmp_path / "new")]) == 2
    assert "extends a trained run" in capsys.readouterr().err
    learned = _train(tmp_path, "learned", "--positions", "learned")
    assert cli.main(["train", "--resume", str(learned), "--context-length", "64", "--steps", "5",
                     "--progress", "false"]) == 2
    assert "table of 32 rows" in capsys.readouterr().err
    alibi = _train(tmp_path, "alibi", "--positions", "alibi")
    assert cli.main(["train", "--resume", str(alibi), "--context-length", "64", "--rope-scaling", "yarn",
                     "--steps", "5", "--progress", "false"]) == 2
    assert "needs positions='rope'" in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(alibi), "--context-length", "64", "--steps", "4",
                     "--progress", "false"]) == 0
    assert ckpt_io.read_model_config(ckpt_io.latest_checkpoint(alibi)).context_length == 64
