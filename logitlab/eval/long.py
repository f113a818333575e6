"""Perplexity against evaluation length: how a model trained at one context length does at others.

A model trained on windows of T tokens has only ever seen positions 0 .. T-1. `sweep_lengths`
scores the same held-out tokens in consecutive windows of each length L (every position of each
window is a target, so a window of L shows the model every distance up to L - 1), and reports
the perplexity exp(summed nats / targets). Past T it rebuilds the model for L positions with each
inference-time RoPE scaling of `model.positions.extended_config` (none, linear, ntk, dynamic,
yarn with factor L / T) and loads the trained weights unchanged: nothing is retrained.

What cannot be evaluated is a record with a note, not an error: a learned position table has no
row past its length, and a model that already carries a rope_scaling extends only with "none".
Schemes other than RoPE have no scaling axis: only "none" is measured. A NaN or infinite loss is
a RuntimeError naming the length and scaling, never a number in the table.

long.py owns `check_lengths`, `check_scalings`, `model_at_length`, `length_nats` and
`sweep_lengths` (-> LongEvalResult of LengthScore records). Reading files and drawing are the
caller's. Shapes: N windows, L window length, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from logitlab.model.positions import EXTENSIONS, extended_config
from logitlab.model.transformer import Transformer

DEFAULT_SCALINGS = ("none", "linear", "ntk", "yarn")


def check_lengths(lengths) -> tuple[int, ...]:
    """The evaluation lengths, sorted and without repeats; each must be a positive int (ValueError
    naming the bad value)."""
    lengths = list(lengths)
    if not lengths:
        raise ValueError("lengths: give at least one evaluation length")
    for L in lengths:
        if isinstance(L, bool) or not isinstance(L, int) or L <= 0:
            raise ValueError(f"lengths: {L!r} is not a positive integer")
    return tuple(sorted(set(lengths)))


def check_scalings(scalings) -> tuple[str, ...]:
    """The scalings in the order given, without repeats; each one of positions.EXTENSIONS."""
    scalings = list(dict.fromkeys(scalings))
    if not scalings:
        raise ValueError(f"scalings: give at least one of {', '.join(EXTENSIONS)}")
    for s in scalings:
        if s not in EXTENSIONS:
            raise ValueError(f"scalings: unknown scaling {s!r}; known: {', '.join(EXTENSIONS)}")
    return tuple(scalings)


@dataclass(frozen=True)
class LengthScore:
    """One cell of the sweep: summed nats over `tokens` targets at window length `length` under
    `scaling`, or nats None with `note` saying why the model cannot be evaluated there."""

    length: int
    scaling: str
    nats: float | None
    tokens: int
    note: str | None = None

    @property
    def evaluable(self) -> bool:
        return self.nats is not None

    @property
    def nats_per_token(self) -> float | None:
        return None if self.nats is None else self.nats / self.tokens

    @property
    def perplexity(self) -> float | None:
        return None if self.nats is None else math.exp(self.nats / self.tokens)

    def to_dict(self) -> dict:
        return {**asdict(self), "nats_per_token": self.nats_per_token, "perplexity": self.perplexity}


@dataclass(frozen=True)
class LongEvalResult:
    """The sweep: the model's position scheme, the length it was trained at (marked in tables),
    the lengths and scalings measured, and one LengthScore per (length, scaling)."""

    positions: str
    trained_length: int
    lengths: tuple[int, ...]
    scalings: tuple[str, ...]
    scores: tuple[LengthScore, ...]

    def score(self, length: int, scaling: str) -> LengthScore:
        for s in self.scores:
            if s.length == length and s.scaling == scaling:
                return s
        raise KeyError(f"no score for length {length} with scaling {scaling!r}")

    def to_dict(self) -> dict:
        return {"positions": self.positions, "trained_length": self.trained_length, "lengths": list(self.lengths),
                "scalings": list(self.scalings), "scores": [s.to_dict() for s in self.scores]}

    @classmethod
    def from_dict(cls, data: dict) -> "LongEvalResult":
        """Inverse of to_dict (the derived perplexity fields are recomputed, not read)."""
        scores = tuple(LengthScore(s["length"], s["scaling"], s["nats"], s["tokens"], s.get("note"))
                       for s in data["scores"])
        return cls(data["positions"], data["trained_length"], tuple(data["lengths"]), tuple(data["scalings"]),
                   scores)

    def only(self, scalings) -> "LongEvalResult":
        """The same sweep restricted to `scalings` (those it has, in that order)."""
        keep = tuple(s for s in scalings if s in self.scalings)
        return LongEvalResult(self.positions, self.trained_length, self.lengths, keep,
                              tuple(s for s in self.scores if s.scaling in keep))


def model_at_length(model: Transformer, length: int, scaling: str) -> tuple[Transformer | None, str | None]:
    """(the trained weights in a model built for `length` positions with `scaling`, None) or
    (None, why not). Up to the model's context_length this is the model itself, whatever the
    scaling; past it, extended_config's refusal (a learned table, a scaling on a model that
    already has one, a scaling on a scheme without RoPE) becomes the note."""
    try:
        config = extended_config(model.config, length, scaling)
    except ValueError as exc:
        return None, str(exc)
    if config is model.config:
        return model, None
    param = next(model.parameters())
    wide = Transformer(config).to(device=param.device, dtype=param.dtype).eval()
    wide.load_state_dict(model.state_dict())
    return wide, None


@torch.no_grad()
def length_nats(model: Transformer, tokens: torch.Tensor, length: int, n_targets: int,
                batch_tokens: int = 16384) -> tuple[float, int]:
    """(summed nats, targets) of consecutive windows of `length` over tokens[: n_targets + 1]:
    window i reads tokens[iL : iL + L] and predicts tokens[iL + 1 : iL + L + 1]. Batches hold
    about batch_tokens tokens (at least one window). NaN/inf is a RuntimeError."""
    n = n_targets // length
    if n == 0:
        raise ValueError(f"{n_targets} targets do not fill one window of length {length}")
    flat = tokens[: n * length + 1]
    x, y = flat[:-1].view(n, length), flat[1:].view(n, length)                       # (N, L) each
    device = next(model.parameters()).device
    per_batch = max(1, batch_tokens // length)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(0, n, per_batch):
        logits = model(x[i:i + per_batch].to(device))                                 # (b, L, V)
        nats = F.cross_entropy(logits.float().flatten(0, 1), y[i:i + per_batch].flatten().to(device),
                               reduction="sum")
        total += nats.double().cpu()
    value = float(total)
    if not math.isfinite(value):
        raise RuntimeError(f"the loss at length {length} is {value}: the model's logits hold NaN or inf there")
    return value, n * length


def _as_tokens(tokens, vocab_size: int) -> torch.Tensor:
    """A 1-D int64 CPU tensor of the ids, each checked against the model's vocabulary."""
    t = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).flatten()                   # (n,)
    if len(t) and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise ValueError(f"the tokens hold ids outside the model's vocabulary [0, {vocab_size}): "
                         f"min {int(t.min())}, max {int(t.max())}")
    return t


