"""The training loss: teacher-forced next-token cross-entropy on float32 logits, its slow
reference, the training step's loss function (model and loss, compiled as one graph or not),
the fixed validation pass, and the masked-language-modelling objective of an encoder (mlm_mask:
the same cross-entropy, on hidden positions instead of next tokens)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from logitlab.data import tokens as data_io
from logitlab.kernels.compiled import CrossEntropy
from logitlab.train import runtime

IGNORE_INDEX = -100  # a target equal to it adds nothing to the loss (F.cross_entropy's default)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats: logits (B, T, V) upcast to float32, targets (B, T)
    in [0, V) or IGNORE_INDEX (left out of the mean). Eager it is F.cross_entropy; compiled,
    kernels.compiled.CrossEntropy (the same value, a backward the compiler fuses into one pass)."""
    B, T, V = logits.shape
    logits, targets = logits.reshape(B * T, V), targets.reshape(B * T)
    if torch.compiler.is_compiling():
        return CrossEntropy.apply(logits, targets, IGNORE_INDEX)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Slow reference: -log softmax(logits)[target], averaged over every (b, t)."""
    logp = logits.double() - logits.double().logsumexp(dim=-1, keepdim=True)  # (B, T, V)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()


def mlm_mask(ids: torch.Tensor, mask_id: int, vocab_size: int, *, fraction: float = 0.15,
             mask_share: float = 0.8, random_share: float = 0.1, maskable: torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked-LM inputs and targets (Devlin et al. 2019): ids (B, T) -> (inputs, targets) (B, T).

    In each row, round(fraction * n) of its n maskable positions (at least one) are chosen at
    random; of those, a share mask_share becomes mask_id, random_share a token drawn uniformly from
    [0, vocab_size), and the rest keep their token (BERT's 80/10/10), so the model cannot learn that
    only [MASK] positions matter. targets hold the original id at the chosen positions and
    IGNORE_INDEX everywhere else, so cross_entropy(model(inputs), targets) is the MLM loss: the
    next-token loss's function, scoring hidden positions instead of next tokens.
    maskable (B, T) bool or None (all): False marks positions never chosen (padding, special tokens).
    generator: the draws come from it alone, so a seeded generator gives the same masking."""
    if ids.ndim != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be an int64 (or int32) tensor of shape (B, T), got {ids.dtype} {tuple(ids.shape)}")
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_id {mask_id} is outside the vocabulary 0..{vocab_size - 1}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if mask_share < 0 or random_share < 0 or mask_share + random_share > 1:
        raise ValueError(f"mask_share ({mask_share}) and random_share ({random_share}) must be >= 0 "
                         "with a sum <= 1")
    maskable = torch.ones_like(ids, dtype=torch.bool) if maskable is None else maskable.to(ids.device)
    if maskable.shape != ids.shape or maskable.dtype != torch.bool:
        raise ValueError(f"maskable must be bool of shape {tuple(ids.shape)}, got {maskable.dtype} "
                         f"{tuple(maskable.shape)}")
    B, T = ids.shape
    n = maskable.sum(dim=1)                                                    # (B,)
    if bool((n == 0).any()):
        raise ValueError(f"row {int((n == 0).nonzero()[0])} has no maskable position")
    k = (fraction * n).round().clamp(min=1).long()                             # (B,) positions per row
    draw = dict(generator=generator, device=ids.device)
    score = torch.rand(B, T, **draw).masked_fill(~maskable, 2.0)              # unmaskable sort last
    rank = score.argsort(dim=1).argsort(dim=1)                                 # (B, T) 0 = lowest score
    chosen = rank < k[:, None]                                                 # (B, T)
    how = torch.rand(B, T, **draw)                                             # < mask_share: [MASK]
    random_ids = torch.randint(0, vocab_size, (B, T), **draw, dtype=ids.dtype)
    inputs = torch.where(chosen & (how < mask_share), torch.full_like(ids, mask_id), ids)
    swap = chosen & (how >= mask_share) & (how < mask_share + random_share)
    inputs = torch.where(swap, random_ids, inputs)
    targets = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    return inputs, targets


def mlm_loss(model, ids: torch.Tensor, mask_id: int, *, generator: torch.Generator | None = None,
             **masking) -> torch.Tensor:
    """The masked-LM loss of a batch ids (B, T): cross_entropy(model(inputs), targets) for mlm_mask's
    inputs and targets (masking: its fraction, mask_share, random_share, maskable), random ids
    drawn from the model's vocabulary."""
    inputs, targets = mlm_mask(ids, mask_id, model.config.vocab_size, generator=generator, **masking)
    return cross_entropy(model(inputs), targets)


def loss_fn(model, compile: bool | str = False, fullgraph: bool = True) -> Callable:
    """-> loss(ids (B, T), targets (B, T)) = cross_entropy(model(ids), targets), the training step's loss.

    compile: False (eager), True (inductor) or a torch.compile backend name. Compiled, the model
    and the loss are traced as one graph, so the float32 upcast of the (B, T, V) logits, the
    log-softmax and their backward fuse with the LM head's output instead of running as separate
    passes over B x T x V floats (the largest tensors of a small model's step); with inductor,
    kernels.graph_passes.training_options() adds its graph passes (a tied embedding's gradient
    summed in place).
    fullgraph: a graph break is an error (the plain model has none); pass False for a model
    wrapped by DDP/FSDP, whose hooks may break the graph."""
    def loss(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(model(ids), targets)
    if not compile:
        return loss
    backend = compile if isinstance(compile, str) else "inductor"
    options = None
    if backend == "inductor":
        from logitlab.kernels.graph_passes import training_options  # imports inductor: only here

        options = training_options()
    return torch.compile(loss, fullgraph=fullgraph, backend=backend, options=options)


@torch.no_grad()
def evaluate(model, tokens, seq_len: int, batch_size: int, max_tokens: int, device,
             amp_dtype=None, rank: int = 0, world_size: int = 1, all_reduce=None) -> float:
    """Mean cross-entropy (nats/token) over the fixed sequential validation pass."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in data_io.eval_windows(tokens, seq_len, batch_size, max_tokens, rank, world_size):
        x, y = x.to(device), y.to(device)
        with runtime.autocast(device, amp_dtype):
            logits = model(x)
        total += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"))
        count += int((y != IGNORE_INDEX).sum())   # a padding batch's targets are all ignored
    model.train(was_training)
    if all_reduce is not None:
        total, count = all_reduce(total), all_reduce(float(count))
    return total / max(count, 1)
