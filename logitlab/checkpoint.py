"""Checkpoint directories on disk: atomic writes, logitlab's own checkpoint layout.

checkpoint.py owns how a directory appears on disk all at once or not at all: everything is
written into a temporary sibling directory, flushed, then renamed into place, so a kill at any
instant leaves either the previous checkpoint or the new one, never half of one. Hugging Face
directory import/export lives in hf.py (same atomic rule, via `atomic_directory`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success rename it to `target`.

    On any exception the temporary directory is removed and `target` is untouched. When
    `target` exists and `overwrite` is true, it is moved aside first and deleted only after
    the new directory is in place."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb+") as f:
                    os.fsync(f.fileno())
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a single file atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


# --------------------------------------------------------------------------------------------
# logitlab's own model directory: config.json {"format": "logitlab", "model": {...}} +
# model.safetensors with logitlab's state-dict keys (see model.py). A tied LM head is stored
# once, as tok_emb.weight.
# --------------------------------------------------------------------------------------------

MODEL_FORMAT = "logitlab"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.logitlab.json"


def is_logitlab_dir(path: str | os.PathLike) -> bool:
    import json

    cfg = Path(path) / CONFIG_FILE
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("format") == MODEL_FORMAT
    except (ValueError, AttributeError):
        return False


def write_model_files(model, directory: str | os.PathLike) -> None:
    """Write config.json + model.safetensors of `model` (unwrapped) into an existing directory.

    Callers that want atomicity write into `atomic_directory(...)`."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": MODEL_FORMAT})
    payload = {"format": MODEL_FORMAT, "model": model.config.to_dict()}
    (directory / CONFIG_FILE).write_text(json.dumps(payload, indent=2) + "\n")


def save_model(model, directory: str | os.PathLike) -> Path:
    """Atomically write a logitlab model directory (config.json + model.safetensors)."""
    with atomic_directory(directory) as tmp:
        write_model_files(model, tmp)
    return Path(directory)


def read_model_config(directory: str | os.PathLike):
    import json

    from logitlab.model import ModelConfig

    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}")
    try:
        payload = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if payload.get("format") != MODEL_FORMAT or "model" not in payload:
        raise ValueError(f"{path} is not a logitlab model config (expected \"format\": \"{MODEL_FORMAT}\")")
    return ModelConfig.from_dict(payload["model"])


def load_model(directory: str | os.PathLike, device: str = "cpu", dtype=None):
    """Load a logitlab model directory written by save_model; keys and shapes are checked
    against the config and a mismatch names the offending key."""
    import torch
    from safetensors.torch import load_file

    from logitlab.model import Transformer

    directory = Path(directory)
    config = read_model_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
    state = load_file(str(weights), device="cpu")
    with torch.device("meta"):
        model = Transformer(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights}: keys disagree with {directory / CONFIG_FILE}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ValueError(f"{weights}: {key} has shape {tuple(state[key].shape)}, "
                             f"config expects {tuple(tensor.shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.tie_weights()
    model.rebuild_buffers()
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