def sweep_lengths(model: Transformer, tokens, lengths, scalings=DEFAULT_SCALINGS, *,
                  trained_length: int | None = None, max_tokens: int = 32768,
                  batch_tokens: int = 16384) -> LongEvalResult:
    """Perplexity of `model` on `tokens` (1-D ids, held-out) at every length under every scaling.

    The same first N targets are scored at every length: N = min(max_tokens, len(tokens) - 1)
    rounded down to a multiple of the longest length (so with power-of-two lengths every row
    scores exactly the same tokens). Lengths up to the model's context_length are scored once and
    shared by every scaling (no scaling changes a model there). trained_length (default the
    model's context_length) is only carried for marking."""
    lengths, scalings = check_lengths(lengths), check_scalings(scalings)
    config = model.config
    axis = scalings if config.positions == "rope" else ("none",)
    ids = _as_tokens(tokens, config.vocab_size)
    longest = lengths[-1]
    n_targets = min(max_tokens, len(ids) - 1) // longest * longest
    if n_targets == 0:
        raise ValueError(f"the held-out text holds {len(ids)} tokens; the longest length {longest} needs at "
                         f"least {longest + 1} (and max_tokens={max_tokens} at least {longest})")
    was_training = model.training
    model.eval()
    scores = []
    try:
        for L in lengths:
            shared = None
            for scaling in axis:
                if shared is not None:
                    scores.append(LengthScore(L, scaling, shared.nats, shared.tokens, shared.note))
                    continue
                wide, note = model_at_length(model, L, scaling)
                nats, count = length_nats(wide, ids, L, n_targets, batch_tokens) if wide is not None else (None, 0)
                score = LengthScore(L, scaling, nats, count, note)
                scores.append(score)
                if L <= config.context_length:
                    shared = score
    finally:
        model.train(was_training)
    return LongEvalResult(config.positions, trained_length or config.context_length, lengths, axis, tuple(scores))
