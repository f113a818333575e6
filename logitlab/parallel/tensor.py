"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti
et al. 2022) through DTensor's parallelize_module, applied to a built Transformer from outside.

The fused projections. A block computes q, k and v with one matrix `attn.qkv_proj` (rows q|k|v)
and SwiGLU's gate and up with one `mlp.gate_up_proj` (rows gate|up). Sharding such a matrix's
rows into contiguous pieces would give rank 0 all of q and rank 1 the k and v rows: no rank
would hold whole heads. DTensor has no placement for "the r-th piece of each of three
unequal parts" (GQA makes q larger than k and v). So before sharding, `split_fused_projections`
replaces each fused Linear by its parts, as separate Linear modules holding the same rows:
attn.q_proj / k_proj / v_proj and mlp.gate_proj / up_proj, and leaves in the fused module's
place a parameterless `JoinedProjection` that concatenates their outputs. ColwiseParallel on
each part then gives every rank whole heads of q, k and v (and its columns of gate and up), and
the concatenation of its local outputs is exactly the fused layout of its local heads, which
the unchanged Attention.forward reads with `n_heads / tp` and `n_kv_heads / tp` heads. The
state-dict keys become the part names, which are logitlab's legacy split layout: the same on
every mesh (so sharded checkpoints reshard between TP degrees) and joined back into the fused
rows by `join_fused_state` (or io.model_dir.upgrade_legacy_state). The split model computes the
same values as the fused one (each output row is the same dot product).

The plan (per block; "SP" = with sequence parallelism, the residual stream sharded on T):
    attn_norm, mlp_norm, final_norm   SequenceParallel (SP) / replicated
    attn, mlp inputs                  all-gathered from Shard(1) to replicated (SP)
    q_proj, k_proj, v_proj, gate, up  ColwiseParallel (output sharded by heads / by F)
    o_proj, down_proj                 RowwiseParallel (all-reduce; reduce-scatter to Shard(1) with SP)
    tok_emb                           RowwiseParallel: vocabulary-parallel embedding
    lm_head                           ColwiseParallel with logits left sharded on V, and
                                      `vocab_parallel_loss`: cross-entropy under loss_parallel,
                                      which never gathers the (B, T, V) logits
A tied LM head is the embedding's (V, D) table sharded on V: the same placement for both uses.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_FUSED = (("attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


class JoinedProjection(nn.Module):
    """Stands where a fused Linear was: the concatenation of its parts' outputs on the last dim.
    Holds no parameters (the parts are the parent's children), so no key is duplicated."""

    def __init__(self, parts: list[nn.Linear]):
        super().__init__()
        self._parts = tuple(parts)  # a tuple: not registered as submodules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self._parts], dim=-1)


def _part_sizes(module: nn.Module, fused_name: str) -> list[int]:
    if fused_name == "qkv_proj":
        H, Hkv, Dh = module.n_heads, module.n_kv_heads, module.head_dim
        return [H * Dh, Hkv * Dh, Hkv * Dh]
    half = module.gate_up_proj.out_features // 2
    return [half, half]


@torch.no_grad()
def split_fused_projections(model: nn.Module) -> nn.Module:
    """Replace every block's fused qkv_proj / gate_up_proj by separate part Linears (see the
    module docstring), in place; a model already split is returned unchanged."""
    for block in _blocks(model):
        for owner_name, fused_name, part_names in _FUSED:
            owner = getattr(block, owner_name, None)
            fused = getattr(owner, fused_name, None) if owner is not None else None
            if not isinstance(fused, nn.Linear):
                continue
            sizes = _part_sizes(owner, fused_name)
            weights = fused.weight.split(sizes, dim=0)
            biases = fused.bias.split(sizes, dim=0) if fused.bias is not None else [None] * len(sizes)
            parts = []
            for name, w, b in zip(part_names, weights, biases):
                part = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
                part.weight.copy_(w)
                if b is not None:
                    part.bias.copy_(b)
                setattr(owner, name, part)
                parts.append(part)
            setattr(owner, fused_name, JoinedProjection(parts))
    return model


def join_fused_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of a split model (q_proj/k_proj/v_proj, gate_proj/up_proj) -> the fused keys
    of the Transformer (rows q|k|v, gate|up); other keys unchanged."""
    out = dict(state)
    for key in list(state):
        for _, fused, parts in _FUSED:
            module, _, leaf = key.rpartition(".")
            module, _, part = module.rpartition(".")
            if part != parts[0]:
                continue
            keys = [f"{module}.{p}.{leaf}" for p in parts]
            if all(k in out for k in keys):
                out[f"{module}.{fused}.{leaf}"] = torch.cat([out.pop(k) for k in keys], dim=0)
    return out


def split_fused_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The inverse of join_fused_state for a Transformer of `config`: fused qkv_proj / gate_up_proj
    rows -> their parts' keys (what a model after split_fused_projections loads)."""
    H, Hkv, Dh = config.n_heads, config.n_kv_heads, config.head_dim
    sizes = {"qkv_proj": [H * Dh, Hkv * Dh, Hkv * Dh], "gate_up_proj": [config.d_ff, config.d_ff]}
    out = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        module, _, name = module.rpartition(".")
        group = next((parts for _, fused, parts in _FUSED if fused == name), None)
        if group is None or value.shape[0] != sum(sizes[name]):
            out[key] = value
            continue
        for part, piece in zip(group, value.split(sizes[name], dim=0)):
            out[f"{module}.{part}.{leaf}"] = piece
    return out


