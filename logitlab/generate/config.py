"""SampleConfig: how to choose each next token and when to stop, validated.

config.py owns the frozen settings that sampling.py's pure functions and loop.py's generation
read. It imports no torch, so that the command line can build its flags from the fields without
loading the model's libraries (`logitlab --help` stays fast). F32_MAX and GREEDY_BELOW are
float32's largest finite and smallest normal values (torch.finfo(torch.float32).max / .tiny).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Mapping

F32_MAX = 3.4028234663852886e38      # float32's largest finite value: larger values are inf in float32
GREEDY_BELOW = 1.1754943508222875e-38  # float32's smallest normal number: a smaller temperature is greedy


def _real(x) -> bool:
    """A finite number that float32 holds (bools are not numbers here)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and abs(x) <= F32_MAX


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _f(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class SampleConfig:
    """How to choose each next token and when to stop. Every field has a no-op default."""

    max_new_tokens: int = _f(64, "most tokens to generate per prompt")
    temperature: float = _f(1.0, "divide logits by T before softmax; 0 = greedy (argmax), as is any T < 1.2e-38")
    top_k: int = _f(0, "keep only the k most likely tokens (0 = off)")
    top_p: float = _f(1.0, "keep the smallest set of top tokens whose mass reaches P (1 = off)")
    min_p: float = _f(0.0, "drop tokens less likely than min_p x the top token (0 = off)")
    repetition_penalty: float = _f(1.0, "CTRL-style penalty for tokens already in the context (1 = off)")
    frequency_penalty: float = _f(0.0, "subtract this x the count of each generated token")
    presence_penalty: float = _f(0.0, "subtract this once from every token generated so far")
    seed: int | None = _f(None, "seed for the sampler's torch.Generator (None = random)")
    stop_ids: tuple[int, ...] = _f((), "token ids that end generation (besides end-of-text)")
    banned_ids: tuple[int, ...] = _f((), "token ids that are never generated")
    logit_bias: tuple[tuple[int, float], ...] = _f((), "(id, bias) pairs added to the logits; -inf bans the id")
    stop_sequences: tuple[tuple[int, ...], ...] = _f((), "token-id sequences that end generation")
    stop_bytes: tuple[bytes, ...] = _f((), "byte strings that end generation (needs a token->bytes table)")

    def __post_init__(self) -> None:
        def fix(name, value):
            object.__setattr__(self, name, value)

        if isinstance(self.logit_bias, Mapping):
            fix("logit_bias", tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items())))
        fix("stop_ids", tuple(int(i) for i in self.stop_ids))
        fix("banned_ids", tuple(int(i) for i in self.banned_ids))
        fix("logit_bias", tuple((int(i), float(b)) for i, b in self.logit_bias))
        fix("stop_sequences", tuple(tuple(int(i) for i in s) for s in self.stop_sequences))
        fix("stop_bytes", tuple(s.encode() if isinstance(s, str) else bytes(s) for s in self.stop_bytes))
        real = {name: _real(getattr(self, name)) for name in (
            "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")}
        checks = (
            ("max_new_tokens", _integer(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", real["temperature"] and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", _integer(self.top_k) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", real["top_p"] and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", real["min_p"] and 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", real["repetition_penalty"] and self.repetition_penalty > 0, "a finite number > 0"),
            ("frequency_penalty", real["frequency_penalty"], "a finite number"),
            ("presence_penalty", real["presence_penalty"], "a finite number"),
            ("seed", self.seed is None or (_integer(self.seed) and -2**63 <= self.seed < 2**64),
             "None or an integer in [-2**63, 2**64)"),
            ("stop_ids", all(i >= 0 for i in self.stop_ids), "non-negative token ids"),
            ("banned_ids", all(i >= 0 for i in self.banned_ids), "non-negative token ids"),
            ("stop_sequences", all(self.stop_sequences), "non-empty"),
            ("stop_bytes", all(self.stop_bytes), "non-empty"),
        )
        for name, ok, rule in checks:
            if not ok:
                value = getattr(self, name)
                big = isinstance(value, float) and math.isfinite(value) and abs(value) > F32_MAX
                raise ValueError(f"{name} must be {rule}{' (float32 holds at most 3.4e38)' if big else ''}, "
                                 f"got {value!r}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} must be non-negative")
            if not (_real(bias) or bias == float("-inf")):
                raise ValueError(f"logit_bias for token {token} must be a finite number, or -inf to ban the "
                                 f"token, got {bias!r}")

    @property
    def greedy(self) -> bool:
        """T = 0, or a T so small (below GREEDY_BELOW) that float32 cannot divide by it: the argmax."""
        return self.temperature < GREEDY_BELOW
