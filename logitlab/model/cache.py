"""The key/value cache for incremental decoding: preallocated per layer, advanced explicitly.

kv_cache.py owns the memory that holds past keys and values: one (B, Hkv, S_max, Dh) tensor
for keys and one for values per layer, allocated once. A forward pass writes the new positions
into slots [length, length + T) of each layer with `update` (a slice assignment, no new
allocation) and reads the views over [0, length + T). The model calls `advance(T)` once, at
the end of its forward, so `length` only changes in that one visible place. Only Hkv heads are
stored: grouped-query attention shrinks the cache by G = H // Hkv.

This module imports nothing of logitlab; `for_model` reads the config fields it needs.
"""

from __future__ import annotations

import torch


class KVCache:
    """k[i], v[i]: (B, Hkv, S_max, Dh) for layer i; `length` slots [0, length) are filled."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("max_len", max_len), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVCache: {name} must be a positive integer, got {value!r}")
        self.n_layers, self.batch_size, self.n_kv_heads = n_layers, batch_size, n_kv_heads
        self.max_len, self.head_dim = max_len, head_dim
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int | None = None, dtype=None,
                  device=None) -> "KVCache":
        """A cache shaped for `config` (a ModelConfig, or a model with a `.config`).

        max_len defaults to config.context_length. dtype/device default to those of the model's
        parameters when a model is given, else float32 on the default device."""
        model = None
        if hasattr(config, "config") and hasattr(config, "parameters"):
            model, config = config, config.config
        if model is not None:
            param = next(model.parameters())
            dtype = param.dtype if dtype is None else dtype
            device = param.device if device is None else device
        max_len = config.context_length if max_len is None else max_len
        if max_len > config.context_length:
            raise ValueError(f"KVCache: max_len ({max_len}) exceeds the model's context_length "
                             f"({config.context_length})")
        return cls(config.n_layers, batch_size, config.n_kv_heads, max_len, config.head_dim,
                   dtype=torch.float32 if dtype is None else dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held by all keys and values: 2 * L * B * Hkv * S_max * Dh * itemsize."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def update(self, layer: int, k_new: torch.Tensor,
               v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k_new, v_new (B, Hkv, T, Dh) into slots [length, length + T) of `layer`.

        Returns views (B, Hkv, S, Dh) over slots [0, S), S = length + T. `length` is NOT moved
        here (every layer writes at the same slots); the model calls `advance(T)` after the
        last layer."""
        T = k_new.shape[2]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise ValueError(f"KVCache is full: writing {T} position(s) at length {start} would pass "
                             f"max_len ({self.max_len})")
        if k_new.shape != (self.batch_size, self.n_kv_heads, T, self.head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"KVCache.update: k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} do "
                             f"not fit the cache (B={self.batch_size}, Hkv={self.n_kv_heads}, Dh={self.head_dim})")
        k, v = self.k[layer], self.v[layer]
        k[:, :, start:end] = k_new
        v[:, :, start:end] = v_new
        return k[:, :, :end], v[:, :, :end]

    def advance(self, n: int) -> None:
        """Mark n more slots as filled (called once per forward, by the model)."""
        if self.length + n > self.max_len:
            raise ValueError(f"KVCache.advance({n}) at length {self.length} passes max_len ({self.max_len})")
        self.length += n

    def reset(self) -> None:
        """Forget every position (the memory is kept and overwritten by the next prefill)."""
        self.length = 0

    def __repr__(self) -> str:
        return (f"KVCache(L={self.n_layers}, B={self.batch_size}, Hkv={self.n_kv_heads}, "
                f"S_max={self.max_len}, Dh={self.head_dim}, length={self.length}, dtype={self.dtype}, "
                f"{self.nbytes / 2**20:.1f} MiB)")
