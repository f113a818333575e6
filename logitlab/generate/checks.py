"""What generation checks before it runs a model: that the model generates at all (a decoder, not
an encoder) and that the prompts fit it. loop.py calls these; they never run the model."""

from __future__ import annotations

from typing import Sequence

from logitlab.generate.sampling import _check_id


def check_generates(model_config) -> None:
    """Generation predicts each next token from the ones before it, so it needs a causal model;
    an encoder (ModelConfig.attention="bidirectional", trained to fill in masked tokens from both
    sides) is refused with a message naming the field."""
    attention = getattr(model_config, "attention", "causal")
    if attention != "causal":
        raise ValueError(f"generation needs a causal (decoder) model, but this model's config has "
                         f"attention={attention!r}: an encoder reads later tokens and was not trained "
                         "to predict the next one")


def check_prompts(prompts: Sequence[Sequence[int]], model_config, max_new_tokens: int,
                  streaming=None) -> int:
    """Validate the model and the prompts; return how many new tokens fit in the context (all with
    StreamingLLM)."""
    check_generates(model_config)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token id")
    V, ctx = model_config.vocab_size, model_config.context_length
    for p in prompts:
        for token in p:
            _check_id(int(token), V, "prompt")
    longest = max(len(p) for p in prompts)
    if longest >= ctx:
        raise ValueError(f"prompt of {longest} tokens leaves no room in the context of {ctx} tokens")
    if streaming is not None:
        if len({len(p) for p in prompts}) > 1:  # eviction is by slot, which padding would shift
            raise ValueError("streaming (StreamingLLM) generation needs prompts of one length")
        return max_new_tokens
    return min(max_new_tokens, ctx - longest)
