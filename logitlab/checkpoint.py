"""Model and run-checkpoint directories on disk: logitlab's own model directory, the run
checkpoints of training, loading a model for inference, exporting a run to Hugging Face.

checkpoint.py owns the run checkpoints (RUN/ckpt-NNNNNN/: model, optimizer, RNG, data position,
configs, tokenizer, metrics), finding the latest / best one, pruning old ones (renamed first,
then deleted, so no loader ever sees half of one), loading a model for inference from any of
these directories, and exporting a run to a Hugging Face directory with its tokenizer. Every
directory appears at once or not at all, and only where nothing we did not write is replaced
(files.atomic_directory). A checkpoint never holds NaN or inf weights (check_finite). The Hugging
Face weight/config conversion itself lives in hf.py (same rules)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from logitlab.files import DiskFullError, atomic_directory, atomic_write_text, fsync_dir, writing  # noqa: F401

# kept importable from here: atomic_directory moved to files.py with the other file primitives
_fsync_dir = fsync_dir


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
    from logitlab.files import read_json

    value = read_json(path, what)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object {{...}} at the top level, got {_shown(value)}")
    return value


def _shown(value) -> str:
    """A value read from JSON, as JSON, cut short."""
    import json

    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    from logitlab.model import ModelConfig

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


def open_safetensors(path) -> "SafetensorsFile":
    """A safetensors file open for reading tensors one at a time on the CPU: with pread(2) into
    fresh tensors where safetensors has that backend (no pages of the file stay mapped while
    others are read), memory-mapped otherwise (unmapped when closed). A file that is empty,
    truncated, has bytes past its data or a bad header is a ValueError naming it."""
    return SafetensorsFile(path)


class SafetensorsFile:
    """safetensors.safe_open (a context manager with keys(), get_slice(key).get_shape(),
    get_tensor(key), metadata()) whose errors name the file: ValueError "PATH: not a valid
    safetensors file (reason)" instead of a SafetensorError."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        try:
            try:
                self._file = safe_open(str(path), framework="pt", device="cpu", backend="pread")
            except TypeError:  # a safetensors release without the pread backend: memory-mapped
                self._file = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as exc:
            raise _invalid_safetensors(self.path, exc) from exc

    def __enter__(self) -> "SafetensorsFile":
        self._file.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._read(self._file.keys)

    def metadata(self) -> dict | None:
        return self._read(self._file.metadata)

    def get_slice(self, key: str):
        return self._read(self._file.get_slice, key)

    def get_tensor(self, key: str):
        return self._read(self._file.get_tensor, key)

    def _read(self, fn, *args):
        from safetensors import SafetensorError

        try:
            return fn(*args)
        except SafetensorError as exc:
            raise _invalid_safetensors(self.path, exc) from exc


def _invalid_safetensors(path: Path, exc: Exception) -> ValueError:
    reason = str(exc).removeprefix("Error while deserializing header: ")
    return ValueError(f"{path}: not a valid safetensors file ({reason}); it may be truncated or corrupt: "
                      "write or download it again")