def _blocks(model: nn.Module):
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    raise ValueError(f"{type(model).__name__} has no `blocks` (nn.ModuleList or nn.ModuleDict)")


def check_tensor_parallel(config, tp: int, sequence_parallel: bool = False, seq_len: int | None = None) -> None:
    """ValueError naming the field when `config` cannot be split over `tp` ranks."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    checks = [("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads), ("d_ff", config.d_ff),
              ("padded_vocab_size", config.padded_vocab_size)]
    for name, value in checks:
        if value % tp:
            raise ValueError(f"tensor parallel degree {tp}: {name} ({value}) must be divisible by tp ({tp}), "
                             "so that every rank gets whole heads / equal shares")
    if "linear_attention" in config.layer_kinds:
        raise ValueError("tensor parallel is not supported for Gated DeltaNet layers (layer_types contains "
                         "'linear_attention'): its conv and state are not split by heads here; use tp=1")
    if config.is_moe:
        raise ValueError(f"tensor parallel does not split mixture-of-experts layers (n_experts={config.n_experts}): "
                         "experts are not sharded here; use tp=1")
    if getattr(config, "is_mla", False):
        raise ValueError(f"tensor parallel does not split multi-head latent attention (kv_lora_rank="
                         f"{config.kv_lora_rank}): its shared latent is not sharded here; use tp=1")
    if config.attn_sinks or config.attn_gate != "none":
        raise ValueError(f"tensor parallel supports plain attention only: attn_sinks={config.attn_sinks}, "
                         f"attn_gate={config.attn_gate!r} are not split by heads here; use tp=1")
    if config.padded_vocab_size != config.vocab_size:
        raise ValueError(f"tensor parallel shards the vocabulary: vocab_size ({config.vocab_size}) must equal "
                         f"padded_vocab_size ({config.padded_vocab_size}) (no padding rows)")
    if sequence_parallel and config.positions not in ("rope", "none"):
        raise ValueError(f"sequence parallel needs positions='rope' or 'none', got {config.positions!r}: "
                         "absolute position embeddings are added to the full sequence")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallel: seq_len ({seq_len}) must be divisible by tp ({tp})")


def _block_plan(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    stream = Shard(1) if sequence_parallel else Replicate()   # the residual stream (B, T, D) between ops
    plan = {
        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=stream),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=stream),
    }
    if sequence_parallel:
        plan.update({
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                       use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
        })
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False,
                          seq_len: int | None = None, sharded_logits: bool = True) -> nn.Module:
    """Shard a built Transformer over the 1-D DeviceMesh `tp_mesh`, in place (see the module
    docstring). Its forward then returns logits as a DTensor sharded on V: compute the loss
    with vocab_parallel_loss inside `loss_parallel_context(model)` (forward loss and backward).
    Heads, d_ff and the vocabulary must divide by the mesh size (ValueError otherwise).
    sharded_logits=False all-gathers the logits into a plain tensor instead (a pipeline's last
    stage, whose schedule computes the loss on plain tensors)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tp = tp_mesh.size()
    config = model.config
    check_tensor_parallel(config, tp, sequence_parallel, seq_len)
    split_fused_projections(model)
    stream = Shard(1) if sequence_parallel else Replicate()
    logits = Shard(-1) if sharded_logits else Replicate()
    root = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=logits,
                                       use_local_output=not sharded_logits)}
    if sequence_parallel:
        root["final_norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root)
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight   # both (V, D) sharded on V: one parameter again
    for block in _blocks(model):
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
        attn = block.attn
        if attn.q_norm is not None:  # per-head norms see (B, T, H/tp, Dh): weights replicated, grads summed
            parallelize_module(attn, tp_mesh, {"q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                                               "k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp   # this rank's heads
    if sharded_logits:
        model._logitlab_tp = {"tp": tp, "sequence_parallel": sequence_parallel}
    return model


def is_vocab_parallel(logits) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(logits, DTensor)


def loss_parallel_context(model: nn.Module):
    """loss_parallel() for a tensor-parallel model (its logits sharded on V), else a null context.
    Both the loss and its backward must run inside it."""
    if getattr(model, "_logitlab_tp", None) is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def vocab_parallel_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) -- plain, or a DTensor sharded on V -- against
    targets (B, T). For sharded logits (inside loss_parallel_context) each rank computes its
    vocabulary slice's max, sum of exponentials and target logit, and only those (B, T) values
    cross ranks: the full logits are never gathered. Returns a plain scalar tensor."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
