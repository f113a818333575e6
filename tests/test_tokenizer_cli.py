"""`logitlab tokenizer ...` through cli.main: train, encode, decode, show, convert, errors."""

from __future__ import annotations

import io
import json

import pytest

from logitlab.cli import main
from logitlab.tokenizer import Tokenizer

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def trained_file(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("tok") / "tok.json"
    code = main(["tokenizer", "train", "--data", str(shared_data / "corpus.en"), "--vocab-size", "600",
                 "--special-token", EOT, "--out", str(out), "--workers", "1", "--no-progress",
                 "--export-hf", str(out.with_name("tokenizer.json")),
                 "--export-tiktoken", str(out.with_name("ranks.tiktoken"))])
    assert code == 0
    return out


def test_train_writes_files(trained_file):
    tok = Tokenizer.load(trained_file)
    assert tok.vocab_size == 600 and tok.eot_id == 599
    assert trained_file.with_suffix(".vocab").is_file()
    assert Tokenizer.from_hf(trained_file.with_name("tokenizer.json")).fingerprint() == tok.fingerprint()
    assert len(trained_file.with_name("ranks.tiktoken").read_text().splitlines()) == 599


def test_encode_decode_round_trip(trained_file, capsys, monkeypatch):
    text = f"Hello there, world!{EOT}"
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_file), text, "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids == Tokenizer.load(trained_file).encode(text) and ids[-1] == 599
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_file), text, "--ordinary", "--reference"]) == 0
    assert "599" not in capsys.readouterr().out.split()
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(ids)))
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_file)]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_show_gpt2_and_ours(trained_file, shared_data, capsys):
    assert main(["tokenizer", "show", "--gpt2", str(shared_data / "gpt2"), "Hello world"]) == 0
    out = capsys.readouterr().out
    assert "15496" in out and "' world'" in out and "2 tokens, 11 bytes, 5.50 bytes/token" in out
    assert main(["tokenizer", "show", "--tokenizer", str(trained_file), f"a{EOT}"]) == 0
    assert "special" in capsys.readouterr().out


def test_convert_gpt2_to_hf(shared_data, tmp_path, capsys):
    from tokenizers import Tokenizer as HFTokenizer

    out = tmp_path / "tokenizer.json"
    assert main(["tokenizer", "convert", "--gpt2", str(shared_data / "gpt2"), "--to", "hf", "--out", str(out)]) == 0
    assert HFTokenizer.from_file(str(out)).encode("Hello world").ids == [15496, 995]


def test_cli_errors(tmp_path, capsys):
    assert main(["tokenizer", "encode", "--tokenizer", str(tmp_path / "none.json"), "x"]) == 2
    assert "tokenizer file not found" in capsys.readouterr().err
    data = tmp_path / "d.txt"
    data.write_text("some text")
    assert main(["tokenizer", "train", "--data", str(data), "--vocab-size", "10", "--out",
                 str(tmp_path / "t.json"), "--no-progress"]) == 2
    assert "vocab_size (10) must be at least 256 + 1" in capsys.readouterr().err
    assert main(["tokenizer", "decode", "--gpt2", str(tmp_path), "1"]) == 2
    assert "vocab file not found" in capsys.readouterr().err
