"""The cache for incremental decoding: one entry per layer, of the layer's kind, advanced explicitly.

cache.py owns the memory that holds what past positions left behind. A forward pass hands each
layer's new keys and values (or state) to its entry and the model calls `advance(T)` once, at the
end of its forward, so `length` only changes in that one visible place. The entries:

- FullKV (full attention): preallocated (B, Hkv, S_max, Dh) keys and values; new positions go to
  slots [length, length + T) (a slice assignment, no new allocation). Only Hkv heads are stored:
  grouped-query attention shrinks the cache by G = H // Hkv.
- SlidingKV (sliding-window attention): a ring buffer of the last W positions; keys come back
  with their slots on the timeline so the layer masks by distance. Memory stops growing at W.
- LinearState (Gated DeltaNet): the conv inputs of the last K-1 positions (B, C, K-1) and the
  recurrent state (B, Hv, Dk, Dv) float32. Constant memory, whatever the length.
- LatentKV (multi-head latent attention, mla.py): preallocated (B, 1, S_max, R + Dr), per position
  the compressed latent c (R) and the one rotated key k_rope (Dr) that every head shares, instead
  of H keys and H values: DeepSeek-V3 keeps 576 numbers per token and layer where multi-head
  attention of its width would keep 40,960.
- StreamingKV (StreamingLLM, Xiao et al. 2023): the first `sink` positions plus a rolling window
  of the last `window`; keys are kept unrotated and rotated at their slot in the cache, so
  positions are re-indexed and generation can run past the context length.

This module imports nothing of logitlab; `for_model` reads the config fields it needs.
"""

from __future__ import annotations

import torch


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


class FullKV:
    """k, v: (B, Hkv, S_max, Dh); slots [0, length) are filled."""

    key_slots = None  # keys come back in timeline order from slot 0: the model's own mask holds

    def __init__(self, shape, dtype, device):
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, k_new, v_new, start: int):
        """Write (B, Hkv, T, Dh) at slots [start, start + T); views over [0, start + T)."""
        end = start + k_new.shape[2]
        self.k[:, :, start:end] = k_new
        self.v[:, :, start:end] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]

    def tensors(self):
        return [self.k, self.v]


