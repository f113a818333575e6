"""Full state dicts for checkpoints: gathered to rank 0 in the single-process layout (unwrapped
keys, full tensors), so a run saved with N ranks resumes with M, and loaded back into a wrapped
model. Reading and writing the files is io.checkpoint's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from logitlab.parallel.wrap import _is_fsdp, unwrap

# --------------------------------------------------------------------------------------------
# Full state dicts: saved by N ranks, loaded by M
# --------------------------------------------------------------------------------------------

def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _use_dcp(model: nn.Module) -> bool:
    return dist.is_initialized() and (
        isinstance(model, nn.parallel.DistributedDataParallel) or _is_fsdp(model))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Model weights as full CPU tensors with the unwrapped model's keys, on rank 0 ({} on the
    others). Every rank must call it (FSDP2 all-gathers the shards)."""
    if not _use_dcp(model):
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Optimizer state on rank 0 ({} on the others) in torch.optim's own layout (parameters
    numbered 0.. in param-group order), exactly what `optimizer.state_dict()` gives in a single
    process, so one checkpoint format serves every world size."""
    if not _use_dcp(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not by_name:
        return {}
    ids = {name: i for i, name in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
    groups = [{**g, "params": [ids[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {ids[name]: value for name, value in by_name["state"].items()}, "param_groups": groups}


def _fill_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add keys of tied parameters stored once (e.g. lm_head.weight beside tok_emb.weight)."""
    aliases: dict[int, list[str]] = {}
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    state = dict(state)
    for names in aliases.values():
        present = [n for n in names if n in state]
        for n in names:
            if present and n not in state:
                state[n] = state[present[0]]
    return state


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor],
                         optimizer: torch.optim.Optimizer | None = None,
                         optimizer_state: dict | None = None) -> None:
    """Load full tensors written by `full_state_dict` / `full_optimizer_state_dict` (any world size)
    into a wrapped or plain model and its optimizer. Every rank passes the same full dicts (read
    from the checkpoint, so the run directory must be visible to every node); each keeps its shard."""
    state = _fill_tied(model, state)
    if not _use_dcp(model):
        unwrap(model).load_state_dict(state)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, state, options=_options())
    if optimizer is None or optimizer_state is None:
        return
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's: build it after wrap_model")
    groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved = optimizer_state["param_groups"]
    if [len(g) for g in groups] != [len(g["params"]) for g in saved]:
        raise ValueError(f"optimizer state has param groups of sizes {[len(g['params']) for g in saved]}, "
                         f"the optimizer has {[len(g) for g in groups]}")
    name_of = {i: n for g_saved, g_names in zip(saved, groups) for i, n in zip(g_saved["params"], g_names)}
    by_name = {"state": {name_of[int(i)]: v for i, v in optimizer_state["state"].items()},
               "param_groups": [{**g, "params": names} for g, names in zip(saved, groups)]}
    set_optimizer_state_dict(model, optimizer, by_name, options=_options())
