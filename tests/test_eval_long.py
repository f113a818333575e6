"""Perplexity against evaluation length (eval.long, `logitlab eval long`): the windows against a
hand computation, the scaling axis per position scheme, learned tables past their rows, NaN as an
error, and the CLI on a run directory and on a model directory with --data. Tiny random models."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from logitlab.eval.long import (
    LengthScore,
    check_lengths,
    check_scalings,
    length_nats,
    model_at_length,
    sweep_lengths,
)
from logitlab.model import ModelConfig, Transformer


def tiny(positions: str = "rope", context: int = 16, seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, context_length=context, d_model=32, n_layers=2, n_heads=4, norm="rmsnorm",
                      mlp="swiglu", bias=False, positions=positions, **kw)
    return Transformer(cfg).eval()


def tokens(n: int = 400, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def test_length_nats_is_the_summed_loss_of_consecutive_windows():
    model, ids = tiny(), tokens()
    nats, count = length_nats(model, ids, 16, 64, batch_tokens=20)     # 4 windows, batches of one
    want = 0.0
    for i in range(4):
        x, y = ids[16 * i:16 * i + 16], ids[16 * i + 1:16 * i + 17]
        with torch.no_grad():
            want += float(F.cross_entropy(model(x[None])[0], y, reduction="sum"))
    assert count == 64
    assert nats == pytest.approx(want, rel=1e-5)


def test_sweep_scores_the_same_targets_at_every_length_and_shares_the_trained_range():
    model, ids = tiny(), tokens()
    r = sweep_lengths(model, ids, [64, 8, 16, 32], ["none", "linear", "yarn"], max_tokens=200)
    assert r.lengths == (8, 16, 32, 64) and r.scalings == ("none", "linear", "yarn") and r.trained_length == 16
    assert {s.tokens for s in r.scores} == {192}                      # 200 rounded down to 3 x 64
    for L in (8, 16):                                                 # no scaling changes a model here
        assert len({r.score(L, s).nats for s in r.scalings}) == 1
    assert r.score(64, "none").nats != r.score(64, "linear").nats     # past it, each scaling is its own model
    wide, _ = model_at_length(model, 64, "yarn")
    assert r.score(64, "yarn").nats == pytest.approx(length_nats(wide, ids, 64, 192)[0], rel=1e-6)
    assert wide.config.rope_scaling.rope_type == "yarn" and wide.config.rope_scaling.factor == 4.0
    d = r.to_dict()
    assert d["scores"][0]["perplexity"] == pytest.approx(math.exp(d["scores"][0]["nats_per_token"]))
    json.dumps(d)                                                     # JSON-ready


def test_non_rope_schemes_have_only_none_and_learned_stops_at_its_table():
    alibi = sweep_lengths(tiny("alibi"), tokens(), [16, 32], ["none", "linear", "yarn"], max_tokens=64)
    assert alibi.scalings == ("none",) and all(s.evaluable for s in alibi.scores)
    learned = sweep_lengths(tiny("learned"), tokens(), [16, 32], ["none"], max_tokens=64)
    assert learned.score(16, "none").evaluable
    past = learned.score(32, "none")
    assert not past.evaluable and past.perplexity is None and "learned" in past.note and "16 rows" in past.note


def test_a_model_that_already_has_a_scaling_extends_with_none_only():
    model = tiny(rope_scaling=dict(rope_type="linear", factor=2.0))
    r = sweep_lengths(model, tokens(), [32], ["none", "yarn"], max_tokens=64)
    assert r.score(32, "none").evaluable
    assert not r.score(32, "yarn").evaluable and "already has a rope_scaling" in r.score(32, "yarn").note


def test_nan_loss_is_an_error_naming_the_length():
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="length 16 is nan"):
        sweep_lengths(model, tokens(), [16], ["none"], max_tokens=64)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="'0' is not|0 is not"):
        check_lengths([16, 0])
    with pytest.raises(ValueError, match="unknown scaling 'pi'"):
        check_scalings(["none", "pi"])
    with pytest.raises(ValueError, match="longest length 512 needs at least 513"):
        sweep_lengths(tiny(), tokens(100), [16, 512], ["none"])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        sweep_lengths(tiny(), torch.full((100,), 99), [16], ["none"])
    assert LengthScore(8, "none", None, 0, "why").nats_per_token is None


# -------------------- CLI

def _model_dir(tmp_path, positions="rope"):
    from logitlab.io import checkpoint
    from logitlab.tokenizer.core import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [], special_tokens={"<|endoftext|>": 256})
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=257, context_length=16, d_model=32, n_layers=1, n_heads=2,
                                    positions=positions)).eval()
    d = tmp_path / f"model-{positions}"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    return d, model, tok


def test_cli_eval_long_on_a_model_dir_with_data_json_table_and_plot(tmp_path, capsys):
    from logitlab.cli.main import main

    d, model, tok = _model_dir(tmp_path)
    text = "the quick brown fox jumps over the lazy dog. " * 20
    (tmp_path / "a.txt").write_text(text)
    png = tmp_path / "long.png"
    assert main(["eval", "long", str(d), "--data", str(tmp_path / "a.txt"), "--lengths", "16,32,64",
                 "--scaling", "none,yarn", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trained_length"] == 16 and out["lengths"] == [16, 32, 64] and out["scalings"] == ["none", "yarn"]
    ids = [tok.eot_id] + tok.encode(text)
    want = sweep_lengths(model, ids, [16, 32, 64], ["none", "yarn"])
    assert [s["nats"] for s in out["scores"]] == pytest.approx([s.nats for s in want.scores], rel=1e-6)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "long", str(d), "--data", str(tmp_path / "a.txt"), "--lengths", "16,32"]) == 0
    table = capsys.readouterr().out
    assert "16 (train)" in table and "linear" in table and "ntk" in table     # the default scalings


def test_cli_eval_long_learned_is_not_evaluable_and_errors_name_the_value(tmp_path, capsys):
    from logitlab.cli.main import main

    d, _, _ = _model_dir(tmp_path, "learned")
    (tmp_path / "a.txt").write_text("some held-out text, " * 20)
    data = ["--data", str(tmp_path / "a.txt")]
    assert main(["eval", "long", str(d), *data, "--lengths", "16,32"]) == 0
    out = capsys.readouterr().out
    assert "not evaluable (none@32)" in out and "16 rows" in out
    assert main(["eval", "long", str(d), *data, "--lengths", "16,abc"]) == 2
    assert "'abc' is not an integer" in capsys.readouterr().err
    assert main(["eval", "long", str(d), *data, "--lengths", "16,-4"]) == 2
    assert "-4 is not a positive length" in capsys.readouterr().err
    assert main(["eval", "long", str(d), *data, "--scaling", "none,pi"]) == 2
    assert "unknown 'pi'" in capsys.readouterr().err
    assert main(["eval", "long", str(d), "--lengths", "16"]) == 2            # no run, no --data
    err = capsys.readouterr().err
    assert "no validation data" in err and "--data" in err


def test_result_round_trips_through_json_and_restricts_to_scalings():
    from logitlab.eval.long import LongEvalResult

    r = sweep_lengths(tiny(), tokens(), [16, 32], ["none", "linear", "yarn"], max_tokens=64)
    back = LongEvalResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r
    sub = r.only(["yarn", "ntk", "none"])
    assert sub.scalings == ("yarn", "none") and {s.scaling for s in sub.scores} == {"yarn", "none"}
