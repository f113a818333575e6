"""logitlab's own model directory: config.json {"format": "logitlab", "model": {...}} plus
model.safetensors with logitlab's state-dict keys (see model/transformer.py), and the tokenizer
beside them (tokenizer.logitlab.json). A tied LM head is stored once, as tok_emb.weight.

model_dir.py owns writing such a directory (save_model: it appears at once or not at all, and only
where nothing we did not write is replaced: files.atomic_directory), reading its config, and
loading the model tensor by tensor with its layer count, memory, keys and shapes checked first and
NaN / inf refused (check_layers, memory.check_fits; reading safetensors is tensors.py's, whose
names are importable from here); torch files opened so that their errors name the file, and no
pickled code ever runs (load_torch_file); directories from before the fused q/k/v and gate/up
projections upgraded on load (upgrade_legacy_state). Run checkpoints, which hold such a model
directory, are checkpoint.py's; Hugging Face directories are hf.py's."""

from __future__ import annotations

import os
import re
from pathlib import Path

from logitlab.io.files import atomic_directory
from logitlab.io.tensors import (  # noqa: F401  (importable from here, as before)
    FiniteChecks,
    SafetensorsFile,
    cast_read,
    open_safetensors,
    read_header,
    read_tensor,
    require_finite,
)
from logitlab.model.keymap import check_layers  # noqa: F401  (importable from here)

MODEL_FORMAT = "logitlab"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.logitlab.json"


def is_logitlab_dir(path: str | os.PathLike) -> bool:
    """True when path/config.json is a logitlab model config ("format": "logitlab"); False when
    there is none or it is another's (a Hugging Face config). A config.json that is not a JSON
    object is a ValueError naming the file (with the line and column of a syntax error)."""
    cfg = Path(path) / CONFIG_FILE
    if not cfg.is_file():
        return False
    return read_json_object(cfg, "config file").get("format") == MODEL_FORMAT


def read_json_object(path: str | os.PathLike, what: str = "JSON file") -> dict:
    """The JSON object in `path` (files.read_json); ValueError naming the file when it is not
    valid JSON (line and column) or holds something other than an object at the top level."""
    from logitlab.io.files import read_json

    value = read_json(path, what)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object {{...}} at the top level, got {_shown(value)}")
    return value


