"""One way to name a model in every command (cli/models.py): the positional MODEL, of any kind,
with the old --checkpoint / --hf / --base still read (and a note on stderr); --out everywhere; a
model's generation_config.json as the defaults that flags override, with --verbose naming where
each setting came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from logitlab.cli.main import main
from tests.test_cli_flags import _model_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A logitlab model directory and its Hugging Face export (with a generation_config.json)."""
    root = tmp_path_factory.mktemp("models")
    native, _ = _model_dir(root)
    hf_dir = root / "hf"
    assert main(["export", str(native), "--out", str(hf_dir)]) == 0
    return native, hf_dir


def _generate(capsys, *argv) -> tuple[dict, str]:
    assert main(["generate", *argv, "--json"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_every_kind_is_one_positional_model(dirs, capsys):
    native, hf_dir = dirs
    flags = ["de", "--max-new-tokens", "3", "--temperature", "0"]
    a, err = _generate(capsys, str(native), *flags)
    b, _ = _generate(capsys, str(hf_dir), *flags)
    assert a["ids"] == b["ids"] and "note" not in err
    # the old spellings still work, with a note naming the new one; --checkpoint on a Hugging Face
    # directory simply loads it
    c, err = _generate(capsys, "--checkpoint", str(hf_dir), *flags)
    assert c["ids"] == a["ids"] and f"logitlab generate {hf_dir}" in err and "--checkpoint" in err
    d, err = _generate(capsys, "--hf", str(native), *flags)
    assert d["ids"] == a["ids"] and "--hf DIR is now the positional MODEL" in err


def test_model_given_twice_or_not_at_all_is_refused(dirs, capsys):
    native, hf_dir = dirs
    with pytest.raises(SystemExit):                                # MODEL, then PROMPT, then one too many
        main(["generate", "--checkpoint", str(native), str(hf_dir), "de"])
    assert "unrecognized arguments: de" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", str(native), "--hf", str(hf_dir), "de"])
    assert "give the model once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", str(native)])
    assert "required: prompt" in capsys.readouterr().err


