"""Checkpoint directories on disk: atomic writes, logitlab's own model directory, run checkpoints.

checkpoint.py owns how a directory appears on disk all at once or not at all: everything is
written into a temporary sibling directory, flushed, then renamed into place, so a kill at any
instant leaves either the previous checkpoint or the new one, never half of one. It also owns
the run checkpoints of training (RUN/ckpt-NNNNNN/: model, optimizer, RNG, data position,
configs, tokenizer, metrics), finding the latest / best one, loading a model for inference from
any of these directories, and exporting a run to a Hugging Face directory with its tokenizer.
The Hugging Face weight/config conversion itself lives in hf.py (same atomic rule).
"""

from __future__ import annotations

import contextlib
import os
import re
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
            # Named after the unique temporary directory, so concurrent writers (threads of one
            # process included) never move their old copies to the same place.
            old = target.parent / tmp.name.replace(".tmp-", ".old-", 1)
            if old.exists():
                shutil.rmtree(old)
            os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException:
            if old is not None:  # put the previous directory back: target stays untouched
                os.replace(old, target)
            raise
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def write_model_files(model, directory: str | os.PathLike, state: dict | None = None) -> None:
    """Write config.json + model.safetensors of `model` (unwrapped) into an existing directory.

    `state` replaces model.state_dict() (a full state gathered from sharded ranks). Callers that
    want atomicity write into `atomic_directory(...)`."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    state = model.state_dict() if state is None else state
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
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


def open_safetensors(path):
    """safetensors.safe_open for reading tensors one at a time on the CPU: with pread(2) into
    fresh tensors where safetensors has that backend (no pages of the file stay mapped while
    others are read), memory-mapped otherwise (unmapped when closed)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu", backend="pread")
    except TypeError:
        return safe_open(str(path), framework="pt", device="cpu")


