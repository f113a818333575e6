"""logits -> ids: sampling as pure functions on logits (sampling.py) and the generation loop:
prefill, decode steps from a KV cache, streaming, batches of prompts (loop.py), with the
reference path that recomputes the whole sequence for every token; stop strings matched in
linear time (stops.py, shared with the CLI and the server)."""

from logitlab.generate.loop import (
    GenerationResult,
    Stream,
    decode_step,
    generate,
    generate_reference,
    prefill,
    stream,
)
from logitlab.generate.sampling import SampleConfig, SamplingError, make_generator, next_token, process_logits

__all__ = ["GenerationResult", "SampleConfig", "SamplingError", "Stream", "decode_step", "generate",
           "generate_reference", "make_generator", "next_token", "prefill", "process_logits", "stream"]