def require_finite(path: str | os.PathLike, key: str, tensor) -> None:
    """ValueError naming the file and the key when the floating tensor `key` read from `path`
    holds NaN or inf: a model loaded with one computes NaN logits. One pass per tensor and no
    temporary as large as it: min and max propagate NaN, so both are finite exactly when every
    element is (isfinite(t).all() would allocate a mask per tensor, raising the peak of a load)."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    values = tensor if tensor.dtype.itemsize > 1 else tensor.to(torch.float16)  # fp8 has no aminmax
    lo, hi = torch.aminmax(values)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise ValueError(f"{path}: tensor {key} holds {int((~torch.isfinite(values)).sum())} NaN / inf values")


def load_model(directory: str | os.PathLike, device: str = "cpu", dtype=None):
    """Load a logitlab model directory written by save_model; keys and shapes are checked
    against the config (from the file's header, before any tensor is read) and a mismatch names
    the offending key. Tensors are read one at a time and cast to `dtype` / moved to `device`
    as they arrive, so the peak is the final model plus one tensor in flight. A directory written
    before q/k/v and gate/up became one projection each is read whole and upgraded first
    (upgrade_legacy_state). A floating tensor that holds NaN or inf is refused, naming its key."""
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
            require_finite(weights, key, tensor)
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
    """The checkpoint with the highest step, or None when the run has none. Incomplete
    `ckpt-*` directories (no state.json) are skipped with a warning naming them."""
    ckpts = list_checkpoints(run_dir)
    newest = ckpts[-1].name if ckpts else ""
    skipped = [p.name for p in incomplete_checkpoints(run_dir) if p.name > newest]
    if skipped:
        import warnings

        warnings.warn(f"{run_dir}: skipped incomplete checkpoint(s) {', '.join(skipped)} (no {STATE_FILE}; "
                      f"a save or a deletion was interrupted); using {ckpts[-1] if ckpts else 'none'}",
                      stacklevel=2)
    return ckpts[-1] if ckpts else None


def read_state(ckpt: str | os.PathLike) -> dict:
    path = Path(ckpt) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {STATE_FILE} in {ckpt}: not a run checkpoint")
    return read_json_object(path, "checkpoint state file")


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


    target = checkpoint_dir(run_dir, step)
    weights = model_state if model_state is not None else model.state_dict()
    check_finite(weights, f"the model at step {step}")   # a checkpoint never holds NaN or inf weights
    # a directory named ckpt-NNNNNN holding state.json is ours as a whole (a re-save of that step)
    mine = set(os.listdir(target)) if (target / STATE_FILE).is_file() else None
    with atomic_directory(target, "checkpoint", overwrite=True, legacy=mine, marker=False) as tmp:
        with writing(tmp / WEIGHTS_FILE):
            write_model_files(model, tmp, weights)
        if tokenizer is not None:
            with writing(tmp / TOKENIZER_FILE):
                tokenizer.save(tmp / TOKENIZER_FILE)
        if optimizer_state is None and optimizer is not None:
            optimizer_state = optimizer.state_dict()
        if optimizer_state is not None:
            _torch_save(optimizer_state, tmp / OPTIMIZER_FILE)
        if rng is not None:
            _torch_save(rng, tmp / RNG_FILE)
        if metrics is not None:
            with writing(tmp / METRICS_FILE):
                (tmp / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in metrics))
        payload = dict(state or {}, step=int(step))
        with writing(tmp / STATE_FILE):  # last: a directory with state.json is complete
            (tmp / STATE_FILE).write_text(json.dumps(payload, indent=2) + "\n")
    if keep_last is not None:
        prune_checkpoints(run_dir, keep_last)
    return target


def _torch_save(obj, path: Path) -> None:
    """torch.save into a file we open and close ourselves: on a write error (a full disk) torch's
    zip writer leaves the descriptor it opened behind, which would hold the deleted file's space
    until the process exits."""
    import torch

    with writing(path), open(path, "wb") as f:
        torch.save(obj, f)


def check_finite(state: dict, what: str) -> None:
    """Raise NonFiniteError naming the first tensors of `state` that hold NaN or inf."""
    import torch

    bad = []
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(f"{key} ({int((~torch.isfinite(tensor)).sum())} non-finite)")
    if bad:
        raise NonFiniteError(f"{what} holds NaN or inf values: {', '.join(bad[:3])}"
                             f"{f' and {len(bad) - 3} more tensors' if len(bad) > 3 else ''}; it was not saved")


class NonFiniteError(ValueError):
    """Weights that hold NaN or inf: never written as a checkpoint."""


_DELETED = ".del-"


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete what a killed process left of checkpoint writes and deletions: temporary and
    moved-aside copies (`.ckpt-*.tmp-*`, `.ckpt-*.old-*`), checkpoints renamed for deletion
    (`.ckpt-*.del-*`) and `ckpt-*` directories without state.json (incomplete: state.json is
    written last). Call only while holding the run's lock (files.RunLock)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    stale = [p for p in run_dir.glob(f".{CKPT_PREFIX}*")
             if p.is_dir() and any(tag in p.name for tag in (".tmp-", ".old-", _DELETED))]
    stale += incomplete_checkpoints(run_dir)
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def incomplete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """`ckpt-NNNNNN` directories without state.json: never loaded, and removed at a resume."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.is_dir() and re.fullmatch(rf"{CKPT_PREFIX}\d+", p.name)
                  and not (p / STATE_FILE).is_file())


