"""Sharded checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own
shards of the weights and optimizer state, nothing is gathered to one rank, and the checkpoint
loads into any other layout (TP x DP into DP, a pipeline into one process...), because DCP
stores each tensor by name with the offsets of its shards and reads back whatever pieces a
rank's new shards need.

A checkpoint directory holds DCP's files (.metadata and one __N_M.distcp per writing rank)
and `logitlab_dcp.json` (format, step, the model config, the layout that wrote it, the
caller's JSON state). It appears at once: every rank writes into one temporary directory
beside the target (named by rank 0), and rank 0 renames it into place after all have finished
and their files are on disk; a crash leaves only a `.NAME.tmp-*` directory, never a partial
checkpoint. The names are those of parallel.apply's models (fused projections split); an
export joins them (`read_model_state`).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from logitlab.io import files
from logitlab.parallel.tensor import join_fused_state

META_FILE = "logitlab_dcp.json"
FORMAT = "logitlab-dcp"


class _Holder(nn.Module):
    """The modules a rank trains under their model names (a pipeline rank's stages merged:
    tok_emb, blocks.{i}, final_norm, lm_head), so the state-dict keys are the model's."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict()
        for module in modules:
            for name, child in module.named_children():
                if name == "blocks":
                    self.blocks.update(child)
                elif child is not None and name != "rope":
                    setattr(self, name, child)


def _model_of(par) -> nn.Module:
    return par.modules[0] if not par.pipelined else _Holder(par.modules)


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optim", optimizer)   # ZeroRedundancyOptimizer: this rank's partition


def _state(par, optimizer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _model_of(par)
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, _inner_optimizer(optimizer))
    return model, state


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_path(path: Path | None) -> Path:
    if not dist.is_initialized():
        return path
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def save_sharded(directory: str | os.PathLike, par, optimizer=None, *, step: int = 0,
                 state: dict | None = None, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write a sharded checkpoint of `par` (a parallel.apply.Parallelized) and its optimizer to
    `directory` (which must not exist). Collective: every rank calls it. `extra_files` (name ->
    bytes, rank 0's) are written into the same directory before it appears. -> the directory."""
    import torch.distributed.checkpoint as dcp

    target = Path(directory)
    main = not dist.is_initialized() or dist.get_rank() == 0
    tmp = None
    if main:
        if target.exists():
            raise ValueError(f"{target} already exists: a sharded checkpoint is written to a new directory")
        tmp = files.make_temporary_dir(target)
    tmp = _broadcast_path(tmp)
    try:
        _, payload = _state(par, optimizer)
        with _quiet_single_process():
            dcp.save(payload, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        _barrier()
        if main:
            meta = {"format": FORMAT, "version": 1, "step": step, "model_config": par_config(par).to_dict(),
                    "layout": {**dict(zip(("pp", "dp_replicate", "dp_shard", "tp"), par.plan.shape)),
                               "ep": par.plan.ep},
                    "world_size": par.info.world_size, "has_optimizer": optimizer is not None,
                    "state": state or {}}
            for name, data in (extra_files or {}).items():
                files.atomic_write_bytes(tmp / name, data)
            files.atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2) + "\n")
            for name in os.listdir(tmp):
                with open(tmp / name, "rb") as fh:
                    os.fsync(fh.fileno())
            os.replace(tmp, target)
            files.fsync_dir(target.parent)
    except BaseException:
        if main and tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return target


def par_config(par):
    for module in par.modules:
        inner = getattr(module, "module", module)
        if hasattr(inner, "config"):
            return inner.config
    raise ValueError("the parallelised model has no `config`")


def read_meta(directory: str | os.PathLike) -> dict:
    """logitlab_dcp.json of a sharded checkpoint (ValueError naming the file when it is not one)."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise ValueError(f"{directory} is not a logitlab sharded checkpoint: {META_FILE} is missing")
    meta = files.read_json(path, "sharded checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format is {meta.get('format') if isinstance(meta, dict) else meta!r}, "
                         f"expected {FORMAT!r}")
    return meta


def load_sharded(directory: str | os.PathLike, par, optimizer=None) -> dict:
    """Load a sharded checkpoint written by any layout into `par` (and its optimizer, unless
    None), each rank reading only the pieces of its own shards. Collective. -> its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    meta = read_meta(directory)
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"{directory} holds no optimizer state (written without one); pass optimizer=None")
    model, payload = _state(par, optimizer)
    with _quiet_single_process():
        dcp.load(payload, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    set_model_state_dict(model, payload["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, _inner_optimizer(optimizer), payload["optim"])
    return meta


def read_model_state(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, the full model state dict in the Transformer's own keys) of a sharded
    checkpoint, in one process without a process group, reading the weights only: the optimizer
    state's shards are never loaded. For export (io.hf.save_pretrained after load_state_dict)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = read_meta(directory)
    reader = FileSystemReader(str(directory))
    shapes = reader.read_metadata().state_dict_metadata
    weights = {}
    for key, item in shapes.items():
        if key.startswith("model.") and hasattr(item, "size"):
            weights[key.removeprefix("model.")] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    if not weights:
        raise ValueError(f"{directory}: the checkpoint holds no model weights")
    with _quiet_single_process():
        dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
    return meta, join_fused_state(weights)
