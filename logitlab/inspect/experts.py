"""Inside a mixture of experts: which experts each token of a prompt goes to, with what weight, and
how the prompt's tokens spread over each layer's experts.

`expert_routing(model, ids)` runs the model once with its layers recording (Transformer.forward's
`records`) and returns, per MoE layer, every token's K experts ordered by weight, the router's
probability of the token's first choice, and the load: how many of the prompt's T * K assignments
each expert took. A balanced router gives each expert about T * K / E of them.

Shapes: T positions, E experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ExpertRouting:
    """One MoE layer over a prompt: experts[t] the K experts token t goes to, heaviest first, with
    weights[t] their weights (what multiplies each expert's output); load[e] the assignments expert
    e took over the prompt; entropy[t] the router's entropy (nats) at token t, ln E at most;
    dropped: the share of assignments over capacity (0 when dropless)."""

    layer: int
    experts: list[list[int]]
    weights: list[list[float]]
    load: list[int]
    entropy: list[float]
    dropped: float


@torch.no_grad()
def expert_routing(model, ids: Sequence[int]) -> list[ExpertRouting]:
    """The routing of every MoE layer of `model` over the prompt `ids` (one sequence of >= 1 ids).
    ValueError when the model has no MoE layer."""
    if not model.config.is_moe:
        raise ValueError("this model has no mixture-of-experts layer (config.n_experts is 0)")
    device = next(model.parameters()).device
    x = torch.as_tensor(ids, dtype=torch.long, device=device)
    if x.ndim != 1 or x.numel() < 1:
        raise ValueError(f"ids must be one sequence of at least 1 token id, got shape {tuple(x.shape)}")
    records: list[dict] = []
    model(x[None], records=records)
    out = []
    for rec in (r for r in records if "experts" in r):
        weights, order = rec["weights"].float().sort(dim=-1, descending=True)          # (T, K)
        experts = rec["experts"].gather(-1, order)                                    # (T, K)
        logp = torch.log_softmax(rec["router_logits"].float(), dim=-1)                # (T, E)
        load = torch.bincount(experts.reshape(-1), minlength=model.config.n_experts)  # (E,)
        out.append(ExpertRouting(rec["layer"], experts.tolist(), weights.tolist(), load.tolist(),
                                 (-(logp.exp() * logp).sum(-1)).tolist(), float(rec["dropped"])))
    return out
