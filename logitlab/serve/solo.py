"""A request alone in the engine, decoded speculatively (generate/speculative.py).

solo.py owns the engine's speculative mode: when `Engine(speculative=(draft, k))` has exactly
one request, each scheduler step runs one speculative round for it (one target pass over the last
token and k drafts, 1 to k + 1 tokens out), instead of a batch-of-one decode step. The request's
ids so far (prompt and generated) start its SpeculativeStream, with its own torch.Generator and
what is left of its budget; its tokens come with the target's log-probabilities from the same pass.
As soon as another request arrives, the engine moves it back into the batch (engine._solo_step).
Penalties (repetition, frequency, presence) are not applied by speculative decoding: a request
with them stays in the batch.
"""

from __future__ import annotations

import dataclasses


def suits(config) -> bool:
    """Whether a request with this SampleConfig may be decoded speculatively."""
    return config.repetition_penalty == 1.0 and not config.frequency_penalty and not config.presence_penalty


def start(model, r, draft, k: int):
    """-> (request, its SpeculativeStream, the stream's rounds)."""
    from logitlab.generate.speculative import SpeculativeStream

    left = r.budget - len(r.generated)
    config = dataclasses.replace(r.config, max_new_tokens=left)
    stream = SpeculativeStream(model, r.ids, config, draft=draft, k=k, generator=r.generator)
    return r, stream, stream.rounds()


def round(engine, r, stream, rounds) -> str | None:
    """One round: its tokens as events, each through the engine's stop rules -> the reason r
    stops ("stop" or "length"; the engine finishes it), or None."""
    before = (stream.result.drafted, stream.result.accepted)
    new, logits = next(rounds)                                             # (n,), (n, V)
    stats = engine.stats
    stats["steps"] += 1
    stats["speculative_rounds"] += 1
    stats["drafted"] += stream.result.drafted - before[0]
    stats["accepted"] += stream.result.accepted - before[1]
    stats["max_rows"] = max(stats["max_rows"], 1)
    for i, token in enumerate(new):
        r.generated.append(token)
        r.emit(engine._event(logits[i], token, r.top_logprobs))
        reason = engine._stop_reason(r, token)
        if reason is not None:
            return reason
    return None
