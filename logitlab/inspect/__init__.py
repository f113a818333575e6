"""Seeing inside: per-token surprisal, next-token tables (the model's softmax beside what the
sampler draws from), the logit lens and embedding neighbours (core.py); attention sinks and the
Gated DeltaNet state (mixers.py)."""

from logitlab.inspect.core import (
    embedding_neighbours,
    lens_logits,
    logit_lens,
    next_token_table,
    token_surprisals,
)
from logitlab.inspect.mixers import linear_trace, sink_shares

__all__ = ["embedding_neighbours", "lens_logits", "linear_trace", "logit_lens", "next_token_table", "sink_shares",
           "token_surprisals"]
