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
  4. temperature: logits / T, each row shifted first so that its largest logit is 0 (the same
     softmax, and no overflow however small T is); T = 0 means greedy (the argmax of steps 1-3, no
     randomness), and so does any T below GREEDY_BELOW (float32's smallest normal number, about
     1.2e-38), the limit of sampling as T -> 0;
  5. top-k: keep the k largest logits;
  6. softmax (max subtracted first, so it never overflows);
  7. top-p (nucleus, Holtzman et al. 2019): keep the smallest set of most probable tokens whose
     mass reaches P (at least the most probable one), renormalise;
  8. min-p: drop tokens whose probability is below min_p times the largest one, renormalise.
Sampling then draws from those probabilities with a torch.Generator passed in.

A row whose probabilities are not a distribution (the model's logits hold NaN or inf, or every
token is excluded) never yields a token: the public functions raise SamplingError naming the row
and the cause. In the decode loop the check rides on the choice (the max that greedy takes, the
probability of the drawn token) and adds no host synchronisation: `pick` marks such a row with
the id -1, and the loop raises when it reads the ids.

Shapes: B batch, V vocab.
"""

from __future__ import annotations

import torch

from logitlab.generate.config import (  # noqa: F401  (SampleConfig's home before config.py)
    F32_MAX,
    GREEDY_BELOW,
    SampleConfig,
)


class SamplingError(RuntimeError):
    """No next token can be chosen for a row: its probabilities are not a distribution.

    `row` is the batch row, `step` the new token's index (0: the first after the prompt; None
    outside the decode loop) and `cause` says why, e.g. NaN in the model's logits."""

    def __init__(self, cause: str, row: int, step: int | None = None):
        self.cause, self.row, self.step = cause, row, step
        where = f"batch row {row}" if step is None else f"step {step} (new token {step + 1}) of batch row {row}"
        super().__init__(f"cannot choose the next token at {where}: {cause}")


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
    """(logits - row max) / T for T > 0 (T = 0 is greedy and handled by the caller).

    The shift leaves softmax and top-k unchanged and keeps a small T from overflowing: the largest
    logit becomes 0 / T = 0 and the others go towards -inf, never to inf - inf = NaN."""
    if temperature == 1.0:
        return logits
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, set the rest to -inf (k = 0 or k >= V: no-op).
    Ties at the k-th value are all kept."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most probable tokens whose mass reaches p.

    A token is kept when the mass of the tokens ranked above it is still below p; the most
    probable token always is (its mass before is 0), also for a p that float32 rounds to 0, such
    as 1e-300: the limit of nucleus sampling as p -> 0 is the top token, as T -> 0 is greedy."""
    if p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # (B, V)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False  # 0 >= p holds when p underflows to 0 in float32
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
        raise ValueError("banned_ids and -inf logit_bias values ban every token of the vocabulary")
    over = torch.isposinf(bias).nonzero()
    if len(over):
        raise ValueError(f"logit_bias values for token {int(over[0])} add up to +inf in float32")
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


def _probabilities(x: torch.Tensor, config: SampleConfig) -> torch.Tensor:
    """Steps 4-8 on adjusted logits (B, V), unchecked; one-hot at the argmax when greedy."""
    if config.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    x = top_k_filter(apply_temperature(x, config.temperature), config.top_k)
    return min_p_filter(top_p_filter(softmax(x), config.top_p), config.min_p)


def process_logits(logits: torch.Tensor, config: SampleConfig, *, bias: torch.Tensor | None = None,
                   seen: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, V) -> the probabilities (B, V) float32 that sampling draws from (all 8 steps).

    At temperature 0 the result is one-hot at the greedy choice. Raises SamplingError for a row
    with no distribution (NaN or +inf in the logits, or every token excluded), as `pick` does."""
    state = dict(bias=bias, seen=seen, counts=counts)
    x = adjust_logits(logits, config, **state)
    _raise_unless(torch.isfinite(x.amax(dim=-1)), logits, config, None, state)  # NaN, +inf or all -inf
    return _probabilities(x, config)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / e.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one id per row from probs (B, V) -> (B,) int64.

    Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i (the
    smallest of independent Exp(p_i) waiting times); unlike torch.multinomial it needs no
    host synchronisation. E is clamped away from 0 (a draw of exactly 0 would turn p / E into
    inf, or NaN for p = 0, which argmax would pick), so zero-probability tokens can never win.
    A row that is not a distribution (NaN, inf, a negative value, no positive mass) raises
    SamplingError."""
    ids = _draw(probs, generator)
    ok = ((probs >= 0) & (probs < float("inf"))).all(dim=-1) & (probs.gather(-1, ids[:, None])[:, 0] > 0)
    if not bool(ok.all()):
        row = int((~ok).nonzero()[0])
        raise SamplingError("the probabilities are not a distribution (NaN, inf, negative, or no positive mass)",
                            row)
    return ids


def pick(logits: torch.Tensor, config: SampleConfig, generator: torch.Generator | None = None,
         **state) -> torch.Tensor:
    """next_token without its check or host synchronisation: ids (B,), and -1 for a row with no
    distribution to choose from (see invalid_cause). For a loop that reads the ids anyway.

    The check rides on the choice itself: a NaN or +inf logit, from the model or the settings,
    reaches the adjusted logits (bias, penalties and where() keep it), whose max is then NaN or
    inf, and makes the whole softmax NaN; every token at -inf leaves a max of -inf, or no
    probability. A model's -inf on some tokens (they can never be chosen) passes."""
    x = adjust_logits(logits, config, **state)
    if config.greedy:
        top, ids = x.max(dim=-1)  # one pass, as argmax
        ok = torch.isfinite(top)
    else:
        probs = _probabilities(x, config)
        ids = _draw(probs, generator)
        ok = probs.gather(-1, ids[:, None])[:, 0] > 0  # False for NaN
    return ids.masked_fill(~ok, -1)


