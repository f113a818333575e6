"""GGUF files (llama.cpp's format) for the architectures both sides share: read, and write.

gguf.py owns the mapping between a GGUF file and a logitlab model: metadata <-> ModelConfig and
GGUF tensor names <-> Hugging Face names, from which model/keymap.py takes them the rest of the
way, as for a Hugging Face directory. The file itself is read and written by the `gguf` package
(llama.cpp's own Python library; `pip install 'logitlab[quant]'`).

    model = load_gguf("model-Q8_0.gguf", dtype=torch.bfloat16)
    save_gguf(model, "model-Q4_0.gguf", "Q4_0")

Architectures: "llama" (Llama and Mistral checkpoints), "qwen2", "qwen3" and "gpt2". Tensor types:
F32, F16, BF16, Q8_0 and Q4_0 (and any other the gguf package can dequantize). Every weight is
dequantized as it is read, to exactly the numbers llama.cpp computes with (reference.py writes
Q8_0 / Q4_0 out; tests check both against the gguf package), then cast to `dtype`: the model runs
them as dense weights, and `quant.quantize_model` (or `--quantize`) makes them small again in
logitlab's own formats. The tokenizer inside a GGUF file is not read.

llama.cpp rotates "llama" queries and keys in pairs of adjacent dimensions where Hugging Face
rotates the two halves of each head, so its converter permutes the rows of q and k within each
head; reading undoes that permutation (_unpermute) and writing applies it (_permute). Its other
architectures keep Hugging Face's row order.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from logitlab.model.config import ModelConfig
from logitlab.quant import reference as ref

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gpt2": "GPT2LMHeadModel"}
WRITE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")

# GGUF name -> Hugging Face name; {i} is the layer.
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
             "output": "lm_head"}
_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")   # Hugging Face stores them (in, out)


def _gguf():
    import gguf  # the [quant] extra; a missing one names it

    return gguf


def _tables(arch: str):
    return (_GPT2_TOP, "transformer.h.", _GPT2_BLOCK) if arch == "gpt2" else (_LLAMA_TOP, "model.layers.", _LLAMA_BLOCK)


def hf_name(name: str, arch: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (None: not a model tensor)."""
    top, prefix, block = _tables(arch)
    module, _, leaf = name.rpartition(".")
    if module in top:
        return f"{top[module]}.{leaf}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if m and m.group(2) in block:
        return f"{prefix}{m.group(1)}.{block[m.group(2)]}.{leaf}"
    return None


def gguf_name(name: str, arch: str) -> str:
    """The inverse of hf_name: 'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'."""
    top, prefix, block = _tables(arch)
    module, _, leaf = name.rpartition(".")
    inverse_top, inverse_block = {v: k for k, v in top.items()}, {v: k for k, v in block.items()}
    if module in inverse_top:
        return f"{inverse_top[module]}.{leaf}"
    layer, _, sub = module.removeprefix(prefix).partition(".")
    if module.startswith(prefix) and sub in inverse_block:
        return f"blk.{layer}.{inverse_block[sub]}.{leaf}"
    raise ValueError(f"tensor {name!r} has no GGUF name for architecture {arch!r}")


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's q or k rows -> llama.cpp's: within each head, dimension j of the first half
    and j of the second half become rows 2j and 2j+1."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q or k rows -> Hugging Face's (the inverse of _permute)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _decimal(value: float) -> float:
    """A float32 from the file as the shortest decimal that is that float32: 1e-05, not
    9.999999747378752e-06 (the number the writer meant)."""
    import numpy as np

    return float(str(np.float32(value)))


