"""`logitlab tokenizer ...` through cli.main: train, encode, decode, show, convert, errors."""

from __future__ import annotations

import io
import json

import pytest

from logitlab.cli.main import main
from logitlab.tokenizer.core import Tokenizer

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


# ------------------------------------------------------------------------------ faults
def _one_error(capsys) -> str:
    """The single 'error:' message on stderr, whitespace-normalised (rich wraps long lines)."""
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    return " ".join(err.split())


def _train(data, out, *extra) -> int:
    return main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--out", str(out),
                 "--workers", "1", "--no-progress", *extra])


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello, world! hello there, hello world\n" * 20)
    return path


def test_train_refuses_a_pattern_that_drops_text(corpus, tmp_path, capsys):
    assert _train(corpus, tmp_path / "t.json", "--pattern", r"\w+") == 2
    assert (r"split pattern '\w+' does not cover the input: it drops ', ' and '!' from 'hello, world!'"
            in _one_error(capsys))
    assert not (tmp_path / "t.json").exists()


def test_train_warns_when_the_corpus_runs_out_of_pairs(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    assert _train(tiny, tmp_path / "t.json") == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: BPE training learned 1 of the 43 merges that vocab_size 300 asks for" in err
    assert "the tokenizer has 258 ids, not 300" in err
    assert Tokenizer.load(tmp_path / "t.json").vocab_size == 258


def test_train_refuses_an_empty_input_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert _train(empty, tmp_path / "t.json") == 2
    assert f"error: {empty} holds no text to learn merges from (it is empty)" in _one_error(capsys)
    only_special = tmp_path / "eot.txt"
    only_special.write_text(EOT * 3)
    assert main(["tokenizer", "train", "--data", str(empty), "--data", str(only_special), "--vocab-size", "300",
                 "--out", str(tmp_path / "t.json"), "--workers", "1", "--no-progress"]) == 2
    assert (f"the training input (2 files: {empty}, {only_special}) holds no text to learn merges from outside "
            f"special tokens") in _one_error(capsys)
    assert not (tmp_path / "t.json").exists()


def test_repeated_list_flags_accumulate(corpus, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text("zzz qqq zzz qqq\n" * 5)
    assert _train(corpus, tmp_path / "t.json", "--special-token", "<|a|>", "--special-token", "<|b|>", "<|c|>",
                  "--data", str(other)) == 0
    tok = Tokenizer.load(tmp_path / "t.json")
    assert list(tok.special_tokens) == ["<|a|>", "<|b|>", "<|c|>"]
    assert tok.encode("zzz qqq", allowed_special="none") != list(b"zzz qqq")  # the second --data was read
    assert _train(corpus, tmp_path / "none.json", "--special-token") == 0
    assert Tokenizer.load(tmp_path / "none.json").special_tokens == {}
    assert _train(corpus, tmp_path / "default.json") == 0
    assert list(Tokenizer.load(tmp_path / "default.json").special_tokens) == [EOT]


def test_train_full_vocabulary_prints_no_warning(corpus, tmp_path, capsys):
    assert main(["tokenizer", "train", "--data", str(corpus), "--vocab-size", "260", "--out", str(tmp_path / "t.json"),
                 "--workers", "1", "--no-progress"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("raw, message", [
    ("[[1,2]]", "decode input: element 0 is [1, 2], not an integer token id"),
    ("[72, true]", "decode input: element 1 is true, not an integer token id"),
    ("[72, 1.0]", "decode input: element 1 is 1.0, not an integer token id"),
    ('[72, "7"]', 'decode input: element 1 is "7", not an integer token id'),
    ("[72, 101", "decode input is not a valid JSON list of ids"),
    ("72 101 x", "decode input: element 2 is 'x', not an integer token id"),
    ("72, 1_0", "decode input: element 1 is '1_0', not an integer token id"),
    ("72 600 3", "token id 600 is outside the vocabulary (0..599), at position 1 of the ids"),
    ("[72, -1]", "token id -1 is outside the vocabulary (0..599), at position 1 of the ids"),
])
def test_decode_refuses_input_that_is_not_a_flat_list_of_ids(trained_file, capsys, monkeypatch, raw, message):
    monkeypatch.setattr("sys.stdin", io.StringIO(raw + "\n"))
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_file)]) == 2
    assert message in _one_error(capsys)


def test_decode_takes_whitespace_or_comma_separated_ids(trained_file, capsys):
    ids = Tokenizer.load(trained_file).encode("Hello there")
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_file), *map(str, ids)]) == 0
    assert capsys.readouterr().out == "Hello there\n"
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_file), ",".join(map(str, ids))]) == 0
    assert capsys.readouterr().out == "Hello there\n"


