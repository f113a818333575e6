"""Hugging Face parity: random tiny transformers models of every family, loaded into logitlab and
exported back, must give the same hidden states and logits (fp32, 1e-4). No downloads."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from logitlab.cli import main  # noqa: E402
from logitlab.io import checkpoint, hf  # noqa: E402
from logitlab.model import ModelConfig, Transformer, families  # noqa: E402

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
        model.save_pretrained(d)  # transformers' own save: the directory under test
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
    ours = hf.load_pretrained(d)
    hf.save_pretrained(ours, tmp_path / "export")
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


def _write_layout(state: dict, directory, layout: str) -> None:
    """`state` as one file or two shards (keys dealt alternately, so a layer's q/k/v and gate/up
    are split between the shards), in safetensors or the legacy pytorch_model.bin format."""
    from safetensors.torch import save_file

    suffix = "safetensors" if layout.endswith("safetensors") else "bin"
    write = ((lambda s, p: save_file(s, str(p))) if suffix == "safetensors" else torch.save)
    if not layout.startswith("sharded"):
        write(state, directory / (hf.SAFETENSORS if suffix == "safetensors" else hf.TORCH_BIN))
        return
    keys = sorted(state)
    stem = "model" if suffix == "safetensors" else "pytorch_model"
    shards = {f"{stem}-0000{i + 1}-of-00002.{suffix}": keys[i::2] for i in range(2)}
    for fname, names in shards.items():
        write({k: state[k] for k in names}, directory / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, names in shards.items() for k in names}}
    index_name = hf.SAFETENSORS_INDEX if suffix == "safetensors" else hf.TORCH_BIN_INDEX
    (directory / index_name).write_text(json.dumps(index))


@pytest.mark.parametrize("layout", ["safetensors", "sharded-safetensors", "bin", "sharded-bin"])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-rope-scaling"])
def test_streamed_load_every_layout_and_dtype(hf_dirs, tmp_path, name, layout):
    """Each layout loads to the transformers model's outputs; dtype=bf16 gives bf16 parameters
    equal bit for bit to the fp32 load cast afterwards (the cast per tensor, before the Conv1D
    transposes and fused concatenations, commutes with them), and a tied head stays tied."""
    theirs, d = hf_dirs[name]
    tied = theirs.config.tie_word_embeddings
    state = {k: v.clone() for k, v in theirs.state_dict().items() if not (tied and k == "lm_head.weight")}
    _write_layout(state, tmp_path, layout)
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    ours = hf.load_pretrained(tmp_path)
    _assert_parity(ours, theirs)
    half = hf.load_pretrained(tmp_path, dtype="bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert (half.lm_head.weight is half.tok_emb.weight) == tied
    reference = ours.to(torch.bfloat16).state_dict()
    for key, tensor in half.state_dict().items():
        assert torch.equal(tensor, reference[key]), key
    assert hf.read_hf_weights(tmp_path).keys() == state.keys()


_PEAK_SCRIPT = """
import sys, torch
from logitlab.io import hf

def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

torch.empty(1, device="meta").normal_()   # torch imports torch._dynamo (75 MB of code) once here
with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM to the current RSS
    f.write("5")
