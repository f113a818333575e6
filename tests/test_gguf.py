"""GGUF files: every architecture logitlab shares with llama.cpp written and read back, the
logits equal to the same weights loaded directly (exactly in F32; the weights rounded as the file
rounds them in F16, BF16, Q8_0 and Q4_0), and within each format's own error of the original."""

from __future__ import annotations

import pytest
import torch

from logitlab.model import ModelConfig, Transformer
from logitlab.quant import reference as ref

gguf = pytest.importorskip("gguf")
from logitlab.quant.gguf import load_gguf, save_gguf  # noqa: E402

BASE = dict(vocab_size=300, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
            norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False, norm_eps=1e-5)
CONFIGS = {
    "llama": BASE,
    "qwen2": {**BASE, "qkv_bias": True},
    "qwen3": {**BASE, "qk_norm": True, "tie_embeddings": True, "rope_theta": 1e6},
    "gpt2": dict(vocab_size=300, context_length=64, d_model=64, n_layers=2, n_heads=4, d_ff=256, norm="layernorm",
                 mlp="gelu", positions="learned", bias=True, qkv_bias=True, tie_embeddings=True),
}
ROUNDED = {"F32": lambda w: w, "F16": lambda w: w.half().float(), "BF16": lambda w: w.bfloat16().float(),
           "Q8_0": lambda w: ref.dequantize_q8_0(*ref.quantize_q8_0(w)),
           "Q4_0": lambda w: ref.dequantize_q4_0(*ref.quantize_q4_0(w))}
ERROR = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_0": 0.2}   # relative to the largest logit


def _model(arch: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CONFIGS[arch])).eval()
    with torch.no_grad():                                      # norms and biases away from 1 and 0
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _rounded(model: Transformer, qtype: str) -> Transformer:
    """The same model with every matrix rounded as the file stores it (norms, biases in F32)."""
    out = Transformer(model.config).eval()
    out.load_state_dict({k: ROUNDED[qtype](v) if v.ndim == 2 else v for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("arch,qtype", [(arch, "Q8_0") for arch in sorted(CONFIGS)]
                         + [("llama", q) for q in ("F32", "F16", "BF16", "Q4_0")] + [("gpt2", "Q4_0")])
def test_a_gguf_file_gives_the_logits_of_its_weights(tmp_path, arch, qtype):
    model = _model(arch)
    path = save_gguf(model, tmp_path / f"{arch}.gguf", qtype)
    loaded = load_gguf(path)
    assert loaded.config == model.config
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        got, exact, original = loaded(ids), _rounded(model, qtype)(ids), model(ids)
    torch.testing.assert_close(got, exact, atol=2e-5, rtol=2e-5)
    assert float((got - original).abs().max() / original.abs().max()) <= ERROR[qtype]


def test_the_file_is_what_llama_cpp_reads(tmp_path):
    model = _model("llama")
    reader = gguf.GGUFReader(str(save_gguf(model, tmp_path / "m.gguf", "Q8_0")))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 300
    # llama.cpp's q rows: within each head, the two halves' dimensions interleaved
    q = torch.from_numpy(gguf.quants.dequantize(reader.tensors[[t.name for t in reader.tensors].index(
        "blk.0.attn_q.weight")].data, gguf.GGMLQuantizationType.Q8_0).copy())
    hf_q = model.blocks[0].attn.qkv_proj.weight[:64]                         # head 0: rows 0..15
    rounded = ROUNDED["Q8_0"](hf_q)
    torch.testing.assert_close(q[1], rounded[8])                              # row 1 = dimension 0 of half 2


def test_bad_files_and_requests_are_named(tmp_path):
    model = _model("llama")
    save_gguf(model, tmp_path / "m.gguf", "F16")
    with pytest.raises(FileExistsError, match="m.gguf exists"):
        save_gguf(model, tmp_path / "m.gguf", "F16")
    with pytest.raises(ValueError, match="tensor type must be one of"):
        save_gguf(model, tmp_path / "n.gguf", "Q2_K")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF file"):
        load_gguf(tmp_path / "junk.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match="architecture 'mamba' is not one logitlab reads"):
        load_gguf(tmp_path / "mamba.gguf")


def test_a_quantized_model_is_not_written():
    from logitlab.quant import QuantConfig, quantize_model

    model = _model("llama")
    quantize_model(model, QuantConfig("int8"))
    with pytest.raises(ValueError, match="quantized already"):
        save_gguf(model, "/nonexistent/m.gguf")


def test_generate_reads_a_gguf_file_beside_its_tokenizer(tmp_path, capsys):
    from logitlab.cli.main import main
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens={"<|endoftext|>": 256})
    model = Transformer(ModelConfig(**{**BASE, "vocab_size": tok.vocab_size})).eval()
    save_gguf(model, tmp_path / "m.gguf", "Q8_0")
    assert main(["generate", str(tmp_path / "m.gguf"), "the cat", "--max-new-tokens", "4", "--json"]) == 2
    assert "a GGUF file's own tokenizer is not read" in capsys.readouterr().err
    tok.save(tmp_path / "tokenizer.logitlab.json")
    assert main(["generate", str(tmp_path / "m.gguf"), "the cat", "--max-new-tokens", "4", "--json",
                 "--temperature", "0"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    want = Transformer(model.config)
    want.load_state_dict({k: ROUNDED["Q8_0"](v) if v.ndim == 2 else v for k, v in model.state_dict().items()})
    from logitlab.generate import SampleConfig, generate

    greedy = SampleConfig(temperature=0, max_new_tokens=4)
    assert out["ids"] == generate(want.eval(), out["prompt_ids"], greedy).tokens[0]
