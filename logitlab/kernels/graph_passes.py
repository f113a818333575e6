"""Graph passes for inductor, handed to torch.compile as options: the graph a training step
traces, rewritten into one that computes the same values with fewer passes over memory.

- TiedEmbeddingGrad: adds the looked-up rows' gradients of a tied embedding table into the LM
  head's weight gradient in place, instead of into a zero table that is then added to it. The
  reference is the graph as traced (the same sum, the additions in another order).
- training_options(): the options train.loss_fn gives inductor for a training step.

Imported only by a compile that uses them: this module imports inductor (seconds).
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten


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
            if (node.op == "call_function" and node.target is aten.add.Tensor and not node.kwargs
                    and all(isinstance(a, torch.fx.Node) for a in node.args)):
                a, b = node.args                                     # either side may be the scatter
                self.rewritten += _fold_scatter(graph, node, a, b) or _fold_scatter(graph, node, b, a)

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
