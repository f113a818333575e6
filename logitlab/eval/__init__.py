"""Evaluation: bits per byte (bpb.py), scoring continuations and whole documents (scoring.py), the
lm-evaluation-harness model type (harness.py, imported on demand: it needs lm-eval) and the
multiple-choice tasks built from the Python standard library (stdlib_mc.py), and perplexity against
evaluation length under each RoPE scaling (long.py).

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "BPBResult": "bpb",
    "LengthScore": "long",
    "LongEvalResult": "long",
    "Score": "scoring",
    "batch_nats_and_bytes": "bpb",
    "bits_per_byte": "bpb",
    "encode_pair": "scoring",
    "evaluate_bpb": "bpb",
    "loglikelihood_rolling": "scoring",
    "nats_and_bytes": "bpb",
    "rolling_windows": "scoring",
    "score": "scoring",
    "score_ids": "scoring",
    "sweep_lengths": "long",
    "token_byte_lengths": "bpb",
}

__all__ = ["BPBResult", "LengthScore", "LongEvalResult", "Score", "batch_nats_and_bytes", "bits_per_byte",
           "encode_pair", "evaluate_bpb", "loglikelihood_rolling", "nats_and_bytes", "rolling_windows", "score",
           "score_ids", "sweep_lengths", "token_byte_lengths"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
