"""Mixtures: several named sources with weights, up- or down-sampled by tokens.

mixture.py owns the arithmetic. `parse_mix` reads "web=0.7,code=0.3" or a TOML file with a
`[mix]` table (weights are normalised to sum to 1). Given the training tokens each source holds
after cleaning and deduplication (A_s) and the total T = sum A_s, source s is sampled at rate
r_s = w_s * T / A_s: each of its documents is written floor(r_s) times, plus once more when a
deterministic uniform number u(seed, document index) falls below the fractional part of r_s. So a
rate of 2.5 repeats every document twice and half of them a third time, and 0.3 keeps about 30%
of them. The same inputs, weights and seed always give the same documents; `realised` reports the
proportions that came out. Validation documents are never repeated or dropped by the mixture. It
imports nothing from logitlab.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np


def parse_mix(spec: str | os.PathLike | None) -> dict[str, float] | None:
    """"a=0.7,b=0.3" or a TOML file (a [mix] table, or top-level name = weight pairs) ->
    {name: weight}, normalised to sum to 1. None -> None (no mixture)."""
    if spec is None:
        return None
    text = str(spec)
    if text.endswith(".toml") or Path(text).is_file():
        import tomllib

        try:
            table = tomllib.loads(Path(text).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"mixture file {text}: {exc}") from exc
        raw = table.get("mix", table)
        if not isinstance(raw, dict):
            raise ValueError(f"mixture file {text}: [mix] must be a table of name = weight")
        pairs = list(raw.items())
    else:
        pairs = []
        for item in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = item.partition("=")
            if not eq or not name.strip():
                raise ValueError(f"mixture entry {item!r} must be NAME=WEIGHT (e.g. --mix web=0.7,code=0.3)")
            pairs.append((name.strip(), value.strip()))
    return _normalised(pairs, text)


def _normalised(pairs, where: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for name, value in pairs:
        try:
            w = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"mixture weight of {name!r} must be a number, got {value!r}") from None
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"mixture weight of {name!r} must be finite and >= 0, got {value!r}")
        if name in weights:
            raise ValueError(f"mixture names {name!r} twice ({where})")
        weights[name] = w
    total = sum(weights.values())
    if not weights or total <= 0:
        raise ValueError(f"mixture {where!r} has no positive weight")
    return {name: w / total for name, w in weights.items()}


def sampling_rates(weights: dict[str, float], available: dict[str, int]) -> dict[str, float]:
    """r_s = w_s * T / A_s for every source (T = sum of A_s over the weighted sources). Every
    source must be weighted, and a weighted source must hold tokens."""
    unknown = sorted(set(weights) - set(available))
    missing = sorted(set(available) - set(weights))
    if unknown:
        raise ValueError(f"mixture names source(s) {unknown} that the data does not have "
                         f"(sources: {sorted(available)})")
    if missing:
        raise ValueError(f"mixture gives no weight to source(s) {missing}; give each a weight (0 drops it)")
    total = sum(available.values())
    rates = {}
    for name, w in weights.items():
        if available[name] == 0 and w > 0:
            raise ValueError(f"mixture weights source {name!r} at {w:.3g}, but it holds no training tokens")
        rates[name] = w * total / available[name] if available[name] else 0.0
    return rates


def uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) determined by (seed, index) alone."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def copies(rate: float, seed: int, index: int) -> int:
    """How many times document `index` is written at sampling `rate`."""
    whole = math.floor(rate)
    return whole + (uniform(seed, index) < rate - whole)


def copies_of(rate: float, seed: int, indices: np.ndarray) -> np.ndarray:
    """`copies` for many document indices at once: (n,) int64."""
    return np.fromiter((copies(rate, seed, int(i)) for i in indices), dtype=np.int64, count=len(indices))


def realised(tokens_written: dict[str, int], weights: dict[str, float] | None) -> dict[str, dict]:
    """Per source: tokens written, their share of the total, and the weight asked for."""
    total = sum(tokens_written.values())
    return {name: {"tokens": n, "share": n / total if total else 0.0,
                   "weight": None if weights is None else weights.get(name)}
            for name, n in tokens_written.items()}
