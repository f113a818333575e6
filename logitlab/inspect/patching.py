"""Activation patching (causal tracing) and its gradient approximation, attribution patching.

Two prompts of the same length: a clean one ("The Eiffel Tower is in" -> " Paris") and a corrupted
one that changes the answer. A metric m(logits) (a logit difference, `logit_difference`) is read on
both. Patching copies one activation at one place (a hook point at one position, or one head at all
positions) from the clean run into the corrupted run and reads m again; the restored share

    (m_patched - m_corrupt) / (m_clean - m_corrupt)

is 1 where that one activation carries everything the metric needs, 0 where it carries nothing
(Meng et al. 2022, "Locating and Editing Factual Associations in GPT"; Heimersheim and Nanda 2024,
"How to use and interpret activation patching").

`activation_patching_reference` runs one forward per patched place: the definition, as a loop.
`activation_patching` runs the same forwards as batches (variant i of a batch is the corrupted
prompt with place i patched); a test holds the two equal. `attribution_patching` (Nanda 2023;
Syed et al. 2023) replaces every forward by one backward: m_patched - m_corrupt is estimated to
first order as (a_clean - a_corrupt) . dm/da at the corrupted run, exact where m is linear in a.

Places: per="position": a hook point of shape (B, T, ...) (resid_pre, attn_out, mlp_out, ...) at each
position t; per="head": a hook point of shape (B, T, H, ...) (attn.z, attn.q, ...) for each head h at
every position.

Shapes: B batch, T positions, V vocab, H heads, N patched variants in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from logitlab.model.hooks import hooks, resolve, run_with_cache

Metric = Callable[[torch.Tensor], torch.Tensor]                   # logits (N, T, V) -> (N,)
PER = ("position", "head")


def logit_difference(token: int, other: int | None = None, position: int = -1) -> Metric:
    """logits (N, T, V) -> (N,) float32: the logit of `token` minus that of `other` (or the logit
    alone) at `position`."""
    def metric(logits: torch.Tensor) -> torch.Tensor:
        row = logits[:, position].float()                          # (N, V)
        return row[:, token] - (row[:, other] if other is not None else 0.0)
    return metric


@dataclass
class PatchingResult:
    """scores (R, C): the restored share for each hook point (rows, `names`) and each place (columns:
    positions or heads, as `per` says); clean and corrupt: the metric on the two prompts."""

    names: list[str]
    per: str
    scores: torch.Tensor
    clean: float
    corrupt: float


def _prompts(model, clean, corrupt) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    a, b = (torch.as_tensor(t, dtype=torch.long).reshape(1, -1).to(device) for t in (clean, corrupt))
    if a.shape != b.shape or a.shape[1] == 0:
        raise ValueError(f"activation patching needs a clean and a corrupted prompt of the same number of tokens, "
                         f"got {a.shape[1]} and {b.shape[1]}")
    return a, b


def _places(model, names, per: str) -> list[str]:
    if per not in PER:
        raise ValueError(f"per must be one of {PER}, got {per!r}")
    points = resolve(model, [names] if isinstance(names, str) else names)
    want = "(B, T, H" if per == "head" else "(B, T,"
    for p in points.values():
        if not p.what.startswith(want):                            # "(B, T, H" covers Hkv and Hv too
            raise ValueError(f"{p.name} is {p.what.split(')')[0]}): patching per {per} needs a hook point of "
                             f"shape {want}, ...)")
    return list(points)


def _metric_value(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    m = metric(logits)
    if not isinstance(m, torch.Tensor) or m.shape != logits.shape[:1]:
        raise ValueError(f"the metric must return one value per sequence, shape ({logits.shape[0]},), "
                         f"got {getattr(m, 'shape', type(m).__name__)}")
    return m.double()


def _baseline(model, clean, corrupt, metric, names):
    """Both runs: (clean activations, corrupt activations, m_clean, m_corrupt)."""
    clean_logits, clean_cache = run_with_cache(model, clean, names)
    corrupt_logits, corrupt_cache = run_with_cache(model, corrupt, names)
    m_clean, m_corrupt = float(_metric_value(metric, clean_logits)), float(_metric_value(metric, corrupt_logits))
    if not abs(m_clean - m_corrupt) > 1e-9:
        raise ValueError(f"the metric is the same on the clean and the corrupted prompt ({m_clean:.6g}): "
                         f"there is nothing for a patch to restore")
    return clean_cache, corrupt_cache, m_clean, m_corrupt


def _count(act: torch.Tensor, per: str) -> int:
    return act.shape[1] if per == "position" else act.shape[2]


def _patch_into(act: torch.Tensor, clean_act: torch.Tensor, places: Sequence[int], per: str) -> torch.Tensor:
    """act (N, T, ...) with variant i's place places[i] taken from clean_act (1, T, ...)."""
    out = act.clone()
    for i, place in enumerate(places):
        if per == "position":
            out[i, place] = clean_act[0, place]
        else:
            out[i, :, place] = clean_act[0, :, place]
    return out