def config_from_gguf(reader, source: str = "GGUF file") -> tuple[str, ModelConfig]:
    """(architecture, ModelConfig) from a GGUF reader's metadata and tensor shapes."""
    from logitlab.model.hf_config import config_from_hf

    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: architecture {arch!r} is not one logitlab reads from GGUF "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    shapes = {t.name: [int(n) for n in reversed(t.shape)] for t in reader.tensors}   # (rows, columns)
    if "rope_freqs.weight" in shapes or _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{source}: RoPE scaling in a GGUF file (rope_freqs / rope.scaling) is not read; "
                         "load the model from its Hugging Face directory")

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{source}: metadata lacks {arch}.{key}")
        return value

    hf = {"architectures": [ARCHITECTURES[arch]], "vocab_size": shapes["token_embd.weight"][0],
          "tie_word_embeddings": "output.weight" not in shapes}
    if arch == "gpt2":
        hf.update(n_positions=need("context_length"), n_embd=need("embedding_length"), n_layer=need("block_count"),
                  n_head=need("attention.head_count"), n_inner=need("feed_forward_length"),
                  layer_norm_epsilon=_decimal(need("attention.layer_norm_epsilon")))
    else:
        heads = need("attention.head_count")
        hf.update(max_position_embeddings=need("context_length"), hidden_size=need("embedding_length"),
                  num_hidden_layers=need("block_count"), num_attention_heads=heads,
                  num_key_value_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
                  head_dim=_field(reader, f"{arch}.attention.key_length"),
                  intermediate_size=need("feed_forward_length"),
                  rms_norm_eps=_decimal(need("attention.layer_norm_rms_epsilon")),
                  rope_theta=_decimal(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
                  attention_bias="blk.0.attn_q.bias" in shapes and arch == "llama")
    return arch, config_from_hf(hf, source=source)


def _tensors(reader, arch: str, config: ModelConfig, dtype):
    """(Hugging Face name, tensor) pairs, each dequantized (float32) and cast to `dtype` as read."""
    gguf = _gguf()
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        values = values.reshape([int(n) for n in reversed(t.shape)])                   # (rows, columns)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, config.n_heads if "q_proj" in name else config.n_kv_heads)
        if arch == "gpt2" and name.rpartition(".")[0].split(".", 3)[-1] in _GPT2_CONV1D and values.ndim == 2:
            values = values.t()                                                        # back to (in, out)
        yield name, values.to(dtype or torch.float32).contiguous()


def load_gguf(path: str | os.PathLike, dtype=None, device: str | torch.device = "cpu"):
    """A Transformer (eval mode) with the weights of a GGUF file, dequantized and cast to `dtype`
    (default float32). An architecture, tensor or setting logitlab cannot run is a ValueError
    naming the file."""
    from logitlab.model.keymap import clean_hf_state, hf_tensors_to_logitlab
    from logitlab.model.transformer import Transformer

    gguf = _gguf()
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from exc
    arch, config = config_from_gguf(reader, str(path))
    hf_state = dict(_tensors(reader, arch, config, dtype))
    state = dict(hf_tensors_to_logitlab(clean_hf_state(hf_state, config).items(), config))
    with torch.device("meta"):
        model = Transformer(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    for key, tensor in expected.items():
        if key not in state:
            raise ValueError(f"{path}: the file lacks the tensor logitlab calls {key}")
        if key.startswith(("tok_emb", "lm_head")) and state[key].shape[0] < tensor.shape[0]:   # vocabulary padding
            state[key] = torch.cat((state[key], state[key].new_zeros(tensor.shape[0] - state[key].shape[0],
                                                                      *tensor.shape[1:])))
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ValueError(f"{path}: {key} has shape {tuple(state[key].shape)}, the metadata implies "
                             f"{tuple(tensor.shape)}")
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    model.rebuild_buffers()
    return model.eval()


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

def _architecture(config: ModelConfig) -> str:
    from logitlab.model.keymap import hf_architecture

    hf = hf_architecture(config)
    if hf == "MistralForCausalLM":
        raise ValueError("a sliding-window model has no GGUF architecture that keeps its window")
    by_class = {v: k for k, v in ARCHITECTURES.items()}
    if hf not in by_class:
        raise ValueError(f"a {hf} model has no GGUF architecture here (supported: {', '.join(ARCHITECTURES)})")
    return by_class[hf]


def _metadata(writer, arch: str, config: ModelConfig, qtype: str) -> None:
    gguf = _gguf()
    c = config
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.d_model)
    writer.add_block_count(c.n_layers)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_heads)
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"))
    if arch == "gpt2":
        writer.add_layer_norm_eps(c.norm_eps)
        return
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)


def _vocabulary(writer, V: int) -> None:
    """A placeholder SentencePiece-style vocabulary of V entries (unknown, begin, end, then the 256
    byte tokens, then numbered ones): llama.cpp needs one to load a file; ids are all it is used for."""
    gguf = _gguf()
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    tokens, types = tokens[:V], types[:V]
    tokens += [f"[{i}]" for i in range(len(tokens), V)]
    types += [T.NORMAL] * (V - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * V)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _encode(tensor: torch.Tensor, qtype: str):
    """(numpy array to write, its GGML type) for one tensor: matrices whose rows split into
    32-weight blocks in `qtype` (by reference.py's math for Q8_0 / Q4_0, which the gguf package's
    encoder matches), the others in float32 or float16."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    values = tensor.detach().float().cpu()
    if values.ndim == 1 or qtype == "F32":
        return values.numpy(), Q.F32
    if qtype in ("Q8_0", "Q4_0") and values.shape[1] % ref.GGUF_BLOCK:
        qtype = "F16"
    kind = getattr(Q, qtype)
    if qtype == "F16":
        return values.to(torch.float16).numpy(), kind
    return gguf.quants.quantize(values.numpy(), kind), kind


def save_gguf(model, path: str | os.PathLike, qtype: str = "F16", *, overwrite: bool = False) -> Path:
    """Write `model` (a dense logitlab Transformer) as a GGUF file llama.cpp loads: metadata, a
    placeholder vocabulary, and every matrix in `qtype` (F32, F16, BF16, Q8_0 or Q4_0; a matrix
    whose rows do not split into 32-weight blocks falls back to F16), norms and biases in F32.
    The file is written beside `path` and renamed into place; an existing file is replaced only
    with overwrite=True."""
    from logitlab.model.keymap import state_dict_to_hf
    from logitlab.quant.apply import quantization_of

    if qtype not in WRITE_TYPES:
        raise ValueError(f"GGUF tensor type must be one of {WRITE_TYPES}, got {qtype!r}")
    if quantization_of(model) is not None:
        raise ValueError("the model's weights are quantized already: write the dense model to GGUF")
    gguf, config, path = _gguf(), model.config, Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (overwrite=True replaces it)")
    arch = _architecture(config)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _metadata(writer, arch, config, qtype)
    _vocabulary(writer, config.vocab_size)
    for name, tensor in state_dict_to_hf(model.state_dict(), config).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _permute(tensor, config.n_heads if "q_proj" in name else config.n_kv_heads)
        if arch == "gpt2" and name.rpartition(".")[0].split(".", 3)[-1] in _GPT2_CONV1D and tensor.ndim == 2:
            tensor = tensor.t()                                                     # to (out, in)
        data, kind = _encode(tensor, qtype)
        writer.add_tensor(gguf_name(name, arch), data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path
