"""`logitlab convert MODEL --out DIR --quantize int8|int4` and `--out FILE.gguf --gguf TYPE`: from
any model to a quantized logitlab directory or a GGUF file, each of which every command loads
again with the same numbers; bad requests are one line and touch nothing."""

from __future__ import annotations

import json

import pytest
import torch

from logitlab.cli.main import main
from logitlab.io import checkpoint
from logitlab.model import ModelConfig, Transformer
from logitlab.quant.apply import quantize_model
from logitlab.quant.linear import QuantConfig
from logitlab.tokenizer.core import Tokenizer

CONFIG = dict(context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_pad_multiple=1,
              norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False, norm_eps=1e-5)


@pytest.fixture
def model_dir(tmp_path):
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens={"<|endoftext|>": 256})
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **CONFIG)).eval()
    d = tmp_path / "m"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    return d, model


def _greedy(spec: str, capsys) -> list[int]:
    assert main(["generate", spec, "the cat", "--max-new-tokens", "5", "--temperature", "0", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["ids"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_directory_loads_quantized_with_the_same_numbers(model_dir, tmp_path, capsys, method):
    src, model = model_dir
    out = tmp_path / f"q-{method}"
    assert main(["convert", str(src), "--out", str(out), "--quantize", method, "--group-size", "32"]) == 0
    assert f"wrote logitlab directory {out}" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())
    assert saved["quantization"]["method"] == method and saved["quantization"]["head"] is True
    assert method == "int8" or saved["quantization"]["group_size"] == 32
    assert saved["source"]["source"] == str(src.resolve())
    loaded, tok = checkpoint.load_for_inference(out)
    quantize_model(model, QuantConfig(method, 32))                 # the same quantization, in memory
    ids = torch.tensor([tok.encode("the cat sat")])
    assert torch.equal(loaded(ids), model(ids))
    assert _greedy(str(out), capsys) == _greedy(str(out), capsys)   # loads in every command


def test_a_gguf_file_with_its_tokenizer_beside_it(model_dir, tmp_path, capsys):
    pytest.importorskip("gguf")
    src, _ = model_dir
    folder = tmp_path / "g"
    folder.mkdir()
    path = folder / "m.gguf"
    assert main(["convert", str(src), "--out", str(path), "--gguf", "F32"]) == 0
    assert "its tokenizer beside it" in capsys.readouterr().out
    assert (folder / checkpoint.TOKENIZER_FILE).is_file()
    assert _greedy(str(path), capsys) == _greedy(str(src), capsys)  # F32: the very same weights
    assert main(["convert", str(src), "--out", str(path), "--gguf", "Q8_0"]) == 2      # exists
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--quantize", "int8"], "--quantize needs --out"),
    (["--out", "X", "--quantize", "int8", "--gguf", "Q8_0"], "give one of them"),
    (["--out", "X.bin", "--gguf", "Q8_0"], "named \\*.gguf"),
    (["--out", "X", "--quantize", "int8", "--verify"], "without --quantize"),
])
def test_bad_requests_are_one_line(model_dir, tmp_path, capsys, argv, message):
    import re

    src, _ = model_dir
    argv = [a.replace("X", str(tmp_path / "X")) for a in argv]
    assert main(["convert", str(src), *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "X").exists() and not (tmp_path / "X.bin").exists()