def activation_patching_reference(model, clean, corrupt, metric: Metric, names="blocks.*.resid_pre",
                                  per: str = "position") -> PatchingResult:
    """The definition: for each hook point and place, one forward of the corrupted prompt with that
    one place patched from the clean run."""
    clean, corrupt = _prompts(model, clean, corrupt)
    names = _places(model, names, per)
    clean_cache, _, m_clean, m_corrupt = _baseline(model, clean, corrupt, metric, names)
    rows = []
    for name in names:
        row = []
        for place in range(_count(clean_cache[name], per)):
            fn = lambda t, n, p=place: _patch_into(t, clean_cache[name], [p], per)  # noqa: E731
            with torch.no_grad(), hooks(model, {name: fn}):
                row.append(float(_metric_value(metric, model(corrupt))))
        rows.append(row)
    scores = (torch.tensor(rows, dtype=torch.float64) - m_corrupt) / (m_clean - m_corrupt)
    return PatchingResult(names, per, scores, m_clean, m_corrupt)


def activation_patching(model, clean, corrupt, metric: Metric, names="blocks.*.resid_pre", per: str = "position",
                        batch_size: int = 32) -> PatchingResult:
    """activation_patching_reference's numbers, each hook point's places run as batches of up to
    batch_size patched copies of the corrupted prompt."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    clean, corrupt = _prompts(model, clean, corrupt)
    names = _places(model, names, per)
    clean_cache, _, m_clean, m_corrupt = _baseline(model, clean, corrupt, metric, names)
    rows = []
    for name in names:
        n = _count(clean_cache[name], per)
        row = []
        for start in range(0, n, batch_size):
            places = list(range(start, min(n, start + batch_size)))
            fn = lambda t, _n, ps=places: _patch_into(t, clean_cache[name], ps, per)  # noqa: E731
            with torch.no_grad(), hooks(model, {name: fn}):
                row.append(_metric_value(metric, model(corrupt.expand(len(places), -1))))
        rows.append(torch.cat(row))
    scores = (torch.stack(rows).cpu() - m_corrupt) / (m_clean - m_corrupt)
    return PatchingResult(names, per, scores, m_clean, m_corrupt)


def attribution_patching(model, clean, corrupt, metric: Metric, names="blocks.*.resid_pre",
                         per: str = "position") -> PatchingResult:
    """The first-order estimate of activation_patching from one forward and one backward of the
    corrupted prompt: restored share ~ (a_clean - a_corrupt) . dm/da / (m_clean - m_corrupt), summed
    over each place's elements."""
    clean, corrupt = _prompts(model, clean, corrupt)
    names = _places(model, names, per)
    clean_cache, corrupt_cache, m_clean, m_corrupt = _baseline(model, clean, corrupt, metric, names)
    for name in names:
        if not corrupt_cache[name].is_floating_point():
            raise ValueError(f"{name} holds integers ({corrupt_cache[name].dtype}): it has no gradient")
    # a zero leaf added at each point: its gradient is dm/da, and the graph upstream stays whole
    zeros = {n: torch.zeros_like(corrupt_cache[n], requires_grad=True) for n in names}
    with torch.enable_grad(), hooks(model, {n: (lambda t, name: t + zeros[name]) for n in names}):
        m = _metric_value(metric, model(corrupt)).sum()
        grads = torch.autograd.grad(m, [zeros[n] for n in names], allow_unused=True)
    rows = []
    for name, g in zip(names, grads):
        g = torch.zeros_like(zeros[name]) if g is None else g
        delta = ((clean_cache[name] - corrupt_cache[name]) * g).double()[0]   # (T, ...)
        per_place = delta.flatten(1).sum(1) if per == "position" else delta.transpose(0, 1).flatten(1).sum(1)
        rows.append(per_place)
    scores = torch.stack(rows).cpu() / (m_clean - m_corrupt)
    return PatchingResult(names, per, scores, m_clean, m_corrupt)
