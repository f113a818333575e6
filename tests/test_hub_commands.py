"""The commands that read a model take a hub id as they take a directory: `inspect --lens`, `eval
bpb` and `sft` with LoRA, on tiny models put into a hub cache on disk (offline), one Qwen3-shaped
with a byte-level tokenizer that normalizes to NFC as Qwen's does, one Llama-shaped with a
SentencePiece-style tokenizer as TinyLlama's and Mistral's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from logitlab.cli.main import main
from logitlab.io import hf, hub
from logitlab.model import Transformer, get_preset
from tests import _sp_tokenizers
from tests._hub import add_snapshot, use_cache

pytest.importorskip("huggingface_hub")
QWEN, LLAMA_SP = "tiny-org/tiny-qwen3", "tiny-org/tiny-llama-sp"
CHATS = [[{"role": "user", "content": f"What does {w} do?"}, {"role": "assistant", "content": f"It {w}s."}]
         for w in ("sort", "sum", "map", "zip", "hash", "iter", "find", "join")]
TEXT = "What does sort do? It sorts, naïve café.\n" * 20


def _tiny(vocab_size: int, **features):
    return Transformer(get_preset("tiny", vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                  d_ff=64, context_length=128, vocab_pad_multiple=1, **features))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Two Hugging Face directories: a Qwen3-shaped model (QK-norm) whose byte-level tokenizer has
    Qwen's NFC normalizer and ChatML tokens, and a Llama-shaped one with a SentencePiece-style
    tokenizer (Llama-2 / TinyLlama layout, <s> and </s>)."""
    from logitlab.tokenizer import Tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("hubcmd")
    (root / "text.txt").write_text(TEXT + " ".join(c[0]["content"] + " " + c[1]["content"] for c in CHATS) * 20)
    trained = train_tokenizer(root / "text.txt", 300, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], workers=1)
    tok = Tokenizer(dict(trained._decoder), trained.merges, trained.special_tokens, trained.pattern,
                    normalization="NFC")
    hf.save_pretrained(_tiny(tok.vocab_size, qk_norm=True), root / "qwen", tok)
    _sp_tokenizers.build("llama", root / "llama", vocab_size=300)
    _sp_tokenizers.write_config(root / "llama", "llama")
    sp = hf.load_tokenizer(root / "llama")
    hf.write_hf_files(_tiny(sp.vocab_size), root / "llama")
    with open(root / "chats.jsonl", "w") as f:
        for c in CHATS * 3:
            f.write(json.dumps({"messages": c}) + "\n")
    return root


@pytest.fixture
def cache(sources, tmp_path, monkeypatch) -> Path:
    c = tmp_path / "hub"
    add_snapshot(c, QWEN, sources / "qwen")
    add_snapshot(c, LLAMA_SP, sources / "llama")
    use_cache(monkeypatch, c)
    return c


def _json(capsys, argv) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("repo_id", [QWEN, LLAMA_SP])
def test_inspect_with_the_logit_lens_by_hub_id(cache, repo_id, capsys):
    by_id = _json(capsys, ["inspect", repo_id, "naïve café", "--lens", "--json"])
    local = str(hub.resolve_model(repo_id).directory)      # the snapshot folder, named as a directory
    assert by_id == _json(capsys, ["inspect", local, "naïve café", "--lens", "--json"])
    assert len(by_id["lens"]) == 3                           # the embeddings and each of the 2 layers
    if repo_id == QWEN:                                     # Qwen's NFC: the decomposed text reads the same
        decomposed = _json(capsys, ["inspect", repo_id, "nai\u0308ve cafe\u0301", "--lens", "--json"])
        assert decomposed["ids"] == by_id["ids"]


def test_eval_bits_per_byte_by_hub_id(cache, sources, capsys):
    for repo_id in (QWEN, LLAMA_SP):
        argv = ["eval", "bpb", "--data", str(sources / "text.txt"), "--json"]
        by_id = _json(capsys, ["eval", "bpb", repo_id, *argv[2:]])
        local = _json(capsys, ["eval", "bpb", str(hub.resolve_model(repo_id).directory), *argv[2:]])
        assert by_id.pop("model") == repo_id and local.pop("model") != repo_id
        assert by_id == local and 0 < by_id["bits_per_byte"] < 20


def test_sft_with_lora_by_hub_id_records_the_pinned_base(cache, sources, tmp_path, capsys):
    code = main(["sft", QWEN, "--data", str(sources / "chats.jsonl"), "--out", str(tmp_path / "run"),
                 "--steps", "2", "--batch-size", "2", "--eval-every", "2", "--device", "cpu", "--samples", "0",
                 "--lora-targets", "q_proj,v_proj", "--lora-r", "2", "--tensorboard", "false",
                 "--export-hf", str(tmp_path / "hf")])
    assert code == 0, capsys.readouterr().err
    assert "val loss" in capsys.readouterr().out
    commit = hub.resolve_model(QWEN).commit
    state = json.loads(next((tmp_path / "run").glob("ckpt-*/state.json")).read_text())
    assert state["base"] == f"{QWEN}@{commit}"              # the exact revision, to rebuild the base from
    adapter = json.loads((tmp_path / "hf-adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    tok = hf.load_tokenizer(tmp_path / "hf")
    assert tok.normalization == "NFC"                       # the tokenizer goes out as it came in
