"""Seeing inside a model: what it predicted at every position and at every layer.

introspect.py owns the "look inside" views of a trained model, each a plain function that
returns plain data (dataclasses and lists) for the CLI to format or print as JSON:
  - per-token surprisal: the probability the model gave each actual token, -ln p in nats and
    bits, their total and mean (the cross-entropy) and the perplexity exp(mean);
  - next-token tables: the top tokens at one position with the raw logit, softmax(logits) (the
    model) and the distribution the sampler draws from after its settings;
  - the logit lens (nostalgebraist 2020): the final norm and LM head applied to each block's
    output, showing what the model would predict if it stopped at that layer;
  - embedding neighbours: the tokens whose embedding rows are most cosine-similar.
It works on ids; `token_text` (id -> str), when given, only labels rows. Parameter, FLOP and
memory accounting live in accounting.py.

Shapes: B batch, T positions, D d_model, V vocab, L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from logitlab.generate.sampling import MODEL_CAUSE, SampleConfig, bias_vector, process_logits, softmax

TokenText = Callable[[int], str] | None


def _label(token_text: TokenText, token: int) -> str | None:
    return token_text(token) if token_text is not None else None


def _ids_tensor(model, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)  # (1, T)
    if ids.shape[1] == 0:
        raise ValueError("need at least one token id")
    return ids.to(next(model.parameters()).device)


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (how many candidates to list) must be an integer >= 1, got {k!r}")


def _check_finite(logits: torch.Tensor, what: str = "the model's logits") -> torch.Tensor:
    """logits (..., T, V) unchanged, or a RuntimeError naming the first position with NaN or inf."""
    bad = ~torch.isfinite(logits).all(dim=-1)  # (..., T)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, -1])
        raise RuntimeError(f"{what} at position {position} contain NaN or inf ({MODEL_CAUSE})")
    return logits


def _position(position: int, T: int) -> int:
    if not -T <= position < T:
        raise ValueError(f"position {position} is outside the {T} tokens of the text (0..{T - 1}, or -{T}..-1 "
                         f"counting from the end)")
    return position % T


# --------------------------------------------------------------------------------------------
# Surprisal and perplexity
# --------------------------------------------------------------------------------------------

@dataclass
class TokenScore:
    """One token of the text. probability is None for the first token (nothing predicts it)."""

    position: int
    id: int
    text: str | None
    probability: float | None
    surprisal_nats: float | None
    surprisal_bits: float | None


@dataclass
class SurprisalReport:
    tokens: list[TokenScore]
    scored: int             # tokens with a prediction (all but the first)
    total_nats: float       # sum of -ln p
    mean_nats: float        # cross-entropy per token
    mean_bits: float
    perplexity: float       # exp(mean_nats)


def summarize(probabilities: Sequence[float]) -> tuple[float, float, float]:
    """Per-token probabilities -> (total nats, mean nats, perplexity).

    Worked example: [0.04, 0.01, 0.20, 0.30, 0.10] -> 12.94 nats, 2.588 per token, 13.3."""
    if len(probabilities) == 0:
        raise ValueError("need at least one probability")
    if any(not 0 < p <= 1 for p in probabilities):
        raise ValueError(f"probabilities must be in (0, 1], got {list(probabilities)}")
    total = -sum(math.log(p) for p in probabilities)
    mean = total / len(probabilities)
    return total, mean, math.exp(mean)


def token_surprisals(model, ids: Sequence[int], token_text: TokenText = None) -> SurprisalReport:
    """Score every token of `ids` (T >= 2) under the model in one forward pass."""
    x = _ids_tensor(model, ids)
    T = x.shape[1]
    if T < 2:
        raise ValueError("need at least two tokens to score (the first one has no prediction)")
    with torch.no_grad():
        logp = torch.log_softmax(_check_finite(model(x)[0].float()), dim=-1)  # (T, V)
    targets = x[0, 1:]  # (T-1,) token t+1 is predicted at position t
    nats = (-logp[:-1].gather(-1, targets[:, None])[:, 0]).tolist()
    ids_list = x[0].tolist()
    rows = [TokenScore(0, ids_list[0], _label(token_text, ids_list[0]), None, None, None)]
    for t, n in enumerate(nats, start=1):
        rows.append(TokenScore(t, ids_list[t], _label(token_text, ids_list[t]), math.exp(-n), n,
                               n / math.log(2)))
    total = sum(nats)
    mean = total / len(nats)
    return SurprisalReport(rows, len(nats), total, mean, mean / math.log(2), math.exp(mean))


# --------------------------------------------------------------------------------------------
# Next-token tables
# --------------------------------------------------------------------------------------------

@dataclass
class Candidate:
    id: int
    text: str | None
    probability: float


@dataclass
class NextCandidate:
    """One candidate next token, three ways: the model's raw `logit`, `model_probability` =
    softmax(logits) (what the model says), and `sampler_probability`, the distribution the sampler
    draws from after temperature / top-k / top-p / min-p (0 for a token the settings cut).
    `probability` is the one its list is ranked by: model_probability in `before`,
    sampler_probability in `after`."""

    id: int
    text: str | None
    probability: float
    logit: float
    model_probability: float
    sampler_probability: float


@dataclass
class NextTokenTable:
    """The k most likely next tokens after `position`, ranked by the model (before) and by the
    sampler's distribution (after); `kept` tokens have a non-zero probability after the settings."""

    position: int
    before: list[NextCandidate]
    after: list[NextCandidate]
    kept: int
    settings: dict = field(default_factory=dict)