def test_train_out_directory_is_one_error_line(corpus, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()

    def must_not_train(*args, **kwargs):
        raise AssertionError("the output path is checked before training")

    monkeypatch.setattr("logitlab.tokenizer.bpe.train_tokenizer", must_not_train)
    assert _train(corpus, folder) == 2
    assert f"cannot write a logitlab tokenizer file to {folder}: it is a directory" in _one_error(capsys)
    assert list(folder.iterdir()) == []


def test_train_never_overwrites_a_file_it_did_not_write(corpus, tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    assert _train(corpus, notes) == 2
    assert f"{notes} exists and is not a logitlab tokenizer file; refusing to overwrite it" in _one_error(capsys)
    assert notes.read_text() == '{"mine": true}\n'
    readme = tmp_path / "README.md"
    readme.write_text("# notes\n")
    assert _train(corpus, tmp_path / "t.json", "--export-hf", str(readme)) == 2
    assert "README.md exists and is not a tokenizer.json" in _one_error(capsys)
    assert readme.read_text() == "# notes\n" and not (tmp_path / "t.json").exists()


def test_train_replaces_its_own_tokenizer(corpus, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert _train(corpus, out, "--export-hf", str(tmp_path / "tokenizer.json")) == 0
    first = Tokenizer.load(out).fingerprint()
    assert _train(corpus, out, "--vocab-size", "262", "--export-hf", str(tmp_path / "tokenizer.json")) == 0
    assert Tokenizer.load(out).vocab_size == 262 and Tokenizer.load(out).fingerprint() != first


def test_train_out_in_unwritable_folder_is_one_error_line(corpus, tmp_path, capsys, monkeypatch):
    """A folder we may not write (simulated: tests may run as root, who may write anywhere)."""
    import logitlab.tokenizer.formats as formats

    def denied(path, data):
        raise PermissionError(13, "Permission denied", str(path.parent / f".{path.name}.tmp-x"))

    monkeypatch.setattr(formats, "atomic_write_bytes", denied)
    out = tmp_path / "ro" / "t.json"
    assert _train(corpus, out) == 2
    assert f"cannot write {out}: Permission denied" in _one_error(capsys)
    assert not out.exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root may write into a read-only folder")
def test_train_out_in_read_only_folder(corpus, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert _train(corpus, folder / "t.json") == 2
        assert f"directory {folder} is not writable" in _one_error(capsys)
    finally:
        folder.chmod(0o755)


def test_convert_out_directory_or_foreign_file_is_one_error_line(shared_data, tmp_path, capsys):
    gpt2 = ["tokenizer", "convert", "--gpt2", str(shared_data / "gpt2")]
    folder = tmp_path / "out"
    folder.mkdir()
    for to in ("logitlab", "hf", "tiktoken"):
        assert main([*gpt2, "--to", to, "--out", str(folder)]) == 2
        assert f"to {folder}: it is a directory" in _one_error(capsys)
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    assert main([*gpt2, "--to", "tiktoken", "--out", str(notes)]) == 2
    assert "notes.txt exists and is not a tiktoken rank file" in _one_error(capsys)
    assert notes.read_text() == "keep me\n" and list(folder.iterdir()) == []
