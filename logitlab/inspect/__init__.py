"""Seeing inside: per-token surprisal, next-token tables (the model's softmax beside what the
sampler draws from), the logit lens and embedding neighbours (core.py); attention patterns with
induction and previous-token scores (patterns.py); attention sinks and the Gated DeltaNet state
(mixers.py); a mixture of experts' routing (experts.py)."""

from logitlab.inspect.core import (
    embedding_neighbours,
    lens_logits,
    logit_lens,
    next_token_table,
    token_surprisals,
)
from logitlab.inspect.experts import expert_routing
from logitlab.inspect.mixers import linear_trace, sink_shares
from logitlab.inspect.patterns import attention_patterns, best_head, induction_scores, previous_token_scores

__all__ = ["attention_patterns", "best_head", "embedding_neighbours", "expert_routing", "induction_scores", "lens_logits",
           "linear_trace", "logit_lens", "next_token_table", "previous_token_scores", "sink_shares",
           "token_surprisals"]
