"""Linear probes over any hook point, with the shuffled-label control built in.

A probe asks whether an activation "knows" a property: a logistic regression (one linear map to
C classes) is fitted on the activations of some positions and scored on positions it was not fitted
on. Accuracy alone says little (a wide activation separates almost anything), so every probe is
reported beside the same probe fitted on shuffled labels (the control: what the probe learns from
nothing; Hewitt and Liang 2019, "Designing and Interpreting Probes with Control Tasks") and the
majority-class share.

Shapes: N labelled positions, D the activation's width (its trailing dimensions flattened), C classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from logitlab.model.hooks import resolve, run_with_cache


@dataclass
class ProbeResult:
    """Test accuracy of the probe, of its shuffled-label control and of always answering the most
    common training class, on n_test held-out positions (fitted on n_train)."""

    name: str
    accuracy: float
    control: float
    majority: float
    n_train: int
    n_test: int


def probe_features(model, prompts: Sequence[Sequence[int]], labels: Sequence, name: str):
    """(X (N, D) float32, y (N,) long): the hook point's activation at every labelled position.
    labels[i] is one int per token of prompts[i] (-1: skip that position) or one int for the prompt
    (read at its last position)."""
    point = resolve(model, [name])
    if len(point) != 1 or not next(iter(point.values())).what.startswith("(B, T,"):
        raise ValueError(f"a probe reads one hook point of shape (B, T, ...), got {name!r}")
    if len(prompts) != len(labels) or not prompts:
        raise ValueError(f"{len(prompts)} prompts but {len(labels)} label entries")
    xs, ys = [], []
    for ids, lab in zip(prompts, labels):
        act = run_with_cache(model, list(ids), [name])[1][name][0].float().flatten(1)   # (T, D)
        lab = [-1] * (len(ids) - 1) + [lab] if isinstance(lab, int) else list(lab)
        if len(lab) != len(ids):
            raise ValueError(f"a prompt of {len(ids)} tokens has {len(lab)} labels")
        y = torch.tensor(lab, dtype=torch.long)
        xs.append(act[y >= 0])
        ys.append(y[y >= 0])
    return torch.cat(xs).cpu(), torch.cat(ys)


def fit_probe(X: torch.Tensor, y: torch.Tensor, n_classes: int, steps: int = 300, lr: float = 0.05,
              weight_decay: float = 1e-3) -> torch.Tensor:
    """Logistic regression on standardised X: -> W (D + 1, C), the last row the bias."""
    Xb = torch.cat([X, torch.ones(len(X), 1)], dim=1)              # (N, D + 1)
    W = torch.zeros(Xb.shape[1], n_classes, requires_grad=True)
    optimizer = torch.optim.Adam([W], lr=lr)
    for _ in range(steps):
        loss = F.cross_entropy(Xb @ W, y) + weight_decay * W[:-1].pow(2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return W.detach()


def _accuracy(W: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> float:
    return float(((torch.cat([X, torch.ones(len(X), 1)], dim=1) @ W).argmax(-1) == y).float().mean())


def linear_probe(model, prompts: Sequence[Sequence[int]], labels: Sequence, name: str, test_share: float = 0.25,
                 seed: int = 0, steps: int = 300) -> ProbeResult:
    """Fit a probe for `labels` on the hook point `name` over `prompts` (see probe_features), on a
    seeded random (1 - test_share) of the positions; score it, its shuffled-label control and the
    majority class on the rest."""
    if not 0 < test_share < 1:
        raise ValueError(f"test_share must be in (0, 1), got {test_share!r}")
    X, y = probe_features(model, prompts, labels, name)
    n_test = int(round(len(y) * test_share))
    if n_test < 1 or len(y) - n_test < 2:
        raise ValueError(f"{len(y)} labelled positions are too few to fit on some and test on the others")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    train, test = order[n_test:], order[:n_test]
    mean, std = X[train].mean(0), X[train].std(0).clamp_min(1e-6)
    X = (X - mean) / std
    C = int(y.max()) + 1
    W = fit_probe(X[train], y[train], C, steps)
    shuffled = y[torch.randperm(len(y), generator=g)]              # labels with no relation to X
    W_control = fit_probe(X[train], shuffled[train], C, steps)
    majority = float((y[test] == torch.bincount(y[train], minlength=C).argmax()).float().mean())
    return ProbeResult(name, _accuracy(W, X[test], y[test]), _accuracy(W_control, X[test], shuffled[test]),
                       majority, len(train), n_test)
