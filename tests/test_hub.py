"""Hub ids resolve through huggingface_hub's cache, offline, into the same loading as a local
directory: by id, with a revision, as `ORG/NAME@REV`, from Python and the CLI; a missing model
and a repository of pickled weights are one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from logitlab.io import hf, hub
from logitlab.model import Transformer, get_preset
from tests._hub import add_snapshot, use_cache

pytest.importorskip("huggingface_hub")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama-shaped Hugging Face directory with a byte-level tokenizer."""
    from logitlab.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("hfmodel")
    (root / "text.txt").write_text("def main():\n    return 0\n" * 50 + "import os, sys\n" * 30)
    d = root / "m"
    tok = train_tokenizer(root / "text.txt", vocab_size=280, special_tokens=["<|endoftext|>"])
    model = Transformer(get_preset("tiny", vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2,
                                   n_kv_heads=1, d_ff=64, context_length=64, vocab_pad_multiple=1))
    hf.save_pretrained(model, d, tok)
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch, model_dir):
    c = tmp_path / "hub"
    add_snapshot(c, "tiny-org/tiny-llama", model_dir, revisions=("main", "v1"))
    use_cache(monkeypatch, c)
    return c


def test_hub_id_loads_like_its_directory(cache, model_dir):
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = hf.load_pretrained(model_dir)
    for spec, revision in (("tiny-org/tiny-llama", None), ("tiny-org/tiny-llama@v1", None),
                           ("tiny-org/tiny-llama", "main")):
        got = hf.load_pretrained(spec, revision=revision)
        assert torch.equal(got(ids), ref(ids)), spec
    tok = hf.load_tokenizer("tiny-org/tiny-llama")
    assert tok.encode("def main():") == hf.load_tokenizer(model_dir).encode("def main():")


def test_resolved_records_the_commit(cache):
    r = hub.resolve_model("tiny-org/tiny-llama@v1")
    assert r.repo_id == "tiny-org/tiny-llama" and r.revision == "v1" and len(r.commit) == 40
    assert r.directory.parent.name == "snapshots" and r.directory.name == r.commit
    assert r.provenance() == {"source": "tiny-org/tiny-llama", "revision": "v1", "commit": r.commit}


def test_missing_model_offline_is_one_clear_line(cache):
    with pytest.raises(ValueError) as err:
        hf.load_pretrained("tiny-org/absent")
    text = str(err.value)
    assert "tiny-org/absent@main" in text and "HF_HUB_OFFLINE=1" in text and str(cache) in text
    with pytest.raises(ValueError, match="tiny-org/tiny-llama@nope"):
        hub.resolve_model("tiny-org/tiny-llama", revision="nope")
    with pytest.raises(ValueError, match="names revision 'v1' but --revision is 'main'"):
        hub.resolve_model("tiny-org/tiny-llama@v1", revision="main")


def test_local_paths_win_and_non_ids_are_not_looked_up(tmp_path, cache, model_dir):
    assert hub.resolve_model(model_dir).directory == model_dir
    with pytest.raises(ValueError, match="is a local path"):
        hub.resolve_model(model_dir, revision="main")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        hub.resolve_model(tmp_path / "absent" / "deeper" / "dir")
    assert hub.looks_like_hub_id("gpt2") and hub.looks_like_hub_id("Qwen/Qwen3-0.6B@main")
    assert not hub.looks_like_hub_id("../x") and not hub.looks_like_hub_id("a/b/c")


def test_pickled_weights_are_refused(tmp_path, monkeypatch, model_dir):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    cache = tmp_path / "hub"
    add_snapshot(cache, "org/pickled", pickled)
    use_cache(monkeypatch, cache)
    with pytest.raises(ValueError, match="org/pickled@main has no safetensors weights.*never loads pickled"):
        hf.load_pretrained("org/pickled")


@pytest.mark.slow
def test_cli_generate_by_hub_id(cache):
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "logitlab", "generate", "tiny-org/tiny-llama", "def",
                          "--max-new-tokens", "4", "--temperature", "0", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"tokens"' in out.stdout or '"text"' in out.stdout
    missing = subprocess.run([sys.executable, "-m", "logitlab", "generate", "tiny-org/absent", "def"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "tiny-org/absent@main" in missing.stderr and "not reachable" in missing.stderr


def test_convert_by_hub_id_records_where_the_weights_came_from(cache, tmp_path, capsys):
    """A logitlab directory converted from a hub id keeps the id, the revision asked for and the
    commit it resolved to in its config.json, and still loads."""
    import json

    from logitlab.cli.main import main
    from logitlab.io import checkpoint

    out = tmp_path / "converted"
    assert main(["convert", "tiny-org/tiny-llama@v1", "--out", str(out)]) == 0
    commit = hub.resolve_model("tiny-org/tiny-llama@v1").commit
    assert f"from tiny-org/tiny-llama@{commit}" in capsys.readouterr().out
    source = json.loads((out / "config.json").read_text())["source"]
    assert source == {"source": "tiny-org/tiny-llama", "revision": "v1", "commit": commit}
    model, _ = checkpoint.load_for_inference(out)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(ids), hf.load_pretrained("tiny-org/tiny-llama")(ids))
