"""The interpretability flags of the command line: inspect --hooks, --attribute, --patch (table, JSON
and heatmap), --early-exit, --save-direction, and generate --steer."""

from __future__ import annotations

import json

import pytest
import torch

from logitlab.cli.main import main
from logitlab.generate import SampleConfig, generate
from logitlab.inspect.attribution import direct_logit_attribution
from logitlab.inspect.patching import activation_patching, logit_difference
from logitlab.inspect.steering import load_steering, steer
from tests.test_cli_inference import _model_dir


def _run(capsys, *argv, code=0) -> str:
    assert main(list(argv)) == code, capsys.readouterr().err
    return capsys.readouterr().out


def test_hooks_lists_every_point(tmp_path, capsys):
    d, model = _model_dir(tmp_path)
    points = json.loads(_run(capsys, "inspect", str(d), "--hooks", "--json"))
    names = [p["name"] for p in points]
    assert names[0] == "embed" and names[-1] == "logits" and "blocks.1.attn.pattern" in names
    assert "blocks.0.mlp.up" in _run(capsys, "inspect", str(d), "--hooks")


def test_attribute_and_early_exit_print_what_the_library_computes(tmp_path, capsys):
    d, model = _model_dir(tmp_path)
    out = json.loads(_run(capsys, "inspect", str(d), "abcab", "--attribute", "c-d", "--early-exit", "--json"))
    want = direct_logit_attribution(model, list(b"abcab"), ord("c"), ord("d"))
    assert out["attribution"]["parts"] == pytest.approx(want.parts, abs=1e-9)
    assert len(out["early_exit"]["exit_layer"]) == 5
    text = _run(capsys, "inspect", str(d), "abcab", "--attribute", "99")
    assert "direct logit attribution of 'c' at position 4" in text and "blocks.1.mlp_out" in text
    assert main(["inspect", str(d), "abcab", "--attribute", "ab-cd"]) == 2
    assert "expected TOKEN or TOKEN-TOKEN" in capsys.readouterr().err


def test_patch_prints_the_sweep_and_draws_the_heatmap(tmp_path, capsys):
    d, model = _model_dir(tmp_path)
    png = tmp_path / "patch.png"
    out = json.loads(_run(capsys, "inspect", str(d), "--patch", "abcab", "abdab", "--metric", "c-d", "--plot",
                          str(png), "--json"))
    want = activation_patching(model, list(b"abcab"), list(b"abdab"), logit_difference(ord("c"), ord("d")))
    assert torch.tensor(out["scores"]).double().sub(want.scores).abs().max() < 1e-6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    heads = json.loads(_run(capsys, "inspect", str(d), "--patch", "abcab", "abdab", "--metric", "c-d",
                            "--patch-kind", "heads", "--json"))
    assert len(heads["scores"]) == 2 and len(heads["scores"][0]) == 4
    assert "share of the logit difference restored" in _run(capsys, "inspect", str(d), "--patch", "abcab", "abdab",
                                                             "--metric", "c-d")
    assert main(["inspect", str(d), "--patch", "abcab", "abdab"]) == 2
    assert "--patch needs --metric" in capsys.readouterr().err
    assert main(["inspect", str(d), "--patch", "abc", "abdab", "--metric", "c-d"]) == 2
    assert "same number of tokens" in capsys.readouterr().err


