"""Batches: the last step of "corpus -> token files -> batches", the windows that training and
evaluation read from a token file (tokens.load_tokens).

batches.py owns `RandomWindows`, which draws B random windows of T+1 tokens and returns inputs
x (B, T) int64 and targets y (B, T) = x shifted by one (teacher forcing). Batch number i is drawn
from a generator seeded with (seed, i), so the sampler's whole state is one counter: resuming is
setting it. With world_size > 1 each rank takes its own slice of the same global batch, so the
global batch does not depend on the number of ranks. `eval_windows` is the sequential pass used
for validation: the same tokens every time. It imports nothing from logitlab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

IGNORE_INDEX = -100  # a target the loss leaves out (train.loss.IGNORE_INDEX, F.cross_entropy's default)


@dataclass
class RandomWindows:
    """Random windows of T+1 tokens -> (x, y), deterministic in (seed, batch index).

    `batch_size` is the GLOBAL batch; rank r of world_size takes rows [r·b, (r+1)·b) with
    b = batch_size // world_size. `state_dict()` / `load_state_dict()` hold the batch counter."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.seq_len <= 0 or self.batch_size <= 0:
            raise ValueError(f"seq_len ({self.seq_len}) and batch_size ({self.batch_size}) must be > 0")
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(f"token file holds {len(self.tokens)} tokens, fewer than seq_len + 1 "
                             f"= {self.seq_len + 1}; use more data or a shorter seq_len")
        if self.batch_size % self.world_size or not 0 <= self.rank < self.world_size:
            raise ValueError(f"batch_size ({self.batch_size}) must divide by world_size "
                             f"({self.world_size}) and 0 <= rank ({self.rank}) < world_size")

    def offsets(self, index: int) -> np.ndarray:
        """Start offsets of global batch `index` (all ranks)."""
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def next(self):
        """The next (x, y), each (b, T) int64 on CPU, and advance the counter."""
        b = self.batch_size // self.world_size
        starts = self.offsets(self.index)[self.rank * b:(self.rank + 1) * b]
        self.index += 1
        return windows_to_batch(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "index": self.index, "batch_size": self.batch_size, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this run has {getattr(self, key)}")
        self.index = int(state["index"])


def windows_to_batch(tokens: np.ndarray, starts: Iterable[int], seq_len: int):
    """Windows tokens[s : s+T+1] -> x (B, T) int64, y (B, T) int64 with y[:, t] = x[:, t+1]'s token."""
    import torch

    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])  # (B, T+1)
    full = torch.from_numpy(rows)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int | None = None,
                 rank: int = 0, world_size: int = 1):
    """The sequential evaluation pass: non-overlapping windows at 0, T, 2T, ... covering up to
    `max_tokens` targets, yielded as (x, y) batches of at most batch_size rows. Rank r takes
    windows r, r + world_size, ... . Always the same tokens for the same arguments.

    Every rank yields the same number of batches, rank 0's (which has the most windows): a
    sharded model's forward is a collective (FSDP2 gathers each layer's weights from the other
    ranks), so a rank that ran one batch fewer would leave the others waiting in that gather
    until the timeout. A rank whose share ends a batch early yields one more: window 0 with every
    target IGNORE_INDEX, which adds nothing to a loss summed with that ignore_index (torch's
    cross_entropy default) nor to a count of the targets that are not IGNORE_INDEX."""
    import torch

    n_windows = (len(tokens) - 1) // seq_len
    if max_tokens is not None:
        n_windows = min(n_windows, max(1, max_tokens // seq_len))
    starts = [i * seq_len for i in range(rank, n_windows, world_size)]
    for i in range(0, len(starts), batch_size):
        yield windows_to_batch(tokens, starts[i:i + batch_size], seq_len)
    most = len(range(0, n_windows, world_size))                    # rank 0's windows
    if _n_batches(len(starts), batch_size) < _n_batches(most, batch_size):  # one batch short at most
        x, y = windows_to_batch(tokens, [0], seq_len)
        yield x, torch.full_like(y, IGNORE_INDEX)                 # x and y may share one row's storage


def _n_batches(n_rows: int, batch_size: int) -> int:
    return -(-n_rows // batch_size)
