"""Hugging Face parity: random tiny transformers models of every family, loaded into logitlab and
exported back, must give the same hidden states and logits (fp32, 1e-4). No downloads."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from logitlab import checkpoint, families, hf  # noqa: E402
from logitlab.cli import main  # noqa: E402
from logitlab.model import ModelConfig, Transformer  # noqa: E402

TOL = 1e-4
_SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=0, eos_token_id=1)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}

# name -> (config factory, class transformers loads our export as)
_GPT2 = dict(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1)
FAMILIES = {
    "gpt2": (lambda: transformers.GPT2Config(**_GPT2), "GPT2LMHeadModel"),
    "gpt2-untied": (lambda: transformers.GPT2Config(**_GPT2, tie_word_embeddings=False), "GPT2LMHeadModel"),
    "llama-gqa-rope-scaling": (lambda: transformers.LlamaConfig(**_SMALL, rope_theta=500000.0,
                                                                rope_scaling=_LLAMA3_ROPE),
                               "LlamaForCausalLM"),
    "llama-mha-tied": (lambda: transformers.LlamaConfig(**{**_SMALL, "num_key_value_heads": 4},
                                                        tie_word_embeddings=True), "LlamaForCausalLM"),
    # Mistral without a sliding window is Llama's computation; the export names it LlamaForCausalLM
    "mistral": (lambda: transformers.MistralConfig(**_SMALL, sliding_window=None), "LlamaForCausalLM"),
    "qwen2": (lambda: transformers.Qwen2Config(**_SMALL, tie_word_embeddings=True), "Qwen2ForCausalLM"),
    "qwen3": (lambda: transformers.Qwen3Config(**_SMALL, head_dim=32, tie_word_embeddings=True),
              "Qwen3ForCausalLM"),
}


def _random_hf_model(name: str):
    """A random-initialised transformers model; norm weights perturbed so they matter."""
    torch.manual_seed(0)
    config = FAMILIES[name][0]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or ".ln_" in pname or pname.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ids(vocab=97, T=12):
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))


def _assert_parity(ours: Transformer, theirs, ids=None):
    ids = _ids() if ids is None else ids
    with torch.no_grad():
        logits, hidden = ours.eval().forward_with_hidden(ids)
        ref = theirs.eval()(input_ids=ids, output_hidden_states=True)
    assert len(hidden) == len(ref.hidden_states)
    for i, (a, b) in enumerate(zip(hidden, ref.hidden_states)):
        assert (a - b).abs().max() < TOL, f"hidden state {i}"
    assert logits.shape == ref.logits.shape
    assert (logits - ref.logits).abs().max() < TOL


def _load_hf(directory):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), attn_implementation="eager", output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (transformers model, its save_pretrained directory), built once per module."""
    out = {}
    for name in FAMILIES:
        model = _random_hf_model(name)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        out[name] = (model, d)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_to_logitlab_parity(hf_dirs, name):
    theirs, d = hf_dirs[name]
    ours = hf.load_pretrained(d)
    assert ours.config.tie_embeddings == theirs.config.tie_word_embeddings
    if ours.config.tie_embeddings:
        assert ours.lm_head.weight is ours.tok_emb.weight
    _assert_parity(ours, theirs)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logitlab_to_hf_parity(hf_dirs, tmp_path, name):
    theirs, d = hf_dirs[name]
    ours = Transformer.from_pretrained(d)
    ours.save_pretrained(tmp_path / "export")
    reloaded, info = _load_hf(tmp_path / "export")
    assert type(reloaded).__name__ == FAMILIES[name][1]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    _assert_parity(ours, reloaded)
    stored = json.loads((tmp_path / "export" / "config.json").read_text())
    assert stored["architectures"] == [FAMILIES[name][1]] and stored["torch_dtype"] == "float32"


def test_logitlab_native_model_exports_to_hf(tmp_path):
    """A model trained in logitlab (padded vocabulary, GQA, QK-norm) round-trips through HF."""
    cfg = ModelConfig(vocab_size=90, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      norm="rmsnorm", mlp="swiglu", positions="rope", qk_norm=True, bias=False,
                      vocab_pad_multiple=64)
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    hf.save_pretrained(ours, tmp_path / "out")
    reloaded, info = _load_hf(tmp_path / "out")
    assert type(reloaded).__name__ == "Qwen3ForCausalLM" and not info["missing_keys"]
    assert reloaded.config.vocab_size == 90   # padding rows are not exported
    _assert_parity(ours, reloaded, _ids(90))
    report = hf.verify_against_transformers(ours)   # exports to a temporary directory itself
    assert report["ok"] and report["logits"] < TOL and len(report["hidden"]) == 3


