"""The command line of quantized weights and speculative decoding: generate, chat and serve with
--quantize, a model saved quantized, generate --draft (n-gram and a model) with its report, and
serve's engine decoding a request alone speculatively."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from logitlab.cli.main import build_parser, main
from logitlab.generate import SampleConfig, generate


def _model_dir(tmp_path: Path, name: str = "m", seed: int = 0, n_layers: int = 2) -> tuple[Path, object]:
    """A small Llama-style model directory with a byte tokenizer (+ <|endoftext|>)."""
    from logitlab.io import checkpoint
    from logitlab.model import ModelConfig, Transformer
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=96, d_model=64, n_layers=n_layers,
                                    n_heads=4, n_kv_heads=2, d_ff=128, norm="rmsnorm", mlp="swiglu",
                                    positions="rope", bias=False)).eval()
    d = tmp_path / name
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    return d, model


def _json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]) | {"stderr": captured.err}


def test_generate_quantize_runs_the_quantized_model(tmp_path, capsys):
    from logitlab.quant import QuantConfig, quantize_model

    d, model = _model_dir(tmp_path)
    for method, extra in (("int8", []), ("int4", ["--group-size", "32"])):
        out = _json(capsys, str(d), "abcabc", "--max-new-tokens", "6", "--temperature", "0", "--quantize", method,
                    "--quant-kernel", "reference", *extra)
        assert f"quantized 8 linear layers to {method}" in out["stderr"] and "MiB ->" in out["stderr"]
        want = _model_dir(tmp_path, f"fresh-{method}")[1]
        quantize_model(want, QuantConfig(method, 32))
        assert out["ids"] == generate(want, out["prompt_ids"], SampleConfig(temperature=0, max_new_tokens=6)).tokens[0]


def test_a_model_saved_quantized_loads_quantized(tmp_path, capsys):
    from logitlab.io import checkpoint
    from logitlab.quant import QuantConfig, quantize_model

    d, model = _model_dir(tmp_path)
    quantize_model(model, QuantConfig("int8"))
    checkpoint.save_model(model, tmp_path / "q")
    (tmp_path / "q" / checkpoint.TOKENIZER_FILE).write_bytes((d / checkpoint.TOKENIZER_FILE).read_bytes())
    out = _json(capsys, str(tmp_path / "q"), "abc", "--max-new-tokens", "5", "--temperature", "0",
                "--quant-kernel", "packed")
    assert "weights quantized (int8)" in out["stderr"] and "quantized matmuls: packed" in out["stderr"]
    assert out["ids"] == generate(model, out["prompt_ids"], SampleConfig(temperature=0, max_new_tokens=5)).tokens[0]


def test_generate_runs_the_int8dot_products(tmp_path, capsys):
    from logitlab.quant import QuantConfig, int8dot, quantize_model, routes

    if not int8dot.available():
        pytest.skip("logitlab.quant._int8dot was not built (no C compiler with OpenMP at install)")
    d, _ = _model_dir(tmp_path)
    out = _json(capsys, str(d), "abcabc", "--max-new-tokens", "6", "--temperature", "0", "--quantize", "int8",
                "--quant-kernel", "int8dot")
    assert "quantized matmuls: int8dot (8 layers on a fast kernel)" in out["stderr"]
    want = _model_dir(tmp_path, "fresh")[1]
    quantize_model(want, QuantConfig("int8"))
    routes.install(want, "int8dot")
    assert out["ids"] == generate(want, out["prompt_ids"], SampleConfig(temperature=0, max_new_tokens=6)).tokens[0]


def test_generate_with_a_draft_reports_acceptance_and_keeps_the_greedy_text(tmp_path, capsys):
    d, model = _model_dir(tmp_path)
    small, _ = _model_dir(tmp_path, "small", seed=1, n_layers=1)
    prompt = "abcabcabcabc"
    plain = _json(capsys, str(d), prompt, "--max-new-tokens", "12", "--temperature", "0")
    for draft in ("ngram", str(small)):
        out = _json(capsys, str(d), prompt, "--max-new-tokens", "12", "--temperature", "0", "--draft", draft,
                    "--draft-k", "3", "--compare-plain")
        sp = out["speculative"]
        assert out["ids"] == plain["ids"] and sp["same_tokens"] is True and sp["k"] == 3
        assert 0 <= sp["accepted"] <= sp["drafted"] and sp["target_passes"] >= 1 and sp["speedup"] > 0
    assert main(["generate", str(d), prompt, "--max-new-tokens", "8", "--draft", "ngram", "--compare-plain"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "speculative (ngram, k 4):" in err and "drafts accepted" in err and "speed-up" in err
    assert main(["generate", str(d), prompt, "--draft", "ngram", "--compile"]) == 2
    assert "--compile compiles the one-token decode step" in capsys.readouterr().err
    assert main(["generate", str(d), prompt, "--draft", "ngram", "--repetition-penalty", "1.3"]) == 2
    assert "does not take repetition_penalty" in capsys.readouterr().err


def test_serve_quantizes_and_decodes_a_request_alone_speculatively(tmp_path):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from logitlab.cli.serve import build_app

    d, model = _model_dir(tmp_path)
    app = build_app(build_parser().parse_args(["serve", str(d), "--port", "0", "--draft", "ngram", "--draft-k", "3",
                                               "--quantize", "int8", "--quant-kernel", "reference"]))
    assert any("quantized 8 linear layers to int8" in n for n in app.state.notes)
    assert any("decoded speculatively" in n for n in app.state.notes)
    engine = app.state.served.engine
    with TestClient(app) as c:
        r = c.post("/v1/completions", json=dict(model="m", prompt="abcabcabc", max_tokens=8, temperature=0))
    ids = generate(engine.model, list(b"abcabcabc"), SampleConfig(temperature=0, max_new_tokens=8)).tokens[0]
    assert r.json()["choices"][0]["text"] == bytes(ids).decode("utf-8", errors="replace")
    assert engine.stats["speculative_rounds"] >= 1 and engine.stats["decodes"] == 0