def test_a_saved_direction_steers_generate(tmp_path, capsys):
    d, model = _model_dir(tmp_path)
    (tmp_path / "pos.txt").write_text("aaaa\naaab\n")
    (tmp_path / "neg.txt").write_text("zzzz\nzzzy\n")
    f = tmp_path / "dir.safetensors"
    assert "wrote" in _run(capsys, "inspect", str(d), "--save-direction", str(f), "--positive",
                           str(tmp_path / "pos.txt"), "--negative", str(tmp_path / "neg.txt"), "--layer", "0")
    assert main(["inspect", str(d), "--save-direction", str(f), "--positive", str(tmp_path / "pos.txt"),
                 "--negative", str(tmp_path / "neg.txt"), "--layer", "0"]) == 2     # never overwritten
    assert "exists" in capsys.readouterr().err
    assert main(["generate", str(d), "abc", "--max-new-tokens", "6", "--temperature", "0", "--steer", str(f),
                 "--steer-scale", "8", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert "steering: " in captured.err and "after block 0, scale 8" in captured.err
    config = SampleConfig(temperature=0, max_new_tokens=6)
    with steer(model, load_steering(f, scale=8.0)):
        assert out["ids"] == generate(model, out["prompt_ids"], config).tokens[0]
    assert main(["generate", str(d), "abc", "--steer", str(f), "--steer-layer", "7"]) == 2
    assert "outside the model's blocks" in capsys.readouterr().err


def test_tuned_lens_trains_saves_reloads_and_plots(tmp_path, capsys):
    from logitlab.inspect.lenses import lens_bits, load_tuned_lens

    d, model = _model_dir(tmp_path)
    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 12)
    lens, png = tmp_path / "lens.safetensors", tmp_path / "bits.png"
    out = json.loads(_run(capsys, "inspect", str(d), "abcabc", "--tuned-lens", str(lens), "--lens-data", str(data),
                          "--lens-steps", "3", "--plot", str(png), "--json"))
    bits = out["lens_bits"]
    assert bits["trained"] and len(bits["logit_lens"]) == 2 and png.read_bytes()[:4] == b"\x89PNG"
    want = lens_bits(model, list(b"abcabc"), load_tuned_lens(lens, model))
    assert bits["tuned_lens"] == pytest.approx(want.tuned_lens) and bits["logit_lens"] == pytest.approx(want.logit_lens)
    again = json.loads(_run(capsys, "inspect", str(d), "abcabc", "--tuned-lens", str(lens), "--json"))["lens_bits"]
    assert not again["trained"] and again["tuned_lens"] == pytest.approx(bits["tuned_lens"])
    assert "tuned lens" in _run(capsys, "inspect", str(d), "abcabc", "--tuned-lens", str(lens))
    assert main(["inspect", str(d), "abc", "--tuned-lens", str(tmp_path / "none.safetensors")]) == 2
    assert "give --lens-data" in capsys.readouterr().err


@pytest.mark.slow
def test_probe_reads_a_labelled_file_and_reports_the_control(tmp_path, capsys):
    from logitlab.inspect.probes import linear_probe

    d, model = _model_dir(tmp_path)
    rows = [{"text": f"x{c}", "label": int(c in "abcd")} for c in "abcdefghabcdefghabcdefgh"]
    f = tmp_path / "labelled.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = json.loads(_run(capsys, "inspect", str(d), "--probe", "embed", "--labelled", str(f), "--json"))
    want = linear_probe(model, [list(r["text"].encode()) for r in rows], [r["label"] for r in rows], "embed")
    assert out["accuracy"] == pytest.approx(want.accuracy) and out["control"] == pytest.approx(want.control)
    assert out["n_train"] + out["n_test"] == 24
    assert "shuffled-label control" in _run(capsys, "inspect", str(d), "--probe", "embed", "--labelled", str(f))
    f.write_text('{"text": "x", "label": "yes"}\n')
    assert main(["inspect", str(d), "--probe", "embed", "--labelled", str(f)]) == 2
    assert "line 1: expected" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["paged", "contiguous"])
def test_serve_steers_every_request(tmp_path, capsys, engine):
    from starlette.testclient import TestClient

    from logitlab.cli.main import build_parser
    from logitlab.cli.serve import build_app
    from logitlab.inspect.steering import save_steering

    d, model = _model_dir(tmp_path)
    v = torch.randn(64, generator=torch.Generator().manual_seed(0))
    f = save_steering(tmp_path / "v.safetensors", v, 1)
    app = build_app(build_parser().parse_args(["serve", str(d), "--port", "0", "--engine", engine, "--steer", str(f),
                                               "--steer-scale", "6"]))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=dict(model="m", prompt="abc", max_tokens=6, temperature=0)).json()
    config = SampleConfig(temperature=0, max_new_tokens=6)
    with steer(model, load_steering(f, scale=6.0)):
        steered = generate(model, list(b"abc"), config).tokens[0]
    plain = generate(model, list(b"abc"), config).tokens[0]
    assert steered != plain                                       # the direction changes the greedy output
    assert r["choices"][0]["text"] == bytes(steered).decode("utf-8", errors="replace")