def _shown(value) -> str:
    """A value read from JSON, as JSON, cut short."""
    import json

    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def write_model_files(model, directory: str | os.PathLike, state: dict | None = None,
                      source: dict | None = None) -> None:
    """Write config.json + model.safetensors of `model` (unwrapped) into an existing directory.

    `state` replaces model.state_dict() (a full state gathered from sharded ranks). `source`, where
    the weights came from (hub.Resolved.provenance(): a hub id with its revision and commit), is
    kept in config.json under "source" (read_source). Callers that want atomicity write into
    `atomic_directory(...)`."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    state = model.state_dict() if state is None else state
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": MODEL_FORMAT})
    payload = {"format": MODEL_FORMAT, "model": model.config.to_dict()}
    quantization = quantization_of(model)
    if quantization is not None:           # the layers' int8 / int4 tensors are in the state dict
        payload["quantization"] = quantization.to_dict()
    if source is not None:
        payload["source"] = source
    (directory / CONFIG_FILE).write_text(json.dumps(payload, indent=2) + "\n")


MODEL_KIND = "logitlab model"
_MODEL_FILES = {"config.json", "model.safetensors", "tokenizer.logitlab.json"}


def model_dir_entries(directory: str | os.PathLike) -> set[str] | None:
    """A logitlab model directory from before output markers (config.json with our format and
    nothing but our files) counts as ours: its entries; otherwise None."""
    directory = Path(directory)
    if not directory.is_dir() or not is_logitlab_dir(directory):
        return None
    present = set(os.listdir(directory))
    return present if present <= _MODEL_FILES else None


def save_model(model, directory: str | os.PathLike, *, overwrite: bool = False,
               source: str | os.PathLike | None = None) -> Path:
    """Atomically write a logitlab model directory (config.json + model.safetensors).

    `directory` must be new or empty, or (with overwrite=True) a model directory logitlab wrote;
    files there that logitlab did not write are kept (files.atomic_directory)."""
    with atomic_directory(directory, MODEL_KIND, overwrite=overwrite, source=source,
                          legacy=model_dir_entries(directory)) as tmp:
        write_model_files(model, tmp)
    return Path(directory)


def read_model_config(directory: str | os.PathLike):
    """The ModelConfig of a logitlab model directory; anything wrong with its config.json (not
    JSON, another format, a field of the wrong type or out of range) is a ValueError naming it."""
    from logitlab.model.transformer import ModelConfig

    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}")
    payload = read_json_object(path, "config file")
    if payload.get("format") != MODEL_FORMAT or "model" not in payload:
        raise ValueError(f"{path} is not a logitlab model config (expected \"format\": \"{MODEL_FORMAT}\")")
    if not isinstance(payload["model"], dict):
        raise ValueError(f'{path}: "model" must be an object of ModelConfig fields, got {_shown(payload["model"])}')
    try:
        return ModelConfig.from_dict(payload["model"])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def quantization_of(model):
    """The QuantConfig a quantized model was quantized with (quant.apply), or None."""
    from logitlab.quant.apply import quantization_of as of

    return of(model)


def read_quantization(directory: str | os.PathLike):
    """The QuantConfig of a logitlab model directory whose weights are quantized (config.json's
    "quantization"), or None; a malformed one is a ValueError naming the file."""
    path = Path(directory) / CONFIG_FILE
    data = read_json_object(path, "config file").get("quantization")
    if data is None:
        return None
    from logitlab.quant.linear import QuantConfig

    try:
        return QuantConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: \"quantization\": {exc}") from exc


def load_model(directory: str | os.PathLike, device: str = "cpu", dtype=None, max_memory=None, mmap: bool = True):
    """Load a logitlab model directory written by save_model. Before anything is built, the
    config's layer count is checked against the blocks the weights hold and the weights' memory in
    the dtype asked for against `max_memory` (default: what the machine has available; see
    memory.check_fits); keys and shapes are then checked against the config (from the file's header,
    before any tensor is read) and a mismatch names the offending key. Tensors are read one at a
    time and cast to `dtype` (a large one in slices of rows) / moved to `device` as they arrive, so
    the peak is the final model plus one tensor in flight. A directory written before q/k/v and
    gate/up became one projection each is read whole and upgraded first (upgrade_legacy_state).
    A floating tensor that holds NaN or inf is refused, naming its key. A quantized directory
    (read_quantization) is built with its quantized layers, whose tensors keep their stored dtypes.
    mmap=True (the default): a tensor that needs no cast stays a private mapping of the file, and one
    cast is cast from a mapping a slice at a time (hf.load_pretrained's `mmap` says what that means
    and costs); mmap=False reads every tensor into memory the model owns."""
    import torch

    directory = Path(directory)
    config = read_model_config(directory)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
    header = read_header(path)
    model, expected, kept = _build_checked(directory, config, header, dtype, device, max_memory)
    state = {}
    # a forward pass reads only some rows of a lookup table (not of a tied one, the head too): the
    # pages its NaN check read go again
    tables = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    tables -= {"tok_emb.weight"} if config.tie_embeddings else set()
    with open_safetensors(path) as f, FiniteChecks() as finite:
        shapes, legacy = {key: shape for key, (shape, _) in header.items()}, None
        if any(_LEGACY_KEY.search(key) for key in shapes):  # written before the fused projections
            legacy = upgrade_legacy_state({key: f.get_tensor(key) for key in shapes})
            shapes = {key: tuple(t.shape) for key, t in legacy.items()}
        _check_keys(path, directory, expected, shapes)
        for key in expected:  # each tensor cast as it arrives: only the final model is kept
            cast = dtype if key not in kept else None    # quantized tensors keep their stored dtypes
            tensor = (cast_read(path, key, legacy.pop(key), True, cast) if legacy is not None
                      else read_tensor(f, path, key, *header[key], finite=finite, dtype=cast, mapped=mmap,
                                       let_go=key in tables))
            state[key] = tensor.to(device=device)
            del tensor
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.tie_weights()
    model.rebuild_buffers()
    return model


_BLOCK = re.compile(r"blocks\.(\d+)\.")


def _build_checked(directory: Path, config, header: dict, dtype, device, max_memory):
    """The model of `directory` built on the meta device once the checks that need no model have
    passed (the layer count against the header's blocks, the memory estimate) -> (model, its
    expected state dict without a tied head's copy, the keys of quantized tensors). A quantized
    model's memory is counted from its layers' own tensors (int8 / int4 values, bf16 scales), not
    from the dense weights the config's numbers describe."""
    import torch

    from logitlab.model import memory
    from logitlab.model.transformer import Transformer

    path = directory / WEIGHTS_FILE
    check_layers({int(m.group(1)) for m in map(_BLOCK.match, header) if m}, config.n_layers, "n_layers",
                 directory / CONFIG_FILE, path)
    target = dtype or max((d for _, d in header.values() if d.is_floating_point), key=lambda d: d.itemsize,
                          default=torch.float32)
    fits = dict(dtype=str(target).removeprefix("torch."), source=str(directory / CONFIG_FILE),
                max_memory=max_memory, device=device)
    quantization = read_quantization(directory)
    if quantization is None:
        memory.check_fits(config, target.itemsize, **fits)
    with torch.device("meta"):
        model = Transformer(config)
    kept = set()
    if quantization is not None:
        from logitlab.quant.apply import quantized_layout

        kept = {f"{name}.{leaf}" for name in quantized_layout(model, quantization) for leaf in ("qweight", "scales")}
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    if quantization is not None:
        need = sum(t.numel() * (target.itemsize if t.is_floating_point() and key not in kept else t.element_size())
                   for key, t in expected.items())
        memory.check_fits(config, target.itemsize, need=need, **fits)
    return model, expected, kept


def _check_keys(path: Path, directory: Path, expected: dict, shapes: dict) -> None:
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path}: keys disagree with {directory / CONFIG_FILE}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, tensor in expected.items():
        if shapes[key] != tuple(tensor.shape):
            raise ValueError(f"{path}: {key} has shape {shapes[key]}, config expects {tuple(tensor.shape)}")


