"""Scoring text under a model: how likely is this continuation after that context?

scoring.py owns the log-likelihood measurements that evaluations are built from:

  - `score_ids(model, pairs)`: for each (context ids, continuation ids) pair, the summed
    log-probability of the continuation, whether greedy decoding would have produced it, and the
    log-probability of each of its tokens; batched, the context cut from the left to fit the window;
  - `score(model, tokenizer, context, continuation)`: the same for text, split into ids the way
    lm-evaluation-harness splits it (see `encode_pair`);
  - `rolling_windows(ids, prefix_id, window)` and `loglikelihood_rolling(...)`: the log-likelihood of
    a whole document longer than the context, as disjoint windows that each see as much context as
    fits (lm-evaluation-harness's definition of `loglikelihood_rolling`).

`score_ids_reference` is the obviously correct path (one pair at a time, the whole window through
the model, log_softmax over every position) that the batched one is tested against.

Nothing here puts the model in eval mode or changes it; callers pass a model in eval mode.
Shapes: B batch, T positions, D d_model, V vocab, N scored positions of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from logitlab.generate.sampling import MODEL_CAUSE

Pair = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class Score:
    """One continuation's score: logprob = sum of token_logprobs (natural log), greedy = every
    continuation token was the model's argmax at its position."""

    logprob: float
    greedy: bool
    token_logprobs: tuple[float, ...] = field(repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.token_logprobs)


# --------------------------------------------------------------------------------------------
# Ids
# --------------------------------------------------------------------------------------------

def _window(context: Sequence[int], continuation: Sequence[int], limit: int, index: int) -> list[int]:
    """The model input for one pair: context + continuation without its last token, cut from the
    left to at most `limit` ids (the model's context length)."""
    if len(continuation) == 0:
        raise ValueError(f"pair {index}: the continuation has no tokens")
    if len(context) == 0:
        raise ValueError(f"pair {index}: the context has no tokens (start it with the end-of-text id, "
                         f"as score() does for an empty context)")
    if len(continuation) > limit:
        raise ValueError(f"pair {index}: the continuation has {len(continuation)} tokens, more than the "
                         f"model's context_length ({limit}); split it (loglikelihood_rolling)")
    whole = [int(i) for i in context] + [int(i) for i in continuation]
    return whole[-(limit + 1):-1]


def _check_vocab(window: list[int], vocab_size: int, index: int) -> None:
    bad = [i for i in window if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"pair {index}: token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})")


def _finish(logprobs: torch.Tensor, greedy_hits: torch.Tensor, index: int) -> Score:
    """(n,) float64 log-probabilities and (n,) bool argmax hits of one pair -> Score, refusing NaN."""
    values = logprobs.tolist()
    if not all(v == v and v != float("inf") for v in values):  # -inf is a real (impossible) score
        raise RuntimeError(f"pair {index}: the model's log-probabilities contain NaN ({MODEL_CAUSE})")
    return Score(float(sum(values)), bool(greedy_hits.all()), tuple(values))


def score_ids(model, pairs: Sequence[Pair], batch_size: int = 16) -> list[Score]:
    """Score every (context ids, continuation ids) pair; results in the order of `pairs`.

    Pairs are sorted by length (longest first) and run `batch_size` at a time, right-padded: with
    causal attention a real position never sees the padding after it, so no mask is needed. Only
    the scored positions go through the final norm and LM head. A context longer than the window
    loses its oldest tokens; a continuation longer than the window is a ValueError."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    limit, V = model.config.context_length, model.config.vocab_size
    windows = [_window(c, k, limit, i) for i, (c, k) in enumerate(pairs)]
    for i, w in enumerate(windows):
        _check_vocab(w + [int(t) for t in pairs[i][1]], V, i)
    order = sorted(range(len(pairs)), key=lambda i: -len(windows[i]))
    device = next(model.parameters()).device
    results: list[Score | None] = [None] * len(pairs)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            T = len(windows[rows[0]])
            ids = torch.zeros(len(rows), T, dtype=torch.long)               # (B, T), right-padded with 0
            for b, i in enumerate(rows):
                ids[b, :len(windows[i])] = torch.tensor(windows[i])
            h = model.forward_features(ids.to(device))                      # (B, T, D)
            spans = [(len(windows[i]) - len(pairs[i][1]), len(windows[i])) for i in rows]
            picked = torch.cat([h[b, lo:hi] for b, (lo, hi) in enumerate(spans)])          # (N, D)
            logprobs = torch.log_softmax(model.unembed(picked[None])[0].double(), dim=-1)  # (N, V)
            targets = torch.tensor([int(t) for i in rows for t in pairs[i][1]], device=device)  # (N,)
            token_lp = logprobs.gather(1, targets[:, None])[:, 0]                           # (N,)
            hits = logprobs.argmax(dim=-1) == targets                                       # (N,)
            offset = 0
            for i, (lo, hi) in zip(rows, spans):
                n = hi - lo
                results[i] = _finish(token_lp[offset:offset + n].cpu(), hits[offset:offset + n].cpu(), i)
                offset += n
    return results  # type: ignore[return-value]


def score_ids_reference(model, pairs: Sequence[Pair]) -> list[Score]:
    """The slow, obviously correct score_ids: one pair at a time, logits for every position of the
    window, log_softmax, then the continuation's positions read off one by one."""
    limit = model.config.context_length
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for i, (context, continuation) in enumerate(pairs):
            window = _window(context, continuation, limit, i)
            _check_vocab(window + [int(t) for t in continuation], model.config.vocab_size, i)
            logits = model(torch.tensor([window], device=device))[0].double()   # (T, V)
            logprobs = torch.log_softmax(logits, dim=-1)                          # (T, V)
            first = len(window) - len(continuation)
            lp = [float(logprobs[first + j, int(t)]) for j, t in enumerate(continuation)]
            hits = [int(logprobs[first + j].argmax()) == int(t) for j, t in enumerate(continuation)]
            out.append(_finish(torch.tensor(lp, dtype=torch.float64), torch.tensor(hits), i))
    return out


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------

