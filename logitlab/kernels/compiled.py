"""Formulas written for the compiler: the same values as their eager references, in a form
torch.compile fuses better. Each is used only while compiling; eager code runs the reference.

- CrossEntropy: F.cross_entropy(x.float(), t, ignore_index=...) (the mean over kept targets)
  with its backward written out as one pass. The reference is F.cross_entropy itself
  (logitlab.train.loss.cross_entropy uses this only under torch.compiler.is_compiling()).

Graph passes for inductor live in graph_passes.py (importing inductor takes seconds, so only a
compile that uses them imports them).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index


class CrossEntropy(torch.autograd.Function):
    """F.cross_entropy(x.float(), t) (mean over the targets that are not `ignore_index`) with its
    gradient written out: g * (softmax(x) - onehot(t)) / n on each kept row, zero on ignored ones.

    For the compiler only: `CrossEntropy.apply(x (N, V), t (N,), ignore_index)`. Traced from
    F.cross_entropy, backward sums each row's one-hot gradient over V (a second pass comparing
    every column index with the target, in int64) before the softmax pass; here one pass
    recomputes the softmax from the saved logits and log-sum-exp, subtracts the one-hot part and
    writes the gradient in the logits' dtype (no float32 (N, V) buffer under bf16 autocast).
    Out-of-range targets fail in the compiled kernel's index check, as they do when
    F.cross_entropy is compiled."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        xf = x.float()                                               # (N, V)
        keep = t != ignore_index                                     # (N,)
        t = torch.where(keep, t, 0)
        lse = torch.logsumexp(xf, dim=-1)                            # (N,)
        n = keep.sum()
        loss = torch.where(keep, lse - xf.gather(1, t[:, None]).squeeze(1), 0.0).sum() / n
        ctx.save_for_backward(x, t, keep, lse, n)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, t, keep, lse, n = ctx.saved_tensors
        w = torch.where(keep, grad / n, 0.0)[:, None]                # (N, 1) each row's weight
        pw = torch.exp(x.float() - lse[:, None]) * w                 # (N, V) softmax * weight
        cols = torch.arange(x.shape[1], device=x.device, dtype=torch.int32)
        onehot = cols == t.to(torch.int32)[:, None]                  # (N, V), int32: the cheaper compare
        return torch.where(onehot, pw - w, pw).to(x.dtype), None, None  # one pass, written in x's dtype
