"""Sharded token files: writing a split as `train-00000.bin`, `train-00001.bin`, ... of a chosen
number of tokens each, and reading them back as one sequence.

shards.py owns `ShardWriter` (appends token arrays, cutting a new file every `shard_tokens`
tokens, so a document may continue into the next shard; the list of shards is the manifest's
index) and `ShardedTokens`, a read-only view over the shards' memory maps with the two
operations the samplers use, `len()` and slicing `tokens[a:b]` (a window may cross a shard
boundary). Nothing is loaded: each slice reads only its own tokens, and the view indexes the
same tokens a single `train.bin` of the concatenation would, so batches drawn from it are
identical. It imports nothing from logitlab but the file primitives.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from logitlab.io import files

SHARD_NAME = "{split}-{index:05d}.bin"


class ShardWriter:
    """Append token arrays to `directory`/{split}-NNNNN.bin, `shard_tokens` tokens per file
    (the last may hold fewer). `close()` -> the index: [{"file", "tokens"}, ...]."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, dtype: np.dtype) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.directory, self.split, self.shard_tokens, self.dtype = Path(directory), split, shard_tokens, dtype
        self.shards: list[dict] = []
        self._handle = None
        self._room = 0

    def _open_next(self) -> None:
        self._close_current()
        name = SHARD_NAME.format(split=self.split, index=len(self.shards))
        self.shards.append({"file": name, "tokens": 0})
        self._handle = (self.directory / name).open("wb")
        self._room = self.shard_tokens

    def _close_current(self) -> None:
        if self._handle is not None:
            with files.writing(self._handle.name):
                self._handle.close()
            self._handle = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=self.dtype)
        while ids.size:
            if self._room == 0:
                self._open_next()
            piece, ids = ids[:self._room], ids[self._room:]
            with files.writing(self._handle.name):
                self._handle.write(piece.tobytes())
            self.shards[-1]["tokens"] += int(piece.size)
            self._room -= int(piece.size)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def close(self) -> list[dict]:
        self._close_current()
        return list(self.shards)


class ShardedTokens:
    """The concatenation of shard files as one read-only sequence of tokens (len, a[i], a[i:j])."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: np.dtype) -> None:
        self.dtype = np.dtype(dtype)
        kept = [(p, n) for p, n in zip(paths, sizes) if n > 0]  # an empty file cannot be mapped
        self._maps = [np.memmap(p, dtype=self.dtype, mode="r", shape=(n,)) for p, n in kept]
        self._starts = [0]
        for _, n in kept:
            self._starts.append(self._starts[-1] + n)

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[start:stop][::step]
            return self._range(start, max(start, stop))
        i = int(key)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"token index {key} out of range for {len(self)} tokens")
        k = bisect.bisect_right(self._starts, i) - 1
        return self._maps[k][i - self._starts[k]]

    def _range(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        k = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while start < stop and k < len(self._maps):
            lo, hi = self._starts[k], self._starts[k + 1]
            if start < hi:
                pieces.append(self._maps[k][start - lo:min(stop, hi) - lo])
                start = min(stop, hi)
            k += 1
        if not pieces:
            return np.zeros(0, dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None):
        whole = self._range(0, len(self))
        return whole if dtype is None else whole.astype(dtype)

    def tolist(self) -> list[int]:
        return self._range(0, len(self)).tolist()

    def __iter__(self):
        for m in self._maps:
            yield from m
