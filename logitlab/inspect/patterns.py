"""Attention patterns: who each head reads, and scores for the two patterns a small model learns
first (Olsson et al. 2022, "In-context learning and induction heads").

- `attention_patterns`: per attention layer, the (H, T, T) weights of a prompt, from the model's
  eager path (Transformer.forward_with_attention), so every row sums to 1 (less with sink logits)
  and masked keys have weight exactly 0. The other inspectors that read weights start from it.
- `previous_token_scores`: per head, the mean weight of query t on key t - 1.
- `induction_scores`: per head, the mean weight of each query that repeats an earlier token on
  the key just after that earlier occurrence: on "A B ... A" an induction head at the second A
  reads B, the token that came next last time, and so predicts it. On a random sequence repeated
  twice the queries are the second copy's and the key of query t is t - N + 1 (N the copy length).

Shapes: L layers, H heads, T positions (query t, key s).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def prompt_ids(model, ids) -> torch.Tensor:
    """One sequence of at least 2 token ids as (1, T) int64 on the model's device."""
    device = next(model.parameters()).device
    t = torch.as_tensor(ids, dtype=torch.long, device=device)
    if t.ndim != 1 or t.numel() < 2:
        raise ValueError(f"ids must be one sequence of at least 2 token ids, got shape {tuple(t.shape)}")
    return t[None]                                                          # (1, T)


@torch.no_grad()
def attention_patterns(model, ids: Sequence[int]) -> dict[int, torch.Tensor]:
    """{layer: weights (H, T, T) float32 on the CPU} for every attention layer of the model over the
    prompt `ids`; weights[h, t, s] is how much head h's query at t reads key s. Gated DeltaNet
    layers have no weights and no entry. The model runs its eager path whatever attn_impl is."""
    x = prompt_ids(model, ids)
    _, weights = model.forward_with_attention(x)                            # L x (1, H, T, T) or None
    return {layer: w[0].float().cpu() for layer, w in enumerate(weights) if w is not None}


def previous_token_scores(patterns: Mapping[int, torch.Tensor]) -> dict[int, list[float]]:
    """{layer: [score per head]}: the mean weight of queries 1..T-1 on the key just before them."""
    out = {}
    for layer, w in patterns.items():
        H, T, _ = _check(w, layer)
        t = torch.arange(1, T)
        out[layer] = w[:, t, t - 1].mean(dim=1).tolist()                    # (H, T-1) -> (H,)
    return out


def induction_targets(ids: Sequence[int]) -> list[tuple[int, int]]:
    """(query t, key s) pairs: every t whose token occurred before, and s = j + 1 for j < t the most
    recent earlier position holding the same token (the token that followed it last time)."""
    last: dict[int, int] = {}
    pairs = []
    for t, token in enumerate(map(int, ids)):
        if token in last:
            pairs.append((t, last[token] + 1))
        last[token] = t
    return pairs


def induction_scores(patterns: Mapping[int, torch.Tensor], ids: Sequence[int]) -> dict[int, list[float]]:
    """{layer: [score per head]}: the mean weight each query that repeats an earlier token puts on
    the key after that token's previous occurrence (induction_targets). 1 is a perfect induction
    head; a head spreading its weight evenly scores about 1 / (t + 1). ValueError when no token of
    `ids` repeats (there is nothing to induce)."""
    pairs = induction_targets(ids)
    if not pairs:
        raise ValueError("induction_scores needs a prompt in which some token repeats; no token of these "
                         f"{len(ids)} ids occurs twice")
    q = torch.tensor([t for t, _ in pairs])
    k = torch.tensor([s for _, s in pairs])
    out = {}
    for layer, w in patterns.items():
        H, T, _ = _check(w, layer)
        if T != len(ids):
            raise ValueError(f"layer {layer}: the pattern covers {T} positions but ids has {len(ids)}")
        out[layer] = w[:, q, k].mean(dim=1).tolist()                        # (H, pairs) -> (H,)
    return out


def best_head(scores: Mapping[int, Sequence[float]]) -> tuple[int, int, float]:
    """(layer, head, score) of the highest score in {layer: [score per head]}."""
    if not scores or not any(len(v) for v in scores.values()):
        raise ValueError("best_head needs at least one layer with scores")
    return max(((layer, h, s) for layer, row in scores.items() for h, s in enumerate(row)), key=lambda x: x[2])


def _check(w: torch.Tensor, layer: int) -> tuple[int, int, int]:
    if w.ndim != 3 or w.shape[1] != w.shape[2] or w.shape[1] < 2:
        raise ValueError(f"layer {layer}: expected attention weights (H, T, T) with T >= 2, got {tuple(w.shape)}")
    return tuple(w.shape)