def test_generation_config_sets_defaults_and_flags_override(dirs, capsys, tmp_path):
    import shutil

    _, hf_dir = dirs
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    (d / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 7, "top_p": 0.9, "max_new_tokens": 5}))
    assert main(["generate", str(d), "de", "--verbose", "--top-k", "3", "--seed", "0", "--json"]) == 0
    captured = capsys.readouterr()
    lines = {line.split(" = ")[0]: line for line in captured.err.splitlines() if " = " in line}
    assert lines["temperature"] == "temperature = 0.6  (the model's generation_config.json)"
    assert lines["top_k"] == "top_k = 3  (--top-k)"
    assert lines["max_new_tokens"] == "max_new_tokens = 5  (the model's generation_config.json)"
    assert lines["min_p"] == "min_p = 0.0  (logitlab's default)"
    assert len(json.loads(captured.out)["ids"]) <= 5
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))   # do_sample absent: greedy
    assert main(["generate", str(d), "de", "--verbose", "--json"]) == 0
    err = capsys.readouterr().err
    assert "temperature = 0.0  (the model's generation_config.json)" in err
    assert "stop_ids = [1, 2]" in err
    (d / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    assert main(["generate", str(d), "de"]) == 2
    assert "generation_config.json: field 'temperature' has 'hot'" in capsys.readouterr().err


def test_out_batch_size_and_seq_len_everywhere(capsys):
    from logitlab.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", "--out", "runs/x"])
    assert args.out_dir == "runs/x"
    assert parser.parse_args(["train", "--out-dir", "runs/y"]).out_dir == "runs/y"     # the old spelling
    args = parser.parse_args(["params", "tiny", "--batch-size", "4", "--seq-len", "64"])
    old = parser.parse_args(["params", "tiny", "--batch", "4", "--context", "64"])
    assert (args.batch_size, args.seq_len) == (old.batch_size, old.seq_len) == (4, 64)
    assert parser.parse_args(["sft", "runs/base", "--out", "runs/s"]).out_dir == "runs/s"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    assert "--out OUT_DIR" in help_text and "--out-dir" not in help_text


def test_mistyped_preset_is_answered_with_the_closest(capsys):
    assert main(["params", "llama3-8c"]) == 2
    err = capsys.readouterr().err
    assert "did you mean llama3-8b?" in err and "qwen3.5-27b" not in err
    from logitlab.model import get_preset

    with pytest.raises(ValueError, match="did you mean tiny"):
        get_preset("tinny")


def test_help_never_shows_empty_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for command in (["train"], ["generate"], ["sft"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = capsys.readouterr().out
        assert "(default: None)" not in text and "(default: ())" not in text, command


@pytest.mark.slow
def test_params_reads_a_hub_config_only(dirs, tmp_path, monkeypatch, capsys):
    pytest.importorskip("huggingface_hub")
    from tests._hub import add_snapshot, use_cache

    _, hf_dir = dirs
    only = tmp_path / "cfg"
    only.mkdir()
    (only / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    add_snapshot(tmp_path / "hub", "org/shape-only", only)
    use_cache(monkeypatch, tmp_path / "hub")
    assert main(["params", "org/shape-only", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exact"]["total"] > 0
    assert Path(hf_dir / "config.json").is_file()


def test_old_model_flags_become_the_positional():
    from logitlab.cli.models import rewrite_legacy

    assert rewrite_legacy(["generate", "--checkpoint", "runs/a", "--max-new-tokens", "4", "x"])[0] == \
        ["generate", "runs/a", "--max-new-tokens", "4", "x"]
    assert rewrite_legacy(["sft", "--data", "c.jsonl", "--base=runs/a"])[0] == ["sft", "runs/a", "--data", "c.jsonl"]
    argv, notes = rewrite_legacy(["convert", "--to-hf", "m", "--out", "hf"])
    assert argv == ["convert", "m", "--out", "hf"] and "--to-hf DIR is now the positional MODEL" in notes[0]
    assert rewrite_legacy(["export", "runs/a", "--hf", "out"]) == (["export", "runs/a", "--hf", "out"], [])
    assert rewrite_legacy(["generate", "runs/a", "--checkpoint"])[0] == ["generate", "runs/a", "--checkpoint"]
    with pytest.raises(ValueError, match="give the model once"):
        rewrite_legacy(["chat", "--hf", "a", "--checkpoint", "b"])


def test_serve_requests_default_to_the_models_generation_config():
    pytest.importorskip("starlette")
    from logitlab.io.generation_config import sample_defaults
    from logitlab.serve.protocol import sampling

    defaults = sample_defaults({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                "max_new_tokens": 99})
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 99}
    served = {k: v for k, v in defaults.items() if k != "max_new_tokens"}
    config, _ = sampling({}, 100, 16, defaults=served)
    assert (config.temperature, config.top_k, config.top_p, config.max_new_tokens) == (0.6, 20, 0.95, 16)
    config, _ = sampling({"temperature": 1.0, "top_k": 0}, 100, 16, defaults=served)
    assert (config.temperature, config.top_k, config.top_p) == (1.0, 0, 0.95)   # the request wins
    assert sampling({}, 100, 16)[0].temperature == 1.0                            # no generation config
    assert sample_defaults({"eos_token_id": 2}) == {"temperature": 0.0}           # transformers: greedy


def test_tokenizer_commands_read_escapes_and_a_models_tokenizer(dirs, capsys):
    native, hf_dir = dirs
    # one rule for \t and \n everywhere: tokenizer encode and generate get the same ids for "\t"
    assert main(["tokenizer", "encode", "--tokenizer", str(native), "a\\tb\\n", "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)
    from logitlab.io.hf import load_tokenizer

    tok = load_tokenizer(native)
    assert ids == tok.encode("a\tb\n")
    assert main(["tokenizer", "encode", "--tokenizer", str(hf_dir), "a\\tb\\n", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == ids                    # a Hugging Face directory's tokenizer
    assert main(["tokenizer", "encode", "--tokenizer", str(hf_dir / "nothing-here.json"), "x"]) == 2
    assert "tokenizer file not found" in capsys.readouterr().err


def test_list_flags_add_up_when_repeated():
    from logitlab.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["eval", "bpb", "m", "--data", "a.txt", "--data", "b.txt", "c.txt"])
    assert args.data == ["a.txt", "b.txt", "c.txt"]
    args = parser.parse_args(["train", "--layer-types", "full_attention", "--layer-types", "sliding_attention"])
    assert args.layer_types == ["full_attention", "sliding_attention"]
    args = parser.parse_args(["tokenizer", "add-special", "m", "--out", "o", "--tokens", "<a>", "--tokens", "<b>"])
    assert args.model == "m" and args.tokens == ["<a>", "<b>"]


def test_every_help_page_has_an_example_that_parses():
    """Every command and subcommand's --help ends with examples, and each example (the part after
    `logitlab`, before a # comment) parses with the real parser."""
    import argparse
    import shlex

    from logitlab.cli.main import build_parser
    from logitlab.cli.models import rewrite_legacy

    parser = build_parser()

    def walk(p, path):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield path + [name], sub
                    yield from walk(sub, path + [name])

    for path, sub in walk(parser, []):
        assert sub.epilog and sub.epilog.startswith("example"), " ".join(path)
        for line in sub.epilog.splitlines()[1:]:
            command = line.split("#")[0].split("|")[-1].strip()
            if not command.startswith("logitlab ") or "harness" in path:
                continue
            argv = shlex.split(command)[1:]
            parser.parse_args(rewrite_legacy(argv)[0])     # SystemExit on a bad example


def test_train_does_not_offer_bidirectional_attention(capsys):
    from logitlab.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--attention", "bidirectional"])
    assert "unrecognized arguments: --attention" in capsys.readouterr().err