def next_token_table(model, ids: Sequence[int], position: int = -1, config: SampleConfig = SampleConfig(),
                     k: int = 10, token_text: TokenText = None) -> NextTokenTable:
    """Top-k of the raw softmax and of process_logits (temperature / top-k / top-p / min-p, plus
    bias and banned ids) at one position: the prediction for the token after ids[position]; each
    row carries the logit and both probabilities."""
    _check_k(k)
    x = _ids_tensor(model, ids)
    pos = _position(position, x.shape[1])
    with torch.no_grad():
        logits = model(x[:, :pos + 1])[:, -1].float()  # (1, V)
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"the model's logits at position {pos} contain NaN or inf ({MODEL_CAUSE})")
    raw = softmax(logits)[0]  # (V,)
    processed = process_logits(logits, config, bias=bias_vector(config, logits.shape[-1]))[0]  # (V,)

    def top(p: torch.Tensor) -> list[NextCandidate]:
        values, order = torch.topk(p, min(k, p.shape[-1]))
        return [NextCandidate(i, _label(token_text, i), v, float(logits[0, i]), float(raw[i]), float(processed[i]))
                for v, i in zip(values.tolist(), order.tolist()) if v > 0]

    settings = dict(temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                    min_p=config.min_p)
    return NextTokenTable(pos, top(raw), top(processed), int((processed > 0).sum()), settings)


# --------------------------------------------------------------------------------------------
# Logit lens
# --------------------------------------------------------------------------------------------

def lens_logits(model, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Logits (L+1, T, V) float32 read from every hidden state of one text.

    Entry 0 is the embedding output, entry i the output of block i, each through the final norm
    and the LM head (model.unembed). The last entry is the model's own logits: as in
    transformers' output_hidden_states, the last hidden state already has the final norm
    applied, so it goes through the head alone rather than being normed twice."""
    x = _ids_tensor(model, ids)
    with torch.no_grad():
        logits, hidden = model.forward_with_hidden(x)  # hidden: L+1 x (1, T, D)
        layers = [model.unembed(h)[0].float() for h in hidden[:-1]]  # L x (T, V)
    _check_finite(logits[0].float())
    return torch.stack(layers + [logits[0].float()])


@dataclass
class LensEntry:
    """What the model would predict at one position if it stopped after `layer` (0 = the
    embeddings, L = the full model)."""

    layer: int
    top: list[Candidate]
    target_probability: float | None = None  # probability of the actual next token, if known


def logit_lens(model, ids: Sequence[int], position: int = -1, k: int = 1,
               token_text: TokenText = None) -> list[LensEntry]:
    """Top-k predictions at `position` for every layer; the actual next token's probability too
    when the text continues past `position`."""
    _check_k(k)
    x = _ids_tensor(model, ids)
    T = x.shape[1]
    pos = _position(position, T)
    probs = softmax(lens_logits(model, x)[:, pos])  # (L+1, V)
    target = int(x[0, pos + 1]) if pos + 1 < T else None
    entries = []
    for layer, p in enumerate(probs):
        values, order = torch.topk(p, min(k, p.shape[-1]))
        top = [Candidate(i, _label(token_text, i), v) for v, i in zip(values.tolist(), order.tolist())]
        entries.append(LensEntry(layer, top, None if target is None else float(p[target])))
    return entries


# --------------------------------------------------------------------------------------------
# Embedding neighbours
# --------------------------------------------------------------------------------------------

@dataclass
class Neighbour:
    id: int
    text: str | None
    cosine: float


def embedding_neighbours(model, token_id: int, k: int = 10, token_text: TokenText = None) -> list[Neighbour]:
    """The k tokens whose rows of the input embedding table (V, D) are most cosine-similar to
    `token_id`'s row (the token itself excluded; padded vocabulary rows never appear)."""
    _check_k(k)
    V = model.config.vocab_size
    if not 0 <= token_id < V:
        raise ValueError(f"token id {token_id} is outside the vocabulary 0..{V - 1}")
    with torch.no_grad():
        table = model.tok_emb.weight[:V].float()  # (V, D)
        unit = table / table.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        cos = unit @ unit[token_id]  # (V,)
        cos[token_id] = float("-inf")
        values, order = torch.topk(cos, min(k, V - 1))
    return [Neighbour(i, _label(token_text, i), v) for v, i in zip(values.tolist(), order.tolist())]
