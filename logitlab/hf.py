"""Hugging Face model directories: import, export, and verification against `transformers`.

hf.py owns the files of a Hugging Face checkpoint: config.json plus model.safetensors, sharded
safetensors (model.safetensors.index.json), or legacy pytorch_model.bin (read with
torch.load(weights_only=True): no code is ever unpickled). Names and shapes are translated by the
pure functions of families.py; logitlab's own directories are handed to checkpoint.py. Writes are
atomic (checkpoint.atomic_directory). `transformers` is imported only by verification.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from logitlab import checkpoint, families
from logitlab.model import ModelConfig, Transformer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"

# Largest |ours - transformers|, relative to max(1, max |transformers|), that verification accepts.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 1e-2}

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}") from None


def read_hf_config(directory: str | os.PathLike) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc


def read_hf_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory, whichever of the four layouts it uses (CPU)."""
    from safetensors.torch import load_file

    d = Path(directory)
    if (d / SAFETENSORS).is_file():
        return load_file(str(d / SAFETENSORS), device="cpu")
    for index_name, load in ((SAFETENSORS_INDEX, lambda p: load_file(str(p), device="cpu")),
                             (TORCH_BIN_INDEX, _load_bin)):
        if (d / index_name).is_file():
            weight_map = json.loads((d / index_name).read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{d / index_name} has no weight_map")
            state = {}
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    raise FileNotFoundError(f"shard {shard} named in {d / index_name} is missing")
                state.update(load(d / shard))
            missing = sorted(set(weight_map) - set(state))
            if missing:
                raise ValueError(f"{d / index_name} lists tensors its shards lack: {missing[:5]}")
            return state
    if (d / TORCH_BIN).is_file():
        return torch.load(d / TORCH_BIN, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {d}: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                            f"{TORCH_BIN} or {TORCH_BIN_INDEX}")


def _load_bin(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)   # tensors only, no code


def _name_first(keys: list[str]) -> str:
    more = f" (and {len(keys) - 1} more: {keys[1:4]})" if len(keys) > 1 else ""
    return f"{keys[0]!r}{more}"


def check_hf_state(hf_state: dict, config: ModelConfig, source: str = "checkpoint") -> None:
    """Refuse a checkpoint whose tensor names or shapes disagree with `config`, naming the key."""
    with torch.device("meta"):
        expected = families.state_dict_to_hf(Transformer(config).state_dict(), config)
    got = families.clean_hf_state(hf_state, config)
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        raise ValueError(f"{source}: missing tensor {_name_first(missing)} that config.json requires")
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {_name_first(unexpected)} for this config.json")
    for key, ref in expected.items():
        if tuple(got[key].shape) != tuple(ref.shape):
            raise ValueError(f"{source}: tensor {key!r} has shape {tuple(got[key].shape)}, "
                             f"config.json implies {tuple(ref.shape)}")


def model_from_hf_state(hf_state: dict, config: ModelConfig, source: str = "checkpoint") -> Transformer:
    """A Transformer holding the (checked, renamed) Hugging Face tensors, no copy beyond the renames."""
    check_hf_state(hf_state, config, source)
    state = families.state_dict_from_hf(hf_state, config)
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.rebuild_buffers()
    return model


def load_pretrained(directory: str | os.PathLike, verify: bool = False, dtype=None,
                    device: str | torch.device = "cpu") -> Transformer:
    """Load a Hugging Face directory (families.SUPPORTED_ARCHITECTURES) or a logitlab one.

    dtype None keeps the stored dtype. verify=True runs `verify_against_transformers` on the
    directory and raises ValueError when any hidden state or the logits differ beyond TOLERANCE."""
    directory = Path(directory)
    dtype = parse_dtype(dtype)
    if checkpoint.is_logitlab_dir(directory):
        model = checkpoint.load_model(directory, device=device, dtype=dtype)
    else:
        config = families.config_from_hf(read_hf_config(directory))
        model = model_from_hf_state(read_hf_weights(directory), config, source=str(directory))
        model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    model.eval()
    if verify:
        native = checkpoint.is_logitlab_dir(directory)   # then compare with its own HF export
        report = verify_against_transformers(model, None if native else directory)
        if not report["ok"]:
            raise ValueError(f"{directory}: logitlab disagrees with transformers: {format_report(report)}")
    return model


def _unwrap(model):
    model = getattr(model, "_orig_mod", model)    # torch.compile
    return getattr(model, "module", model)         # DDP / FSDP wrappers


def write_hf_files(model, directory: str | os.PathLike, tokenizer=None) -> None:
    """Write config.json + model.safetensors of `model` into an existing directory, and with a
    tokenizer its tokenizer.json, tokenizer_config.json and special_tokens_map.json (what
    AutoTokenizer reads); save_pretrained is the atomic entry point."""
    from safetensors.torch import save_file

    model = _unwrap(model)
    config: ModelConfig = model.config
    dtype = next(model.parameters()).dtype
    hf_config = families.config_to_hf(config, dtype=str(dtype).removeprefix("torch."))
    if tokenizer is not None and tokenizer.eot_id is not None:
        # else transformers falls back to its class defaults (GPT-2: 50256, Llama: 1 and 2), ids
        # that are another token here or lie outside a small vocabulary, so generate never stops
        hf_config.update(bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
    state = families.state_dict_to_hf(model.state_dict(), config)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    directory = Path(directory)
    save_file(state, str(directory / SAFETENSORS), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_hf(directory / "tokenizer.json")
        special, eot = {}, "<|endoftext|>"
        if tokenizer.eot_id is not None:
            special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
        (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.context_length,
                   "clean_up_tokenization_spaces": False, "add_bos_token": False, **special}
        (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def save_pretrained(model, directory: str | os.PathLike, tokenizer=None) -> Path:
    """Atomically write config.json + model.safetensors that transformers.AutoModelForCausalLM
    loads as the matching class (families.hf_architecture). A tied head is stored once, as the
    embedding, as Hugging Face expects. A logitlab Tokenizer, when given, goes in as tokenizer.json
    with the two files AutoTokenizer also reads (write_hf_files)."""
    with checkpoint.atomic_directory(directory) as tmp:
        write_hf_files(model, tmp, tokenizer)
    return Path(directory)


def _load_transformers_model(directory, dtype: torch.dtype):
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError("verifying against transformers needs the `transformers` package "
                           "(pip install transformers)") from exc
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), attn_implementation="eager", **{key: dtype}).eval()


@torch.no_grad()
def verify_against_transformers(model: Transformer, hf_dir_or_model=None,
                                ids: torch.Tensor | None = None) -> dict:
    """Run `model` and the transformers model on the same ids and compare.

    hf_dir_or_model: a Hugging Face directory, a transformers model, or None (export `model` to a
    temporary directory and load that). ids default: 2 x 16 seeded random ids.
    -> {"hidden": [max |diff| of hidden state i, i = 0..L], "logits": max |diff|, "scale":
        max |logits|, "tolerance", "ok", "dtype"} (hidden[L] has the final norm applied)."""
    import tempfile

    model = _unwrap(model).eval()
    param = next(model.parameters())
    cfg = model.config
    if ids is None:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.context_length)), generator=gen)
    ids = ids.to(param.device)
    with tempfile.TemporaryDirectory() as tmp:
        if hf_dir_or_model is None:
            save_pretrained(model, Path(tmp) / "hf")
            hf_dir_or_model = Path(tmp) / "hf"
        hf_model = (hf_dir_or_model if isinstance(hf_dir_or_model, torch.nn.Module)
                    else _load_transformers_model(hf_dir_or_model, param.dtype))
        hf_model = hf_model.to(param.device)
        ref = hf_model(input_ids=ids, output_hidden_states=True)
    logits, hidden = model.forward_with_hidden(ids)
    if len(hidden) != len(ref.hidden_states):
        raise ValueError(f"logitlab returns {len(hidden)} hidden states, "
                         f"transformers {len(ref.hidden_states)}")
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(hidden, ref.hidden_states)]
    ref_logits = ref.logits[..., :cfg.vocab_size].float()
    logit_diff = float((logits.float() - ref_logits).abs().max())
    scale = max(1.0, float(ref_logits.abs().max()))
    tol = TOLERANCE.get(param.dtype, 1e-4)
    ok = all(d <= tol * max(1.0, float(h.float().abs().max())) for d, h in zip(diffs, ref.hidden_states))
    ok = ok and logit_diff <= tol * scale
    return {"hidden": diffs, "logits": logit_diff, "scale": scale, "tolerance": tol, "ok": ok,
            "dtype": str(param.dtype).removeprefix("torch."), "ids_shape": tuple(ids.shape)}


def format_report(report: dict) -> str:
    layers = ", ".join(f"{i}: {d:.2e}" for i, d in enumerate(report["hidden"]))
    return f"max |diff| per hidden state {{{layers}}}; logits {report['logits']:.2e}"
