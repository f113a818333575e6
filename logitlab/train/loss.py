"""The training loss: teacher-forced next-token cross-entropy on float32 logits, its slow
reference, the training step's loss function (model and loss, compiled as one graph or not),
and the fixed validation pass."""

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


def loss_fn(model, compile: bool | str = False, fullgraph: bool = True) -> Callable:
    """-> loss(ids (B, T), targets (B, T)) = cross_entropy(model(ids), targets), the training step's loss.

    compile: False (eager), True (inductor) or a torch.compile backend name. Compiled, the model
    and the loss are traced as one graph, so the float32 upcast of the (B, T, V) logits, the
    log-softmax and their backward fuse with the LM head's output instead of running as separate
    passes over B x T x V floats (the largest tensors of a small model's step).
    fullgraph: a graph break is an error (the plain model has none); pass False for a model
    wrapped by DDP/FSDP, whose hooks may break the graph."""
    def loss(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(model(ids), targets)
    if not compile:
        return loss
    backend = compile if isinstance(compile, str) else "inductor"
    return torch.compile(loss, fullgraph=fullgraph, backend=backend)


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
        count += y.numel()
    model.train(was_training)
    if all_reduce is not None:
        total, count = all_reduce(total), all_reduce(float(count))
    return total / max(count, 1)
