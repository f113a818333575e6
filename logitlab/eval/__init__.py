"""Evaluation: bits per byte (bpb.py), scoring continuations and whole documents (scoring.py), the
lm-evaluation-harness model type (harness.py, imported on demand: it needs lm-eval) and the
multiple-choice tasks built from the Python standard library (stdlib_mc.py), and perplexity against
evaluation length under each RoPE scaling (long.py)."""

from logitlab.eval.bpb import (
           BPBResult,
           batch_nats_and_bytes,
           bits_per_byte,
           evaluate_bpb,
           nats_and_bytes,
           token_byte_lengths,
)
from logitlab.eval.long import LengthScore, LongEvalResult, sweep_lengths
from logitlab.eval.scoring import Score, encode_pair, loglikelihood_rolling, rolling_windows, score, score_ids

__all__ = ["BPBResult", "LengthScore", "LongEvalResult", "Score", "batch_nats_and_bytes", "bits_per_byte",
           "encode_pair", "evaluate_bpb", "loglikelihood_rolling", "nats_and_bytes", "rolling_windows", "score",
           "score_ids", "sweep_lengths", "token_byte_lengths"]
