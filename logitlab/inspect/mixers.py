"""Inside the token mixers: attention sinks and the Gated DeltaNet state, made visible.

- `sink_shares`: the share of its attention each head puts on position 0 and on the first k
  positions, per attention layer, averaged over the queries. Trained models park much of their
  attention on the first token whatever it is (Xiao et al. 2023): the "attention sink" that
  StreamingLLM keeps in its cache.
- `linear_trace`: for every Gated DeltaNet layer, the decay a_t = exp(g_t) and the learning
  rate beta_t per head and position, and the norm of each head's state S_t after position t.

Shapes: L layers, H heads (Hv value heads for Gated DeltaNet), T positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from logitlab.inspect.patterns import attention_patterns, prompt_ids
from logitlab.model.deltanet import gated_delta_rule_reference


@dataclass(frozen=True)
class SinkShares:
    """layer: its index; first[h]: the mean weight of query positions on key 0 (queries 1..T-1,
    since position 0 can only read itself); first_k[h]: on keys 0..k-1 (queries k..T-1)."""

    layer: int
    first: list[float]
    first_k: list[float]
    k: int


@torch.no_grad()
def sink_shares(model, ids: Sequence[int], k: int = 4) -> list[SinkShares]:
    """Per attention layer and head, the share of attention on position 0 and on the first k.

    The weights are patterns.attention_patterns' (the eager path), so each row sums to 1 (less
    with learned sink logits, whose share goes nowhere). Gated DeltaNet layers have no weights
    and are skipped."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    T = prompt_ids(model, ids).shape[1]
    if k >= T:
        raise ValueError(f"k ({k}) must be smaller than the number of tokens ({T})")
    out = []
    for layer, w in attention_patterns(model, ids).items():               # (H, T, T) per attention layer
        first = w[:, 1:, 0].mean(dim=1)                                     # (H,)
        first_k = w[:, k:, :k].sum(dim=-1).mean(dim=1)                      # (H,)
        out.append(SinkShares(layer, first.tolist(), first_k.tolist(), k))
    return out


@dataclass(frozen=True)
class LinearTrace:
    """One Gated DeltaNet layer over a prompt: decay[t][h] = a_t = exp(g_t) (1: keep everything,
    0: forget), beta[t][h] the delta rule's learning rate, state_norm[t][h] = ||S_t|| (Frobenius)."""

    layer: int
    decay: list[list[float]]
    beta: list[list[float]]
    state_norm: list[list[float]]


@torch.no_grad()
def linear_trace(model, ids: Sequence[int]) -> list[LinearTrace]:
    """The decay, beta and state norm per head and position of every Gated DeltaNet layer
    (an empty list for a model without one)."""
    x = prompt_ids(model, ids)
    records: list[dict] = []
    model._run(x, None, None, None, records=records)
    traces = []
    for rec in records:
        layer = model.blocks[rec["layer"]].linear_attn
        norms = _state_norms(layer, rec)                                    # (T, Hv)
        traces.append(LinearTrace(rec["layer"], rec["g"][0].exp().tolist(), rec["beta"][0].tolist(),
                                  norms.tolist()))
    return traces


def _state_norms(layer, rec: dict) -> torch.Tensor:
    """||S_t|| per position and head, by running the reference rule one position at a time on the
    layer's own q, k, v (recorded by its forward)."""
    q, k, v = rec["q"], rec["k"], rec["v"]                                  # (1, T, Hv, Dk|Dv)
    T = q.shape[1]
    state = None
    norms = []
    for t in range(T):
        sl = slice(t, t + 1)
        _, state = gated_delta_rule_reference(q[:, sl], k[:, sl], v[:, sl], rec["g"][:, sl], rec["beta"][:, sl], state)
        norms.append(state[0].flatten(1).norm(dim=-1))                      # (Hv,)
    return torch.stack(norms)                                               # (T, Hv)
