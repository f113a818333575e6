"""Activation checkpointing per block (Chen et al. 2016), applied to a built model from outside:
a block's forward keeps fewer of its intermediate values and backward recomputes the rest.

    none       every intermediate value kept (the fastest; the most memory)
    selective  the outputs of matrix products and attention kept, everything else (norms,
               activations, elementwise products, RoPE) recomputed: torch's selective
               checkpointing with a per-op policy (Korthikanti et al. 2022 choose likewise)
    full       only each block's input kept; the whole block re-runs in backward

The block keeps its keys (the wrapper is its own forward, not a new parent module), so
checkpoints and FSDP2 units do not change. `saved_activation_bytes` measures what a forward
keeps for backward, for the planner's comparison and the benchmark.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

AC_MODES = ("none", "selective", "full")


def _saved_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default}
    return {op for op in ops if op is not None}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, mode: str, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> nn.Module:
    """Checkpoint every block of `model.blocks` with `mode` (see the module docstring), in
    place; "none" leaves the model as it is. Apply after tensor parallelism and before FSDP."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {AC_MODES}, got {mode!r}")
    if mode == "none":
        return model
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(f"activation checkpointing needs `model.blocks`; {type(model).__name__} has none")
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):
        if getattr(block, "_logitlab_ac", None) is not None:
            raise ValueError(f"activation checkpointing is already applied ({block._logitlab_ac!r})")
        block.forward = functools.partial(_checkpointed, block.forward, mode)   # instance attribute
        block._logitlab_ac = mode
    return model


def saved_activation_bytes(fn, *args) -> tuple[object, int]:
    """Run fn(*args) -> (its result, bytes of the tensors created during it that are still alive
    afterwards, each storage once): what the forward keeps for backward (autograd's saved
    tensors and a selective checkpoint's cache alike), plus the result itself."""
    import gc
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    created: list = []   # weak references: a tensor freed during the forward is not kept alive here

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    created.append(weakref.ref(t))
            return out

    with _Record():
        out = fn(*args)
    gc.collect()
    alive = {}   # storage address -> bytes, over the tensors still alive (a freed address may be reused)
    for ref in created:
        t = ref()
        if t is not None:
            storage = t.untyped_storage()
            alive[storage.data_ptr()] = storage.nbytes()
    return out, sum(alive.values())