def _prefix_id(tokenizer) -> int:
    eot = getattr(tokenizer, "eot_id", None)
    if eot is None:
        raise ValueError("an empty context needs the end-of-text token as its first id, and this tokenizer "
                         "has no <|endoftext|>")
    return eot


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids), split as lm-evaluation-harness splits them so that scores
    are comparable with its `hf` model type: whitespace at the end of the context moves to the start
    of the continuation (" Paris" is one token, "Paris" after "is " another), the whole text is
    encoded once and the continuation is what follows the context's own encoding. An empty context
    becomes the end-of-text id."""
    if not isinstance(context, str) or not isinstance(continuation, str):
        raise ValueError(f"context and continuation must be str, got {type(context).__name__} and "
                         f"{type(continuation).__name__}")
    if context == "":
        cont = tokenizer.encode(continuation)
        prefix = _prefix_id(tokenizer)
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def score(model, tokenizer, context: str | Sequence[str], continuation: str | Sequence[str],
          batch_size: int = 16) -> Score | list[Score]:
    """The summed log-probability (nats) of `continuation` after `context`, and whether greedy
    decoding would produce it: one Score for two strings, a list for two equal-length lists."""
    single = isinstance(context, str)
    if single != isinstance(continuation, str):
        raise ValueError("context and continuation must both be strings or both be lists of strings")
    contexts, continuations = ([context], [continuation]) if single else (list(context), list(continuation))
    if len(contexts) != len(continuations):
        raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
    pairs = [encode_pair(tokenizer, c, k) for c, k in zip(contexts, continuations)]
    for i, (_, k) in enumerate(pairs):
        if not k:
            raise ValueError(f"pair {i}: the continuation {continuations[i]!r} encodes to no tokens")
    scores = score_ids(model, pairs, batch_size)
    return scores[0] if single else scores


# --------------------------------------------------------------------------------------------
# Documents longer than the context
# --------------------------------------------------------------------------------------------

def rolling_windows(ids: Sequence[int], prefix_id: int, window: int) -> list[tuple[list[int], list[int]]]:
    """A document's ids as disjoint (context, continuation) pairs that together predict every id once.

    The first pair predicts the first `window` ids after `prefix_id` (end-of-text); each later one
    predicts the next `window` ids (the last: what is left) from the ids just before them, so every
    model input is as long as the window allows. Example, window 4, ids 0..9, prefix P:
    ([P], [0 1 2 3]), ([3], [4 5 6 7]), ([5 6 7], [8 9]): inputs P0 1 2, 3 4 5 6, 5 6 7 8."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    ids = [int(i) for i in ids]
    out: list[tuple[list[int], list[int]]] = []
    done = 0
    while done < len(ids):
        end = min(done + window, len(ids))
        predicted = ids[done:end]
        # the model input is ids[end - window - 1 : end - 1] (with the prefix in front of id 0);
        # its first len(input) - len(predicted) + 1 ids are the context
        start = max(end - window - 1, -1)
        context = ([prefix_id] + ids[:done]) if start < 0 else ids[start:done]
        out.append((context, predicted))
        done = end
    return out


def loglikelihood_rolling(model, tokenizer, text: str | Sequence[str], batch_size: int = 16) -> float | list[float]:
    """The log-likelihood (nats) of a whole document, however long: the sum over rolling_windows of
    the model's context_length, the first window conditioned on end-of-text. A list of documents
    gives a list of floats (each document scored on its own)."""
    single = isinstance(text, str)
    docs = [text] if single else list(text)
    prefix = _prefix_id(tokenizer)
    pairs, owner = [], []
    for d, doc in enumerate(docs):
        windows = rolling_windows(tokenizer.encode(doc), prefix, model.config.context_length)
        pairs += windows
        owner += [d] * len(windows)
    totals = [0.0] * len(docs)
    for d, s in zip(owner, score_ids(model, pairs, batch_size)):
        totals[d] += s.logprob
    return totals[0] if single else totals
