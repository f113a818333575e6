"""From logits to the next token: SampleConfig and pure functions of logits.

sampling.py owns `SampleConfig` (frozen, validated) and the functions that turn a row of
logits into probabilities and a token id. Each is a pure function of its tensors and of a
torch.Generator passed in; nothing here runs a model (that is generate.py).

Processing order, applied to float32 logits (B, V) by `process_logits`:
  1. logit bias (added) and banned ids (set to -inf);
  2. repetition penalty over every token already in the context, prompt included, as in CTRL
     (Keskar et al. 2019) and Hugging Face: a positive logit is divided by the penalty, a negative
     one multiplied by it;
  3. frequency and presence penalties over the generated tokens (OpenAI's definition):
     logit -= frequency * count + presence * (count > 0);
  4. temperature: logits / T; T = 0 means greedy (the argmax of steps 1-3, no randomness);
  5. top-k: keep the k largest logits;
  6. softmax (max subtracted first, so it never overflows);
  7. top-p (nucleus, Holtzman et al. 2019): keep the smallest set of most probable tokens whose
     mass reaches P, renormalise;
  8. min-p: drop tokens whose probability is below min_p times the largest one, renormalise.
Sampling then draws from those probabilities with a torch.Generator passed in.

Shapes: B batch, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch


def _f(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class SampleConfig:
    """How to choose each next token and when to stop. Every field has a no-op default."""

    max_new_tokens: int = _f(64, "most tokens to generate per prompt")
    temperature: float = _f(1.0, "divide logits by T before softmax; 0 = greedy (argmax)")
    top_k: int = _f(0, "keep only the k most likely tokens (0 = off)")
    top_p: float = _f(1.0, "keep the smallest set of top tokens whose mass reaches P (1 = off)")
    min_p: float = _f(0.0, "drop tokens less likely than min_p x the top token (0 = off)")
    repetition_penalty: float = _f(1.0, "CTRL-style penalty for tokens already in the context (1 = off)")
    frequency_penalty: float = _f(0.0, "subtract this x the count of each generated token")
    presence_penalty: float = _f(0.0, "subtract this once from every token generated so far")
    seed: int | None = _f(None, "seed for the sampler's torch.Generator (None = random)")
    stop_ids: tuple[int, ...] = _f((), "token ids that end generation (besides end-of-text)")
    banned_ids: tuple[int, ...] = _f((), "token ids that are never generated")
    logit_bias: tuple[tuple[int, float], ...] = _f((), "(id, bias) pairs added to the logits")
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
        checks = (
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "an integer >= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("stop_ids", all(i >= 0 for i in self.stop_ids), "non-negative token ids"),
            ("banned_ids", all(i >= 0 for i in self.banned_ids), "non-negative token ids"),
            ("stop_sequences", all(self.stop_sequences), "non-empty"),
            ("stop_bytes", all(self.stop_bytes), "non-empty"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# --------------------------------------------------------------------------------------------
# Pure functions of logits
# --------------------------------------------------------------------------------------------

def softmax(logits: torch.Tensor) -> torch.Tensor:
    """Numerically stable softmax over the last dim, in float32: exp(x - max) / sum."""
    x = logits.float()
    x = x - x.amax(dim=-1, keepdim=True)
    e = x.exp()
    return e / e.sum(dim=-1, keepdim=True)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T for T > 0 (T = 0 is greedy and handled by the caller)."""
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, set the rest to -inf (k = 0 or k >= V: no-op).
    Ties at the k-th value are all kept."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most probable tokens whose mass reaches p.

    A token is kept when the mass of the tokens ranked above it is still below p."""
    if p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # (B, V)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the row's largest, renormalise."""
    if min_p <= 0.0:
        return probs
    kept = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL / Hugging Face rule on tokens with seen (B, V) True: positive logits / penalty,
    negative logits * penalty (both move the token towards less likely for penalty > 1)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_count_penalties(logits: torch.Tensor, counts: torch.Tensor, frequency: float,
                          presence: float) -> torch.Tensor:
    """logits - frequency * count - presence * (count > 0), counts (B, V) of generated tokens."""
    if frequency == 0.0 and presence == 0.0:
        return logits
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def bias_vector(config: SampleConfig, vocab_size: int, device=None) -> torch.Tensor | None:
    """The dense (V,) float32 additive bias for logit_bias and banned ids (-inf), or None."""
    if not config.logit_bias and not config.banned_ids:
        return None
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    for token, value in config.logit_bias:
        _check_id(token, vocab_size, "logit_bias")
        bias[token] += value
    for token in config.banned_ids:
        _check_id(token, vocab_size, "banned_ids")
        bias[token] = float("-inf")
    if torch.isinf(bias).all():
        raise ValueError("banned_ids ban every token of the vocabulary")
    return bias


def _check_id(token: int, vocab_size: int, name: str) -> None:
    if not 0 <= token < vocab_size:
        raise ValueError(f"{name}: token id {token} is outside the vocabulary 0..{vocab_size - 1}")


def adjust_logits(logits: torch.Tensor, config: SampleConfig, *, bias: torch.Tensor | None = None,
                  seen: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-3 of the order above on (B, V) logits, upcast to float32."""
    x = logits.float()
    if bias is not None:
        x = x + bias
    if seen is not None:
        x = apply_repetition_penalty(x, seen, config.repetition_penalty)
    if counts is not None:
        x = apply_count_penalties(x, counts, config.frequency_penalty, config.presence_penalty)
    return x


def process_logits(logits: torch.Tensor, config: SampleConfig, *, bias: torch.Tensor | None = None,
                   seen: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, V) -> the probabilities (B, V) float32 that sampling draws from (all 8 steps).

    At temperature 0 the result is one-hot at the greedy choice."""
    x = adjust_logits(logits, config, bias=bias, seen=seen, counts=counts)
    if config.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    x = top_k_filter(apply_temperature(x, config.temperature), config.top_k)
    return min_p_filter(top_p_filter(softmax(x), config.top_p), config.min_p)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one id per row from probs (B, V) -> (B,) int64.

    Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i (the
    smallest of independent Exp(p_i) waiting times); unlike torch.multinomial it needs no
    host synchronisation. E is clamped away from 0 (a draw of exactly 0 would turn p / E into
    inf, or NaN for p = 0, which argmax would pick), so zero-probability tokens can never win."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / e.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def next_token(logits: torch.Tensor, config: SampleConfig, generator: torch.Generator | None = None,
               **state) -> torch.Tensor:
    """Logits (B, V) -> next ids (B,): greedy argmax at T = 0, otherwise a draw from
    process_logits. `state` is bias / seen / counts as in adjust_logits."""
    if config.greedy:
        return adjust_logits(logits, config, **state).argmax(dim=-1)
    return sample(process_logits(logits, config, **state), generator)


def make_generator(seed: int | None, device=None) -> torch.Generator:
    g = torch.Generator(device=device or "cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