def upgrade_legacy_state(state: dict) -> dict:
    """A logitlab state dict written before q/k/v and gate/up became one projection each, with
    its separate blocks.{i}.attn.{q,k,v}_proj and blocks.{i}.mlp.{gate,up}_proj tensors joined
    into the rows of attn.qkv_proj (q, k, v) and mlp.gate_up_proj (gate, up). Called explicitly
    where such directories are read (load_model); other keys pass through unchanged. A group with
    a part missing is left as it is, so the key check that follows names it."""
    import torch

    out = dict(state)
    for key in list(state):
        for fused, parts in _LEGACY_GROUPS:
            module, part, leaf = _legacy_parts(key, parts)
            if part != parts[0]:
                continue
            keys = [f"{module}.{p}.{leaf}" for p in parts]
            if all(k in out for k in keys):
                out[f"{module}.{fused}.{leaf}"] = torch.cat([out.pop(k) for k in keys], dim=0)
    return out


def _legacy_parts(key: str, parts: tuple[str, ...]) -> tuple[str, str | None, str]:
    """'blocks.0.attn.k_proj.weight' -> ('blocks.0.attn', 'k_proj', 'weight') when k_proj is in parts."""
    module, _, leaf = key.rpartition(".")
    module, _, part = module.rpartition(".")
    return module, (part if part in parts else None), leaf


_LEGACY_GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


# Keys of separate q/k/v and gate/up projections (state dicts from before they were fused).
_LEGACY_KEY = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj)\.(weight|bias)$")  # GELU keeps up_proj


def load_torch_file(path: str | os.PathLike, mmap: bool = False):
    """torch.load(weights_only=True) onto the CPU: tensors and plain containers only, so no code in
    the file ever runs. A pickle that would call code is refused with a ValueError naming the file
    (and what it calls); a file that is empty, truncated or not torch's is a ValueError naming it."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found:
            raise ValueError(f"refusing to unpickle code in {path} (only tensors and plain containers are "
                             f"loaded; it calls {found.group(1)})") from exc
        raise ValueError(f"{path}: not a readable torch file ({_torch_reason(exc)})") from exc
    except (RuntimeError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable torch file ({_torch_reason(exc)}); it may be truncated "
                         "or corrupt") from exc


def _torch_reason(exc: Exception) -> str:
    """One line of torch.load's many: the unpickler's complaint, or the first sentence."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for here, after in zip(lines, lines[1:]):
        if here.endswith("WeightsUnpickler error:"):
            return after
    return lines[0].split(". ")[0] if lines else f"{type(exc).__name__}: the file ends early"