class SlidingKV:
    """A ring of W slots: k, v (B, Hkv, W, Dh); slot[i] is the timeline slot held at ring index i
    (-1 = empty). Position p lives at ring index p % W."""

    def __init__(self, shape, window: int, dtype, device):
        B, Hkv, _, Dh = shape
        self.window = window
        self.k = torch.zeros(B, Hkv, window, Dh, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.slot = torch.full((window,), -1, dtype=torch.int64, device=device)
        self.key_slots = None

    def update(self, k_new, v_new, start: int):
        """Keys and values of the ring before this call, then the T new ones: (B, Hkv, W + T, Dh),
        their timeline slots in `key_slots` (W + T,). The last min(T, W) new positions then take
        their places in the ring."""
        T, W = k_new.shape[2], self.window
        new_slots = torch.arange(start, start + T, device=self.slot.device)
        k_all, v_all = torch.cat((self.k, k_new), dim=2), torch.cat((self.v, v_new), dim=2)
        self.key_slots = torch.cat((self.slot, new_slots))
        keep = slice(max(0, T - W), T)                         # the newest W at most
        ring = new_slots[keep] % W
        self.k[:, :, ring] = k_new[:, :, keep]
        self.v[:, :, ring] = v_new[:, :, keep]
        self.slot[ring] = new_slots[keep]
        return k_all, v_all

    def tensors(self):
        return [self.k, self.v]


class LatentKV:
    """latent: (B, 1, S_max, R + Dr), rows [c | k_rope]; slots [0, length) are filled. One "head":
    MLA's absorbed form reads these rows as the single key head (and c as the value head) of
    multi-query attention."""

    key_slots = None

    def __init__(self, batch: int, max_len: int, width: int, dtype, device):
        self.latent = torch.zeros(batch, 1, max_len, width, dtype=dtype, device=device)

    def update(self, latent_new, start: int):
        """Write (B, 1, T, R + Dr) at slots [start, start + T); a view over [0, start + T)."""
        end = start + latent_new.shape[2]
        self.latent[:, :, start:end] = latent_new
        return self.latent[:, :, :end]

    def tensors(self):
        return [self.latent]


# entries whose slots below `length` a later write never touches: going back is moving `length`
_GROWING = (FullKV, LatentKV)


class LinearState:
    """conv (B, C, K-1) in the model's dtype, recurrent (B, Hv, Dk, Dv) float32."""

    key_slots = None

    def __init__(self, batch: int, channels: int, kernel: int, heads: int, dk: int, dv: int, dtype, device):
        self.conv = torch.zeros(batch, channels, kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device)

    def tensors(self):
        return [self.conv, self.recurrent]


class StreamingKV:
    """The first `sink` positions and the last `window`, keys unrotated: k, v (B, Hkv, n, Dh)."""

    key_slots = None

    def __init__(self, shape, sink: int, window: int, dtype, device):
        B, Hkv, _, Dh = shape
        self.sink, self.window = sink, window
        self.k = torch.zeros(B, Hkv, 0, Dh, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, k_new, v_new, start: int):
        self.k = torch.cat((self.k[:, :, :start], k_new), dim=2)
        self.v = torch.cat((self.v[:, :, :start], v_new), dim=2)
        return self.k, self.v

    def evict(self) -> None:
        """Keep slots [0, sink) and the last `window`: the re-indexed cache."""
        n = self.k.shape[2]
        if n > self.sink + self.window:
            keep = lambda t: torch.cat((t[:, :, :self.sink], t[:, :, n - self.window:]), dim=2)  # noqa: E731
            self.k, self.v = keep(self.k), keep(self.v)

    def tensors(self):
        return [self.k, self.v]


class KVCache:
    """One entry per layer (see the module docstring); `length` timeline slots are filled.

    KVCache(L, B, Hkv, S_max, Dh) caches L full-attention layers. layer_types (one of
    "full_attention", "sliding_attention", "linear_attention" per layer) with `window` (the
    sliding window W) and `linear` (dict channels, kernel, heads, dk, dv of the Gated DeltaNet
    layers) build a hybrid model's cache; `for_model` fills these in from a config. stream=(sink,
    window) turns the full-attention layers into StreamingLLM entries (`rotates_keys`: the model
    rotates cached keys at their slots; `length` then stays at most sink + window). latent=R + Dr
    makes them multi-head latent attention entries (LatentKV, written by update_latent)."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None, *, layer_types=None, window=None,
                 linear=None, stream=None, latent=None):
        _positive("KVCache", n_layers=n_layers, batch_size=batch_size, n_kv_heads=n_kv_heads,
                  max_len=max_len, head_dim=head_dim)
        self.n_layers, self.batch_size, self.n_kv_heads = n_layers, batch_size, n_kv_heads
        self.max_len, self.head_dim = max_len, head_dim
        self.layer_types = tuple(layer_types or ("full_attention",) * n_layers)
        if len(self.layer_types) != n_layers:
            raise ValueError(f"KVCache: {len(self.layer_types)} layer_types for {n_layers} layers")
        self.rotates_keys = stream is not None
        if latent is not None:
            _positive("KVCache", latent=latent)
        if stream is not None and latent is not None:
            raise ValueError("KVCache: a StreamingLLM cache keeps keys unrotated, which multi-head latent "
                             "attention's cache (latent=...) does not")
        self.latent = latent
        if stream is not None:
            _positive("KVCache", sink=stream[0], window=stream[1])
            if "sliding_attention" in self.layer_types:
                raise ValueError("KVCache: a StreamingLLM cache needs full-attention layers, "
                                 "not sliding_attention ones (their window already bounds memory)")
        self.layers = [self._entry(kind, batch_size, dtype, device, window, linear, stream)
                       for kind in self.layer_types]
        self.length = 0
        self.seen = 0  # positions ever written (differs from length once a streaming cache evicts)

    def _entry(self, kind, B, dtype, device, window, linear, stream):
        shape = (B, self.n_kv_heads, self.max_len, self.head_dim)
        if kind == "full_attention":
            if self.latent is not None:
                return LatentKV(B, self.max_len, self.latent, dtype, device)
            if stream is not None:
                return StreamingKV(shape, stream[0], stream[1], dtype, device)
            return FullKV(shape, dtype, device)
        if kind == "sliding_attention":
            if window is None:
                raise ValueError("KVCache: sliding_attention layers need the window W")
            return SlidingKV(shape, min(window, self.max_len), dtype, device)
        if kind == "linear_attention":
            if linear is None:
                raise ValueError("KVCache: linear_attention layers need their state shapes")
            return LinearState(B, linear["channels"], linear["kernel"], linear["heads"], linear["dk"],
                               linear["dv"], dtype, device)
        raise ValueError(f"KVCache: unknown layer type {kind!r}")

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int | None = None, dtype=None,
                  device=None, stream: tuple[int, int] | None = None) -> "KVCache":
        """A cache shaped for `config` (a ModelConfig, or a model with a `.config`).

        max_len defaults to config.context_length. dtype/device default to those of the model's
        parameters when a model is given, else float32 on the default device. stream=(sink,
        window): a StreamingLLM cache (see the class docstring)."""
        model = None
        if hasattr(config, "config") and hasattr(config, "parameters"):
            model, config = config, config.config
        if model is not None:
            param = next(model.parameters())
            dtype = param.dtype if dtype is None else dtype
            device = param.device if device is None else device
        max_len = config.context_length if max_len is None else max_len
        if max_len > config.context_length and stream is None:
            raise ValueError(f"KVCache: max_len ({max_len}) exceeds the model's context_length "
                             f"({config.context_length})")
        if stream is not None and sum(stream) >= config.context_length:
            raise ValueError(f"KVCache: sink + window ({sum(stream)}) must be less than the model's context_length "
                             f"({config.context_length}): each step reads the cached positions and the new one")
        layer_types = getattr(config, "layer_kinds", None)
        linear = None
        if layer_types and "linear_attention" in layer_types:
            linear = dict(channels=2 * config.linear_n_k_heads * config.linear_k_head_dim
                          + config.linear_n_v_heads * config.linear_v_head_dim,
                          kernel=config.linear_conv_kernel, heads=config.linear_n_v_heads,
                          dk=config.linear_k_head_dim, dv=config.linear_v_head_dim)
        latent = config.kv_lora_rank + config.qk_rope_head_dim if getattr(config, "is_mla", False) else None
        return cls(config.n_layers, batch_size, config.n_kv_heads, max_len, config.head_dim,
                   dtype=torch.float32 if dtype is None else dtype, device=device, layer_types=layer_types,
                   window=getattr(config, "sliding_window", None), linear=linear, stream=stream, latent=latent)

    @property
    def k(self) -> list:
        """Each layer's key storage (None for a Gated DeltaNet layer)."""
        return [getattr(e, "k", None) for e in self.layers]

    @property
    def v(self) -> list:
        return [getattr(e, "v", None) for e in self.layers]

    @property
    def dtype(self) -> torch.dtype:
        return next(t for e in self.layers for t in e.tensors()).dtype if self.layers else torch.float32

    @property
    def device(self) -> torch.device:
        return self.layers[0].tensors()[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's entry (keys, values, conv and recurrent state)."""
        return sum(t.numel() * t.element_size() for e in self.layers for t in e.tensors())

    def update(self, layer: int, k_new: torch.Tensor,
               v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand k_new, v_new (B, Hkv, T, Dh) of slots [length, length + T) to `layer`'s entry.

        Returns the keys and values the layer attends over, (B, Hkv, S, Dh): for full attention
        views over slots [0, S), S = length + T; for a sliding window the ring and the new
        positions, their slots in key_slots(layer). `length` is NOT moved here (every layer
        writes at the same slots); the model calls `advance(T)` after the last layer."""
        T = k_new.shape[2]
        start, end = self.length, self.length + T
        entry = self.layers[layer]
        if isinstance(entry, FullKV) and end > self.max_len:
            raise ValueError(f"KVCache is full: writing {T} position(s) at length {start} would pass "
                             f"max_len ({self.max_len})")
        if k_new.shape != (self.batch_size, self.n_kv_heads, T, self.head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"KVCache.update: k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} do "
                             f"not fit the cache (B={self.batch_size}, Hkv={self.n_kv_heads}, Dh={self.head_dim})")
        if not hasattr(entry, "update") or isinstance(entry, LatentKV):
            what = "multi-head latent attention (update_latent)" if isinstance(entry, LatentKV) else \
                self.layer_types[layer]
            raise ValueError(f"KVCache.update: layer {layer} is {what}, not attention with keys and values")
        return entry.update(k_new, v_new, start)

    def update_latent(self, layer: int, latent_new: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention: hand latent_new (B, 1, T, R + Dr) of slots [length, length + T)
        to `layer`'s LatentKV entry -> its rows over slots [0, S), (B, 1, S, R + Dr). As update,
        `length` moves only in advance()."""
        entry = self.layers[layer]
        if not isinstance(entry, LatentKV):
            raise ValueError(f"KVCache.update_latent: layer {layer} holds no latent (a cache built without latent=)")
        T = latent_new.shape[2]
        if self.length + T > self.max_len:
            raise ValueError(f"KVCache is full: writing {T} position(s) at length {self.length} would pass "
                             f"max_len ({self.max_len})")
        if latent_new.shape != (self.batch_size, 1, T, self.latent):
            raise ValueError(f"KVCache.update_latent: latent_new {tuple(latent_new.shape)} does not fit the cache "
                             f"(B={self.batch_size}, 1, T, R + Dr={self.latent})")
        return entry.update(latent_new, self.length)

    def key_slots(self, layer: int):
        """The timeline slots (S,) of the keys the last update of `layer` returned, or None when
        they are simply 0 .. S-1."""
        return self.layers[layer].key_slots

    def linear_state(self, layer: int) -> LinearState:
        entry = self.layers[layer]
        if not isinstance(entry, LinearState):
            raise ValueError(f"KVCache: layer {layer} is {self.layer_types[layer]}, not linear_attention")
        return entry

    def advance(self, n: int) -> None:
        """Mark n more slots as filled (called once per forward, by the model). A streaming
        cache then evicts down to sink + window slots."""
        if not self.rotates_keys and self.length + n > self.max_len and "full_attention" in self.layer_types:
            raise ValueError(f"KVCache.advance({n}) at length {self.length} passes max_len ({self.max_len})")
        self.length += n
        self.seen += n
        if self.rotates_keys:
            for entry in self.layers:
                if isinstance(entry, StreamingKV):
                    entry.evict()
                    self.length = entry.k.shape[2]

    # --- going back: speculative decoding drops the positions a rejected draft left ---------

    @property
    def can_rewind(self) -> bool:
        """True when every entry is plain full attention or a latent: slots past `length` are never
        read, so going back is moving `length` (rewind). A ring, a recurrent state or a streaming
        cache overwrites what came before; those go back through snapshot / restore."""
        return all(type(e) in _GROWING for e in self.layers)

    def rewind(self, length: int) -> None:
        """Forget the positions from `length` on (full-attention caches only, see can_rewind)."""
        if not self.can_rewind:
            raise ValueError("KVCache.rewind needs full-attention layers only: a sliding window, a Gated DeltaNet "
                             "state or a streaming cache overwrites earlier positions (use snapshot / restore)")
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.rewind({length}): the cache holds {self.length} positions")
        self.length = self.seen = length

    def snapshot(self) -> dict:
        """A copy of what a forward would overwrite: `length` and a clone of every entry that is not
        plain full attention or a latent (those keep their slots below `length` as they are)."""
        if self.rotates_keys:
            raise ValueError("KVCache.snapshot: a StreamingLLM cache evicts positions and cannot go back")
        return {"length": self.length, "seen": self.seen,
                "entries": {i: [t.clone() for t in e.tensors()] + ([e.slot.clone()] if isinstance(e, SlidingKV) else [])
                            for i, e in enumerate(self.layers) if type(e) not in _GROWING}}

    def restore(self, snapshot: dict) -> None:
        """Return to the state `snapshot()` saw (the positions fed since then are forgotten)."""
        self.length, self.seen = snapshot["length"], snapshot["seen"]
        for i, saved in snapshot["entries"].items():
            entry = self.layers[i]
            live = entry.tensors() + ([entry.slot] if isinstance(entry, SlidingKV) else [])
            for t, s in zip(live, saved, strict=True):
                t.copy_(s)

    def reset(self) -> None:
        """Forget every position (the memory is kept and overwritten by the next prefill)."""
        self.length = self.seen = 0
        for entry in self.layers:
            if isinstance(entry, SlidingKV):
                entry.slot.fill_(-1)
            elif isinstance(entry, LinearState):
                entry.conv.zero_()
                entry.recurrent.zero_()
            elif isinstance(entry, StreamingKV):
                entry.k, entry.v = entry.k[:, :, :0], entry.v[:, :, :0]

    def __repr__(self) -> str:
        kinds = sorted(set(self.layer_types))
        shape = f"latent={self.latent}" if self.latent else f"Hkv={self.n_kv_heads}, Dh={self.head_dim}"
        return (f"KVCache(L={self.n_layers}, B={self.batch_size}, {shape}, "
                f"S_max={self.max_len}, length={self.length}, layers={kinds}, "
                f"dtype={self.dtype}, {self.nbytes / 2**20:.1f} MiB)")
