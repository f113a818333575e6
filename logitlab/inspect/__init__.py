"""Seeing inside: per-token surprisal, next-token tables (the model's softmax beside what the
sampler draws from), the logit lens and embedding neighbours."""

from logitlab.inspect.core import (
    embedding_neighbours,
    lens_logits,
    logit_lens,
    next_token_table,
    token_surprisals,
)

__all__ = ["embedding_neighbours", "lens_logits", "logit_lens", "next_token_table", "token_surprisals"]