base = kib("VmRSS")
model = hf.load_pretrained(sys.argv[1], dtype=sys.argv[2] if sys.argv[2] != "none" else None)
assert next(model.parameters()).dtype == (torch.bfloat16 if sys.argv[2] == "bf16" else torch.float32)
print((kib("VmHWM") - base) * 1024)
"""


@pytest.fixture(scope="module")
def big_hf_dir(tmp_path_factory):
    """A 31M-parameter (124 MB in fp32) Llama-layout export, many tensors of similar size."""
    cfg = ModelConfig(vocab_size=4096, context_length=64, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8,
                      d_ff=1536, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False,
                      tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(cfg)
    d = tmp_path_factory.mktemp("big")
    hf.save_pretrained(model, d)
    return d, 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.skipif(not __import__("os").access("/proc/self/clear_refs", __import__("os").W_OK),
                    reason="needs Linux /proc/self/clear_refs to reset the peak resident memory")
@pytest.mark.slow
@pytest.mark.parametrize("dtype, bound", [("none", 1.2), ("bf16", 0.75)])
def test_load_streams_tensor_by_tensor(big_hf_dir, dtype, bound):
    """The peak resident memory of loading, in a fresh process, stays near the loaded model's own
    size: fp32 below 1.2x the fp32 model (reading the whole file and then building the fused
    q/k/v and gate/up copies costs about 2x), bf16 below 0.75x the fp32 model (so the fp32
    checkpoint is never all resident at once; the bf16 model is 0.5x)."""
    import subprocess
    import sys

    d, fp32_bytes = big_hf_dir
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(d), dtype], capture_output=True,
                         text=True, check=True)
    peak = int(out.stdout.split()[-1])
    assert peak < bound * fp32_bytes, f"peak {peak / 2**20:.0f} MiB, fp32 model {fp32_bytes / 2**20:.0f} MiB"


def test_save_pretrained_without_tokenizer_names_no_special_ids(tmp_path):
    """Without a tokenizer no end-of-text id is known: config.json says null rather than leaving
    transformers' class defaults (GPT-2 50256, Llama 1 and 2; outside this vocabulary of 50)."""
    for kw in ({}, dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)):
        cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layers=1, n_heads=2, **kw)
        d = tmp_path / ("llama" if kw else "gpt2")
        hf.save_pretrained(Transformer(cfg), d)
        stored = json.loads((d / "config.json").read_text())
        assert stored["bos_token_id"] is None and stored["eos_token_id"] is None
        theirs, _ = _load_hf(d)
        assert theirs.config.eos_token_id is None and theirs.config.bos_token_id is None
        assert theirs.generation_config.eos_token_id is None
        out = theirs.generate(torch.tensor([[3, 4]]), max_new_tokens=5, do_sample=False)
        assert out.shape == (1, 7)


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
    original = families.hf_tensors_to_logitlab
    swap = {"blocks.0.attn.q_norm.weight": "blocks.0.attn.k_norm.weight",
            "blocks.0.attn.k_norm.weight": "blocks.0.attn.q_norm.weight"}

    def swapped(items, config):  # a plausible bug: q_norm and k_norm exchanged
        for name, tensor in original(items, config):
            yield swap.get(name, name), tensor

    monkeypatch.setattr(families, "hf_tensors_to_logitlab", swapped)
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
    assert main(["convert", str(d), "--out", str(tmp_path / "ll"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "block 1 + final norm" in out and "logits" in out and "OK" in out
    assert checkpoint.is_logitlab_dir(tmp_path / "ll")
    back = str(tmp_path / "back")
    assert main(["convert", str(tmp_path / "ll"), "--out", back, "--verify"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "ll")]) == 2   # --out missing
    assert "--out" in capsys.readouterr().err


def test_cli_convert_carries_the_tokenizer(tmp_path):
    from logitlab.tokenizer.core import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256], vocab[257] = b"th", b"the"
    tok = Tokenizer(vocab, [(b"t", b"h"), (b"th", b"e")], special_tokens={"<|endoftext|>": 258})
    cfg = ModelConfig(vocab_size=259, context_length=16, d_model=32, n_layers=1, n_heads=2,
                      norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    model_dir = tmp_path / "native"
    with checkpoint.atomic_directory(model_dir) as tmp:
        checkpoint.write_model_files(Transformer(cfg), tmp)
        tok.save(tmp / checkpoint.TOKENIZER_FILE)
    assert main(["convert", str(model_dir), "--out", str(tmp_path / "hf")]) == 0
    theirs = pytest.importorskip("tokenizers").Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    text = "the theme there"
    assert theirs.encode(text).ids == tok.encode(text)
    assert main(["convert", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = Tokenizer.load(tmp_path / "back" / checkpoint.TOKENIZER_FILE)
    assert back.encode(text) == tok.encode(text) and back.fingerprint() == tok.fingerprint()


def test_load_tokenizer_finds_each_format_in_order(tmp_path, gpt2_files):
    """tokenizer.json first, then GPT-2's vocab.json + merges.txt, then logitlab's own file;
    None when the directory has none; a broken file is an error naming it."""
    import shutil

    from logitlab.tokenizer.core import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256], vocab[257] = b"th", b"the"
    tok = Tokenizer(vocab, [(b"t", b"h"), (b"th", b"e")], special_tokens={"<|endoftext|>": 258})
    text = "the theme there<|endoftext|>"
    assert hf.load_tokenizer(tmp_path) is None
    tok.save(tmp_path / checkpoint.TOKENIZER_FILE)
    assert hf.load_tokenizer(tmp_path).encode(text) == tok.encode(text)
    for f in gpt2_files:
        shutil.copy(f, tmp_path / f.name)
    assert hf.load_tokenizer(tmp_path).encode("hello world") == [31373, 995]     # GPT-2's ids
    tok.save_hf(tmp_path / "tokenizer.json")
    assert hf.load_tokenizer(tmp_path).encode(text) == tok.encode(text)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        hf.load_tokenizer(tmp_path)
