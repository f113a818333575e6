"""logits -> ids: sampling as pure functions on logits (sampling.py) and the generation loop:
prefill, decode steps from a KV cache, streaming, batches of prompts (loop.py), with the
reference path that recomputes the whole sequence for every token; stop strings matched in
linear time (stops.py, shared with the CLI and the server); speculative decoding with an n-gram or
model drafter (speculative.py).

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "GenerationResult": "loop",
    "NgramDraft": "speculative",
    "SpeculativeResult": "speculative",
    "SampleConfig": "config",
    "SamplingError": "sampling",
    "Stream": "loop",
    "decode_step": "loop",
    "generate": "loop",
    "generate_reference": "loop",
    "make_generator": "sampling",
    "next_token": "sampling",
    "prefill": "loop",
    "process_logits": "sampling",
    "speculative_generate": "speculative",
    "stream": "loop",
}

__all__ = ["GenerationResult", "NgramDraft", "SampleConfig", "SamplingError", "SpeculativeResult", "Stream",
           "decode_step", "generate", "generate_reference", "make_generator", "next_token", "prefill",
           "process_logits", "speculative_generate", "stream"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