def test_sharded_safetensors_index(hf_dirs, tmp_path):
    from safetensors.torch import save_file

    theirs, d = hf_dirs["llama-gqa-rope-scaling"]
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for fname, names in shards.items():
        save_file({k: state[k] for k in names}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, names in shards.items() for k in names}}
    (tmp_path / hf.SAFETENSORS_INDEX).write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    _assert_parity(hf.load_pretrained(tmp_path), theirs)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        hf.load_pretrained(tmp_path)


def test_legacy_bin_and_base_model_keys(hf_dirs, tmp_path):
    """pytorch_model.bin read with weights_only=True; GPT2Model-style keys (no "transformer."
    prefix) with the old attn.bias buffers; a tied lm_head stored as a copy."""
    theirs, d = hf_dirs["gpt2"]
    state = {k.removeprefix("transformer."): v.clone() for k, v in theirs.state_dict().items()}
    state["h.0.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
    state["lm_head.weight"] = state["wte.weight"].clone()
    torch.save(state, tmp_path / hf.TORCH_BIN)
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    _assert_parity(hf.load_pretrained(tmp_path), theirs)


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda s: s.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64)),
     r"'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), config.json implies \(32, 64\)"),
    (lambda s: s.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64)),
     "unexpected tensor 'model.layers.9.mlp.up_proj.weight'"),
])
def test_mismatched_checkpoint_is_refused(hf_dirs, tmp_path, edit, match):
    from safetensors.torch import save_file

    theirs, d = hf_dirs["llama-gqa-rope-scaling"]
    state = {k: v.clone() for k, v in theirs.state_dict().items()}
    edit(state)
    save_file(state, str(tmp_path / hf.SAFETENSORS))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        hf.load_pretrained(tmp_path)


def test_missing_weights_named(tmp_path, hf_dirs):
    (tmp_path / "config.json").write_text((hf_dirs["qwen3"][1] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.load_pretrained(tmp_path)


def test_verify_catches_a_wrong_conversion(hf_dirs, monkeypatch):
    _, d = hf_dirs["qwen3"]
    assert hf.load_pretrained(d, verify=True).config.qk_norm
    original = families.state_dict_from_hf

    def swapped(hf_state, config):  # a plausible bug: q_norm and k_norm exchanged
        state = original(hf_state, config)
        state["blocks.0.attn.q_norm.weight"], state["blocks.0.attn.k_norm.weight"] = (
            state["blocks.0.attn.k_norm.weight"], state["blocks.0.attn.q_norm.weight"])
        return state

    monkeypatch.setattr(families, "state_dict_from_hf", swapped)
    with pytest.raises(ValueError, match="disagrees with transformers"):
        hf.load_pretrained(d, verify=True)


def test_logitlab_dir_and_dtype(tmp_path):
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layers=1, n_heads=2)
    model = Transformer(cfg)
    checkpoint.save_model(model, tmp_path / "m")
    loaded = hf.load_pretrained(tmp_path / "m", dtype="bf16")
    assert loaded.tok_emb.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.tok_emb.weight.float(), model.tok_emb.weight.bfloat16().float())
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        hf.load_pretrained(tmp_path / "m", dtype="fp8")


def test_cli_convert_both_ways(hf_dirs, tmp_path, capsys):
    _, d = hf_dirs["llama-gqa-rope-scaling"]
    assert main(["convert", "--hf", str(d), "--out", str(tmp_path / "ll"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "block 1 + final norm" in out and "logits" in out and "OK" in out
    assert checkpoint.is_logitlab_dir(tmp_path / "ll")
    back = str(tmp_path / "back")
    assert main(["convert", "--to-hf", str(tmp_path / "ll"), "--out", back, "--verify"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert main(["convert", "--to-hf", str(tmp_path / "ll")]) == 2   # --out missing
    assert "--out" in capsys.readouterr().err


def test_cli_convert_carries_the_tokenizer(tmp_path):
    from logitlab.tokenizer import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256], vocab[257] = b"th", b"the"
    tok = Tokenizer(vocab, [(b"t", b"h"), (b"th", b"e")], special_tokens={"<|endoftext|>": 258})
    cfg = ModelConfig(vocab_size=259, context_length=16, d_model=32, n_layers=1, n_heads=2,
                      norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    model_dir = tmp_path / "native"
    with checkpoint.atomic_directory(model_dir) as tmp:
        checkpoint.write_model_files(Transformer(cfg), tmp)
        tok.save(tmp / checkpoint.TOKENIZER_FILE)
    assert main(["convert", "--to-hf", str(model_dir), "--out", str(tmp_path / "hf")]) == 0
    theirs = pytest.importorskip("tokenizers").Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    text = "the theme there"
    assert theirs.encode(text).ids == tok.encode(text)
    assert main(["convert", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = Tokenizer.load(tmp_path / "back" / checkpoint.TOKENIZER_FILE)
    assert back.encode(text) == tok.encode(text) and back.fingerprint() == tok.fingerprint()