def load_model(directory: str | os.PathLike, device: str = "cpu", dtype=None):
    """Load a logitlab model directory written by save_model; keys and shapes are checked
    against the config (from the file's header, before any tensor is read) and a mismatch names
    the offending key. Tensors are read one at a time and cast to `dtype` / moved to `device`
    as they arrive, so the peak is the final model plus one tensor in flight. A directory written
    before q/k/v and gate/up became one projection each is read whole and upgraded first
    (upgrade_legacy_state)."""
    import torch

    from logitlab.model import Transformer

    directory = Path(directory)
    config = read_model_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
    with torch.device("meta"):
        model = Transformer(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    with open_safetensors(weights) as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        legacy = None
        if any(_LEGACY_KEY.search(key) for key in shapes):  # written before the fused projections
            legacy = upgrade_legacy_state({key: f.get_tensor(key) for key in shapes})
            shapes = {key: tuple(t.shape) for key, t in legacy.items()}
        missing = sorted(set(expected) - set(shapes))
        unexpected = sorted(set(shapes) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{weights}: keys disagree with {directory / CONFIG_FILE}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        for key, tensor in expected.items():
            if shapes[key] != tuple(tensor.shape):
                raise ValueError(f"{weights}: {key} has shape {shapes[key]}, "
                                 f"config expects {tuple(tensor.shape)}")
        state = {}
        for key in expected:  # each tensor cast as it arrives: only the final model is kept
            tensor = legacy.pop(key) if legacy is not None else f.get_tensor(key)
            state[key] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            del tensor
        model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.tie_weights()
    model.rebuild_buffers()
    return model


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


# --------------------------------------------------------------------------------------------
# Run checkpoints: RUN/ckpt-000500/ holds everything needed to continue a run exactly:
#   config.json + model.safetensors   the model (write_model_files: load_model / HF export work)
#   tokenizer.logitlab.json           the tokenizer, when the run has one
#   optimizer.pt                      optimizer state_dict (torch.save; loaded weights_only=True)
#   rng.pt                            every generator's state (runtime.capture_rng_state)
#   state.json                        step, data sampler position, schedule, configs, val loss
#   metrics.jsonl                     the run's metrics up to this step
# Each directory appears atomically; after a save the oldest are pruned, keeping the last K
# and the best by validation loss.
# --------------------------------------------------------------------------------------------

CKPT_PREFIX = "ckpt-"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f"{CKPT_PREFIX}{step:06d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories of a run, oldest step first (temporary ones ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        if p.is_dir() and p.name.startswith(CKPT_PREFIX) and (p / STATE_FILE).is_file():
            try:
                found.append((int(p.name[len(CKPT_PREFIX):]), p))
            except ValueError:
                continue
    return [p for _step, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step, or None when the run has none."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def read_state(ckpt: str | os.PathLike) -> dict:
    import json

    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {STATE_FILE} in {ckpt}: not a run checkpoint")
    return json.loads(path.read_text())


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the lowest validation loss (ties: the later one), or None."""
    best, best_loss = None, float("inf")
    for p in list_checkpoints(run_dir):
        loss = read_state(p).get("val_loss")
        if loss is not None and loss <= best_loss:
            best, best_loss = p, loss
    return best


def save_checkpoint(run_dir: str | os.PathLike, step: int, model, optimizer=None, *,
                    state: dict | None = None, rng: dict | None = None, tokenizer=None,
                    metrics: list[dict] | None = None, keep_last: int | None = 3,
                    model_state: dict | None = None, optimizer_state: dict | None = None) -> Path:
    """Atomically write RUN/ckpt-{step:06d}/ (see the layout above) and prune old checkpoints.

    `model` is the unwrapped module; `state` is JSON-ready (step is added); `rng` comes from
    runtime.capture_rng_state(); `metrics` is the list of metric records so far. `model_state` /
    `optimizer_state` replace model.state_dict() / optimizer.state_dict() (full states gathered
    from several ranks)."""
    import json

    import torch

    target = checkpoint_dir(run_dir, step)
    with atomic_directory(target) as tmp:
        write_model_files(model, tmp, model_state)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        if optimizer_state is None and optimizer is not None:
            optimizer_state = optimizer.state_dict()
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        if rng is not None:
            torch.save(rng, tmp / RNG_FILE)
        payload = dict(state or {}, step=int(step))
        (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2) + "\n")
        if metrics is not None:
            (tmp / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if keep_last is not None:
        prune_checkpoints(run_dir, keep_last)
    return target


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete half-written checkpoint directories (`.ckpt-*.tmp-*`, `.ckpt-*.old-*`) that a killed
    process left behind; call only when no other process writes into run_dir."""
    run_dir = Path(run_dir)
    stale = [p for p in run_dir.glob(f".{CKPT_PREFIX}*") if p.is_dir() and (".tmp-" in p.name or ".old-" in p.name)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints and the best by validation loss;
    returns the deleted paths."""
    ckpts = list_checkpoints(run_dir)
    keep = set(ckpts[-keep_last:]) if keep_last > 0 else set()
    best = best_checkpoint(run_dir)
    if best is not None:
        keep.add(best)
    removed = [p for p in ckpts if p not in keep]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def load_checkpoint(ckpt: str | os.PathLike, model=None, optimizer=None) -> dict:
    """Read a run checkpoint. Loads the weights into `model` in place (exact copies) and the
    optimizer state into `optimizer` when given. Returns {"state", "rng", "metrics", "path"}.
    Nothing is unpickled: safetensors, JSON and torch.load(weights_only=True)."""
    import json

    import torch

    ckpt = Path(ckpt)
    state = read_state(ckpt)
    if model is not None:
        weights = load_model_state(ckpt)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if model.config.tie_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"{ckpt / WEIGHTS_FILE} does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    if optimizer is not None:
        optimizer.load_state_dict(load_optimizer_state(ckpt))
    rng = torch.load(ckpt / RNG_FILE, weights_only=True) if (ckpt / RNG_FILE).is_file() else None
    metrics = []
    if (ckpt / METRICS_FILE).is_file():
        metrics = [json.loads(line) for line in (ckpt / METRICS_FILE).read_text().splitlines() if line]
    return {"state": state, "rng": rng, "metrics": metrics, "path": ckpt}


def load_model_state(ckpt: str | os.PathLike) -> dict:
    """The checkpoint's weights as a state dict (CPU tensors; a tied head stored once), for an
    exact resume. A checkpoint from before the fused q/k/v and gate/up projections is refused by
    name: its optimizer state is laid out per separate projection, so it cannot resume exactly."""
    from safetensors.torch import load_file

    state = load_file(str(Path(ckpt) / WEIGHTS_FILE), device="cpu")
    if any(_LEGACY_KEY.search(key) for key in state):
        raise ValueError(f"{ckpt} was written before q/k/v and gate/up became one projection each: "
                         f"its optimizer state cannot resume this model exactly. Its weights still load "
                         f"(load_model / logitlab generate --checkpoint, export, or a new run from them).")
    return state


def load_optimizer_state(ckpt: str | os.PathLike) -> dict:
    """The checkpoint's optimizer state_dict (torch.load with weights_only=True)."""
    import torch

    path = Path(ckpt) / OPTIMIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {OPTIMIZER_FILE} in {ckpt}")
    return torch.load(path, map_location="cpu", weights_only=True)


def resolve_model_dir(path: str | os.PathLike, which: str = "latest") -> Path:
    """A model directory from a checkpoint dir, a logitlab model dir, or a run dir (its latest
    or best checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such run or checkpoint directory: {path}")
    if is_logitlab_dir(path):
        return path
    if which not in ("latest", "best"):
        raise ValueError(f"which must be 'latest' or 'best', got {which!r}")
    ckpt = best_checkpoint(path) if which == "best" else latest_checkpoint(path)
    if ckpt is None and which == "best":
        ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path} holds no checkpoint (expected {CONFIG_FILE} or {CKPT_PREFIX}*/)")
    return ckpt


def load_for_inference(path: str | os.PathLike, which: str = "latest", device: str = "cpu", dtype=None):
    """(model in eval mode, tokenizer or None) from a run dir, checkpoint dir or model dir;
    dtype None keeps the stored dtype, else each tensor is cast as it is read."""
    directory = resolve_model_dir(path, which)
    model = load_model(directory, device=device, dtype=dtype).eval()
    tokenizer = None
    tok_file = directory / TOKENIZER_FILE
    if not tok_file.is_file() and (directory.parent / TOKENIZER_FILE).is_file():
        tok_file = directory.parent / TOKENIZER_FILE
    if tok_file.is_file():
        from logitlab.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(tok_file)
    return model, tokenizer


def export_hf(run_dir: str | os.PathLike, out_dir: str | os.PathLike, which: str = "latest") -> Path:
    """Model + tokenizer.json, tokenizer_config.json, special_tokens_map.json (hf.save_pretrained),
    so transformers' AutoModelForCausalLM and AutoTokenizer load the directory."""
    from logitlab import hf

    model, tokenizer = load_for_inference(run_dir, which)
    return hf.save_pretrained(model, out_dir, tokenizer)
