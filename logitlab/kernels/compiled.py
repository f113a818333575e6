"""Formulas written for the compiler: the same values as their eager references, in a form
torch.compile fuses better. Each is used only while compiling; eager code runs the reference.

- CrossEntropy: F.cross_entropy(x.float(), t, ignore_index=...) (the mean over kept targets)
  with its backward written out as one pass. The reference is F.cross_entropy itself
  (logitlab.train.loss.cross_entropy uses this only under torch.compiler.is_compiling()).
- TiedEmbeddingGrad: a graph pass for inductor (training_options() hands it to torch.compile)
  that adds the looked-up rows' gradients of a tied embedding table into the LM head's weight
  gradient in place, instead of into a zero table that is then added to it. The reference is
  the graph as traced (the same sum, the additions in another order).
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

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


class TiedEmbeddingGrad(CustomGraphPass):
    """Inductor graph pass (post_grad_custom_pre_pass) for the backward graph of a model whose LM
    head is its embedding table W (V, D).

    W's gradient is the sum of two: the head's, a matrix product dlogits^T h (V, D), and the
    lookup's, which autograd's formula builds as a zero (V, D) table with each looked-up row's
    gradient added at its id:

        add(mm, _unsafe_masked_index_put_accumulate(zeros (V, D), mask, [ids], rows))

    Inductor lowers that add as addmm over the zero table: a (V, D) zero fill, and a copy of it
    into a new (V, D) output before the GEMM accumulates into it: two passes over a table written
    only to hold N rows. This pass adds the rows into the product's output itself,

        _unsafe_index_put(mm, [clamp(ids)], where(mask, rows, 0), accumulate=True)

    which inductor then performs in place: the same masking (ids out of range or equal to the
    padding index add nothing) and the same sum, each row's additions in another order (mm + r1 +
    r2 rather than mm + (0 + r1 + r2)), so values agree to float rounding, not bit for bit.
    Measured in GPT-2 small's compiled fp32 training step (B 4, T 256, one thread, glibc's
    allocator): the zero fill 191 ms and the copy 441 ms (mostly page faults on two new 154 MB
    tables), replaced by nothing (docs/benchmarks.md, "Performance notes").

    Anything else is left as it is: an untied model (the zero table is W's whole gradient), a sum
    whose two sides differ in shape or dtype, a zero table with another use. `rewritten` counts
    the sums rewritten by the last call (0 or 1 for a model with one tied table)."""

    def __init__(self) -> None:
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.rewritten = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is aten.add.Tensor and not node.kwargs:
                pair = [a for a in node.args if isinstance(a, torch.fx.Node)]
                if len(pair) == 2:
                    for dense, scatter in (pair, pair[::-1]):
                        if _fold_scatter(graph, node, dense, scatter):
                            self.rewritten += 1
                            break

    def uuid(self) -> str:
        return "logitlab-tied-embedding-grad-1"


def _is_zero_table(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.target is aten.full.default and node.args[1] == 0
            and len(node.users) == 1)


def _fold_scatter(graph: torch.fx.Graph, add: torch.fx.Node, dense: torch.fx.Node, scatter: torch.fx.Node) -> bool:
    """add = dense + scatter, scatter the rows accumulated into a zero table -> the rows
    accumulated into dense (see TiedEmbeddingGrad); False (graph untouched) when it is not so."""
    if scatter.target is not aten._unsafe_masked_index_put_accumulate.default or len(scatter.users) != 1:
        return False
    zeros, mask, indices, rows = scatter.args
    if not _is_zero_table(zeros) or len(indices) != 1 or indices[0] is None:
        return False
    d, s, out = (n.meta.get("val") for n in (dense, scatter, add))
    if d is None or s is None or out is None or not (d.shape == s.shape == out.shape and d.dtype == s.dtype
                                                     == out.dtype and d.device == s.device):
        return False
    V = d.shape[0]
    with graph.inserting_before(add):
        ids = indices[0]
        for bound, clamp in ((-V, aten.clamp_min.default), (V - 1, aten.clamp_max.default)):   # as inductor's
            ids = graph.call_function(clamp, (ids, bound))                    # lowering: in range
            ids.meta["val"] = indices[0].meta["val"]
        kept = graph.call_function(aten.where.ScalarOther, (mask, rows, 0.0))    # masked rows add 0
        kept.meta["val"] = rows.meta["val"]
        put = graph.call_function(aten._unsafe_index_put.default, (dense, [ids], kept, True))
        put.meta["val"] = out
    add.replace_all_uses_with(put)
    for node in (add, scatter, zeros):
        graph.erase_node(node)
    return True


def training_options() -> dict:
    """torch.compile options (inductor) for a training step: the graph passes above (as inductor's
    post_grad_custom_pre_pass, so within this compile they take that slot's place)."""
    return {"post_grad_custom_pre_pass": TiedEmbeddingGrad()}
