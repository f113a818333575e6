"""Seeing inside: per-token surprisal, next-token tables (the model's softmax beside what the
sampler draws from), the logit lens and embedding neighbours (core.py); attention patterns with
induction and previous-token scores (patterns.py); attention sinks and the Gated DeltaNet state
(mixers.py); a mixture of experts' routing (experts.py).

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "attention_patterns": "patterns",
    "best_head": "patterns",
    "embedding_neighbours": "core",
    "expert_routing": "experts",
    "induction_scores": "patterns",
    "lens_logits": "core",
    "linear_trace": "mixers",
    "logit_lens": "core",
    "next_token_table": "core",
    "previous_token_scores": "patterns",
    "sink_shares": "mixers",
    "token_surprisals": "core",
}

__all__ = ["attention_patterns", "best_head", "embedding_neighbours", "expert_routing", "induction_scores",
           "lens_logits", "linear_trace", "logit_lens", "next_token_table", "previous_token_scores", "sink_shares",
           "token_surprisals"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