def next_token(logits: torch.Tensor, config: SampleConfig, generator: torch.Generator | None = None,
               *, step: int | None = None, **state) -> torch.Tensor:
    """Logits (B, V) -> next ids (B,): greedy argmax at T = 0, otherwise a draw from
    process_logits. `state` is bias / seen / counts as in adjust_logits. A row with no
    distribution raises SamplingError (`step`, when given, is named in it)."""
    ids = pick(logits, config, generator, **state)
    _raise_unless(ids >= 0, logits, config, step, state)
    return ids


def _raise_unless(ok: torch.Tensor, logits: torch.Tensor, config: SampleConfig, step: int | None,
                  state: dict) -> None:
    if not bool(ok.all()):
        row = int((~ok).nonzero()[0])
        raise SamplingError(invalid_cause(logits, row, config, **state), row, step)


MODEL_CAUSE = "check the weights and the model config, e.g. norm_eps"


def invalid_cause(logits: torch.Tensor, row: int, config: SampleConfig, *, bias: torch.Tensor | None = None,
                  seen: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> str:
    """Why row `row` of logits (B, V) gives no distribution: the model's logits, the logit bias
    and penalties, or every token excluded. The slow path, after a check failed."""
    raw = logits[row:row + 1].float()  # (1, V)
    nan, inf = int(raw.isnan().sum()), int(raw.isposinf().sum())
    if nan or inf:
        found = " and ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "+inf")) if n)
        return f"the model's logits contain {found} values of {raw.shape[-1]} ({MODEL_CAUSE})"
    if raw.isneginf().all():
        return f"the model's logits are all -inf ({MODEL_CAUSE})"
    x = adjust_logits(raw, config, bias=bias, seen=None if seen is None else seen[row:row + 1],
                      counts=None if counts is None else counts[row:row + 1])
    if x.isnan().any() or x.isposinf().any():
        return ("logit_bias and the repetition/frequency/presence penalties turned a logit into NaN or +inf "
                "(use smaller values)")
    if x.isneginf().all():
        return "every token is excluded by banned_ids, -inf logit_bias values and the penalties"
    return "temperature/top-k/top-p/min-p left no token with a positive probability"


def make_generator(seed: int | None, device=None) -> torch.Generator:
    g = torch.Generator(device=device or "cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
