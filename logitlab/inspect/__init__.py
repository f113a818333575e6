"""Seeing inside: per-token surprisal, next-token tables (the model's softmax beside what the
sampler draws from), the logit lens and embedding neighbours (core.py); attention patterns with
induction and previous-token scores (patterns.py); attention sinks and the Gated DeltaNet state
(mixers.py); a mixture of experts' routing (experts.py); over the model's hook points: direct logit
attribution (attribution.py), activation and attribution patching (patching.py), steering
directions (steering.py), the tuned lens and early exit (lenses.py), linear probes (probes.py).

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "activation_patching": "patching",
    "activation_patching_reference": "patching",
    "add_steering": "steering",
    "attention_patterns": "patterns",
    "attribution_patching": "patching",
    "best_head": "patterns",
    "direct_logit_attribution": "attribution",
    "early_exit": "lenses",
    "embedding_neighbours": "core",
    "expert_routing": "experts",
    "induction_scores": "patterns",
    "lens_bits": "lenses",
    "lens_logits": "core",
    "linear_probe": "probes",
    "linear_trace": "mixers",
    "load_steering": "steering",
    "load_tuned_lens": "lenses",
    "logit_difference": "patching",
    "logit_lens": "core",
    "next_token_table": "core",
    "previous_token_scores": "patterns",
    "save_steering": "steering",
    "save_tuned_lens": "lenses",
    "sink_shares": "mixers",
    "steer": "steering",
    "Steering": "steering",
    "steering_direction": "steering",
    "token_surprisals": "core",
    "train_tuned_lens": "lenses",
    "TunedLens": "lenses",
}

__all__ = ["activation_patching", "activation_patching_reference", "add_steering", "attention_patterns",
           "attribution_patching", "best_head", "direct_logit_attribution", "early_exit", "embedding_neighbours",
           "expert_routing", "induction_scores", "lens_bits", "lens_logits", "linear_probe", "linear_trace",
           "load_steering", "load_tuned_lens", "logit_difference", "logit_lens", "next_token_table",
           "previous_token_scores", "save_steering", "save_tuned_lens", "sink_shares", "steer", "Steering",
           "steering_direction", "token_surprisals", "train_tuned_lens", "TunedLens"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
