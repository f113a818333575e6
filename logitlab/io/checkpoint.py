"""Run checkpoints on disk, and loading a model for inference from a run, a checkpoint or a model
directory.

checkpoint.py owns the run checkpoints (RUN/ckpt-NNNNNN/: model, optimizer, RNG, data position,
configs, tokenizer, metrics), finding the latest / best one, pruning old ones (renamed first,
then deleted, so no loader ever sees half of one), and resolving and loading a model for inference
from any of these directories. Every directory appears at once or not at all, and only where
nothing we did not write is replaced (files.atomic_directory). A checkpoint never holds NaN or inf
weights (check_finite). The model inside a checkpoint is logitlab's own model directory, written
and read by model_dir.py; exporting a run to Hugging Face is hf.py's (export_hf)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from logitlab.io.files import DiskFullError, atomic_directory, atomic_write_text, fsync_dir, writing  # noqa: F401
from logitlab.io.model_dir import (  # noqa: F401  model-directory names kept importable from here (model_dir.py)
    _LEGACY_KEY,
    CONFIG_FILE,
    MODEL_FORMAT,
    MODEL_KIND,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    SafetensorsFile,
    is_logitlab_dir,
    load_model,
    load_torch_file,
    model_dir_entries,
    open_safetensors,
    read_json_object,
    read_model_config,
    require_finite,
    save_model,
    upgrade_legacy_state,
    write_model_files,
)

# kept importable from here: atomic_directory moved to files.py with the other file primitives
_fsync_dir = fsync_dir


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
    """The checkpoint with the lowest validation loss (ties: the later one), or None. Only
    checkpoints of the latest one's model config compete: after a resume that extended the
    context, losses measured at the old length do not compare with those at the new one."""
    ckpts = list_checkpoints(run_dir)
    best, best_loss, shape = None, float("inf"), None
    for p in ckpts:
        loss = read_state(p).get("val_loss")
        if loss is None or loss > best_loss:
            continue
        shape = shape or read_model_config(ckpts[-1])
        if read_model_config(p) == shape:
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
    """Delete all but the newest `keep_last` checkpoints, the best by validation loss and those
    whose state.json says why they are "kept" (a WSD run's end of the stable phase); returns the
    deleted paths."""
    ckpts = list_checkpoints(run_dir)
    keep = set(ckpts[-keep_last:]) if keep_last > 0 else set()
    keep |= {p for p in ckpts if read_state(p).get("kept")}
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
                         f"(load_model / logitlab generate, export, or a new run from them).")
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
        if path.name.startswith("dcp-") or any(path.glob("dcp-*")):
            raise FileNotFoundError(f"{path} holds sharded (dcp-*) checkpoints, written by a tensor or pipeline "
                                    f"parallel run: turn one into a model directory first, `logitlab export "
                                    f"{path} --out DIR`, and read DIR (generate DIR)")
        raise FileNotFoundError(f"{path} holds no checkpoint (expected {CONFIG_FILE} or {CKPT_PREFIX}*/)")
    return ckpt


def load_for_inference(path: str | os.PathLike, which: str = "latest", device: str = "cpu", dtype=None,
                       max_memory=None, mmap: bool = True):
    """(model in eval mode, tokenizer or None) from a run dir, checkpoint dir or model dir;
    dtype None keeps the stored dtype, else each tensor is cast as it is read. A model whose weights
    need more than max_memory (default: what the machine has available) is refused before it is
    built (model_dir.load_model). mmap (default True): tensors kept as stored stay mapped from the
    file (hf.load_pretrained's mmap)."""
    directory = resolve_model_dir(path, which)
    model = load_model(directory, device=device, dtype=dtype, max_memory=max_memory, mmap=mmap).eval()
    tokenizer = None
    tok_file = directory / TOKENIZER_FILE
    if not tok_file.is_file() and (directory.parent / TOKENIZER_FILE).is_file():
        tok_file = directory.parent / TOKENIZER_FILE
    if tok_file.is_file():
        from logitlab.tokenizer.core import Tokenizer

        tokenizer = Tokenizer.load(tok_file)
    return model, tokenizer