def delete_checkpoint(ckpt: str | os.PathLike) -> None:
    """Remove a checkpoint: renamed first (one atomic step, after which no loader sees it), then
    deleted; a kill in between leaves a `.ckpt-*.del-*` that the next start removes."""
    ckpt = Path(ckpt)
    doomed = ckpt.parent / f".{ckpt.name}{_DELETED}{os.getpid()}-{time.monotonic_ns()}"
    os.replace(ckpt, doomed)
    fsync_dir(ckpt.parent)
    shutil.rmtree(doomed, ignore_errors=True)


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
        delete_checkpoint(p)
    return removed


def load_checkpoint(ckpt: str | os.PathLike, model=None, optimizer=None) -> dict:
    """Read a run checkpoint. Loads the weights into `model` in place (exact copies) and the
    optimizer state into `optimizer` when given. Returns {"state", "rng", "metrics", "path"}.
    Nothing is unpickled: safetensors, JSON and torch.load(weights_only=True)."""
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
        opt_state = load_optimizer_state(ckpt)
        try:
            optimizer.load_state_dict(opt_state)
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{ckpt / OPTIMIZER_FILE} does not match the optimizer: {exc}") from exc
    rng = load_torch_file(ckpt / RNG_FILE) if (ckpt / RNG_FILE).is_file() else None
    metrics = _read_jsonl(ckpt / METRICS_FILE) if (ckpt / METRICS_FILE).is_file() else []
    return {"state": state, "rng": rng, "metrics": metrics, "path": ckpt}


def _read_jsonl(path: Path) -> list:
    import json

    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {n} is not valid JSON ({exc.msg} at column {exc.colno})") from exc
    return records


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


def load_model_state(ckpt: str | os.PathLike) -> dict:
    """The checkpoint's weights as a state dict (CPU tensors; a tied head stored once), for an
    exact resume. A checkpoint from before the fused q/k/v and gate/up projections is refused by
    name: its optimizer state is laid out per separate projection, so it cannot resume exactly."""
    path = Path(ckpt) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {ckpt}")
    with open_safetensors(path) as f:
        state = {key: f.get_tensor(key) for key in f.keys()}
    if any(_LEGACY_KEY.search(key) for key in state):
        raise ValueError(f"{ckpt} was written before q/k/v and gate/up became one projection each: "
                         f"its optimizer state cannot resume this model exactly. Its weights still load "
                         f"(load_model / logitlab generate --checkpoint, export, or a new run from them).")
    return state


def load_optimizer_state(ckpt: str | os.PathLike) -> dict:
    """The checkpoint's optimizer state_dict (load_torch_file: tensors and plain containers only)."""
    path = Path(ckpt) / OPTIMIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {OPTIMIZER_FILE} in {ckpt}")
    return load_torch_file(path)


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


def export_hf(run_dir: str | os.PathLike, out_dir: str | os.PathLike, which: str = "latest", *,
              overwrite: bool = False) -> Path:
    """Model + tokenizer.json, tokenizer_config.json, special_tokens_map.json (hf.save_pretrained),
    so transformers' AutoModelForCausalLM and AutoTokenizer load the directory. `out_dir` must be
    new or empty (it may lie inside the run), or with overwrite=True an export logitlab wrote."""
    from logitlab import hf
    from logitlab.files import check_output_dir

    check_output_dir(out_dir, hf.HF_KIND, overwrite=overwrite, source=run_dir)  # before loading anything
    model, tokenizer = load_for_inference(run_dir, which)
    return hf.save_pretrained(model, out_dir, tokenizer, overwrite=overwrite, source=run_dir)
