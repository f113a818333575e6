"""A paged KV cache: keys and values in fixed-size blocks of one pool, a block table per sequence.

paged.py owns the tensors of a paged cache and the view one forward reads them through. A
sequence (PagedSequence) has a block table: position p of it lives in block table[p // bs] at
offset p % bs, so a sequence grows by taking one more block and leaves by giving its blocks back;
no other sequence moves or is computed again. Which block is free, shared or cached is
paged_blocks.py's bookkeeping (reference counts, chained hashes, LRU); the scheduler that decides
who runs is serve/paged_engine.py.

One forward runs a batch of sequences through `PagedCache.view(seqs, new_ids)`, an object with the
model's cache protocol (`length`, `batch_size`, `update`, `key_slots`, `linear_state`, `advance`):
row b's n_b cached positions sit right-aligned before slot L = max n_b and its t_b new ones at
slots [L, L + t_b) (right padding up to T = max t_b). `update` writes the new keys and values into
their blocks and returns every row's keys gathered into (B, Hkv, S, Dh), S = L + T, with the
view's `attn_mask` (B, S) False at the padding; positions (B, T) carry each row's own positions.
Two gathers return the same tensor: "reference" copies block by block in a loop a reader checks
by eye; "index" computes one flat slot index (B, S) per forward and gathers each layer with one
indexing operation, into a buffer the cache reuses (the default where it measures faster,
docs/benchmarks.md).

Hybrid models: a sliding-window layer keeps all its blocks (the window is applied by the mask, by
position distance, which right alignment keeps equal to slot distance); a Gated DeltaNet layer's
conv and recurrent state are not positions at all and live in a pool of per-sequence state slots
(R rows), gathered into the batch before the forward and written back in `advance`. Prefix
caching is off for such models (a shared block does not carry the recurrent state at its end).
Attention sinks, MoE and ALiBi need nothing from the cache. A multi-head latent attention layer
keeps one row per slot, its latent and RoPE key (R + Dr), in place of k and v (`update_latent`).

Shapes: B sequences in this forward, T new positions (padded), L cached slots, S = L + T,
N blocks, bs block size, Hkv key/value heads, Dh head_dim, R state slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from logitlab.model.paged_blocks import BlockManager, block_hashes

GATHERS = ("index", "reference")


@dataclass(eq=False)
class PagedSequence:
    """One sequence in the cache: the ids whose keys and values are cached (in order), its block
    table, the chained hashes of its full blocks, and its state slot (Gated DeltaNet) or None."""

    tokens: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    slot: int | None = None
    reused: int = 0          # prompt positions found in the prefix cache at the start

    @property
    def length(self) -> int:
        return len(self.tokens)


class _StateRows:
    """The Gated DeltaNet state of a forward's rows: conv (B, C, K-1), recurrent (B, Hv, Dk, Dv)."""

    key_slots = None

    def __init__(self, conv, recurrent):
        self.conv, self.recurrent = conv, recurrent


class PagedCache:
    """The pool: per attention layer k, v (N*bs, Hkv, Dh) (one row per position slot); per Gated
    DeltaNet layer conv (R, C, K-1) and recurrent (R, Hv, Dk, Dv) float32; a BlockManager.

    model: a Transformer (its config, dtype and device are used). n_blocks * block_size positions
    in all; max_seqs state slots (models with linear_attention layers); prefix_caching shares full
    prompt blocks between sequences (off, and forced off, for linear_attention models)."""

    def __init__(self, model, n_blocks: int, block_size: int = 16, *, max_seqs: int = 16,
                 prefix_caching: bool = True, gather: str = "index"):
        if gather not in GATHERS:
            raise ValueError(f"PagedCache: gather must be one of {GATHERS}, got {gather!r}")
        cfg = model.config
        param = next(model.parameters())
        self.dtype, self.device, self.gather = param.dtype, param.device, gather
        self.layer_types = tuple(getattr(cfg, "layer_kinds", None) or ("full_attention",) * cfg.n_layers)
        self.context = cfg.context_length
        self.blocks = BlockManager(n_blocks, block_size)
        self.block_size = block_size
        self.has_state = "linear_attention" in self.layer_types
        self.prefix_caching = prefix_caching and not self.has_state
        slots = n_blocks * block_size
        self.k, self.v, self.conv, self.recurrent = {}, {}, {}, {}
        for i, kind in enumerate(self.layer_types):
            if kind == "linear_attention":
                C = 2 * cfg.linear_n_k_heads * cfg.linear_k_head_dim + cfg.linear_n_v_heads * cfg.linear_v_head_dim
                self.conv[i] = torch.zeros(max_seqs, C, cfg.linear_conv_kernel - 1, dtype=self.dtype,
                                           device=self.device)
                self.recurrent[i] = torch.zeros(max_seqs, cfg.linear_n_v_heads, cfg.linear_k_head_dim,
                                                cfg.linear_v_head_dim, dtype=torch.float32, device=self.device)
            elif getattr(cfg, "is_mla", False):          # latent attention: one row [c | k_rope] per slot
                self.k[i] = torch.zeros(slots, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=self.dtype,
                                        device=self.device)
            else:
                self.k[i] = torch.zeros(slots, cfg.n_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
                self.v[i] = torch.zeros_like(self.k[i])
        self.free_slots = list(range(max_seqs)) if self.has_state else []
        self.copies = 0          # copy-on-write block copies
        self.workspace: dict[int, torch.Tensor] = {}   # gather outputs, reused (see read_slots)

    @property
    def nbytes(self) -> int:
        tables = (self.k, self.v, self.conv, self.recurrent)
        return sum(t.numel() * t.element_size() for d in tables for t in d.values())

    def blocks_for(self, n_positions: int) -> int:
        return -(-n_positions // self.block_size)

    # --- sequences -----------------------------------------------------------------------------

    def start(self, prompt: list[int]) -> PagedSequence:
        """A new sequence for `prompt`: the longest cached run of its full blocks shared (at most
        len(prompt) - 1 positions, so the last prompt id is always fed and gives the logits of the
        first new token); nothing is computed here. ValueError when no state slot is free."""
        seq = PagedSequence()
        if self.has_state:
            if not self.free_slots:
                raise ValueError("PagedCache: every state slot is in use")
            seq.slot = self.free_slots.pop()
            self._zero_state(seq.slot)
        if self.prefix_caching:
            hashes = block_hashes(prompt, self.block_size)
            seq.table = self.blocks.match(hashes)
            n = min(len(seq.table) * self.block_size, len(prompt) - 1)
            seq.tokens, seq.hashes, seq.reused = list(prompt[:n]), hashes[:n // self.block_size], n
        return seq

    def _zero_state(self, slot: int) -> None:
        """Zero state slot `slot` (a new sequence starts from the zero state)."""
        for i in self.conv:
            self.conv[i][slot].zero_()
            self.recurrent[i][slot].zero_()

    def finish(self, seq: PagedSequence) -> None:
        """Give back the sequence's blocks (full hashed ones stay cached, LRU) and its state slot."""
        for block in seq.table:
            self.blocks.release(block)
        seq.table = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def prepare(self, seq: PagedSequence, n_new: int) -> None:
        """Blocks for positions [length, length + n_new): a partly filled last block that is shared
        (or cached under a hash) is copied first (copy on write), then fresh blocks are appended."""
        bs, n = self.block_size, seq.length
        if n % bs and not self.blocks.writable(seq.table[n // bs]):
            old, new = seq.table[n // bs], self.blocks.allocate()
            for pool in (*self.k.values(), *self.v.values()):
                pool[new * bs:(new + 1) * bs] = pool[old * bs:(old + 1) * bs]
            self.blocks.release(old)
            seq.table[n // bs] = new
            self.copies += 1
        while len(seq.table) * bs < n + n_new:
            seq.table.append(self.blocks.allocate())

    def commit(self, seq: PagedSequence, new_ids: list[int]) -> None:
        """After a forward: the new ids are cached; blocks that became full get their hashes."""
        seq.tokens.extend(new_ids)
        if not self.prefix_caching:
            return
        done = len(seq.hashes)
        fresh = block_hashes(seq.tokens[done * self.block_size:], self.block_size,
                             seq.hashes[-1] if seq.hashes else b"")
        for j, h in enumerate(fresh, start=done):
            self.blocks.register(seq.table[j], h)
        seq.hashes.extend(fresh)

    def read_slots(self, j: int, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """pool[slots] (n, ...) for the n slots, written into buffer j (0: keys or latent rows, 1:
        values) that this cache reuses for every layer of every forward: the result is valid until the
        next read_slots(j) (the next layer's update). A fresh tensor per call would be memory the OS
        maps and zeroes page by page at its first touch (a 32-row decode step took thousands of page
        faults, docs/benchmarks.md), and a buffer per layer would keep L times as much memory out of
        the processor's cache. The buffer grows by doubling, so rows growing a position a step do not
        reallocate it."""
        n = slots.numel()
        buf = self.workspace.get(j)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != pool.shape[1:]:
            rows = n if buf is None or buf.shape[1:] != pool.shape[1:] else max(n, 2 * buf.shape[0])
            buf = self.workspace[j] = pool.new_empty((rows, *pool.shape[1:]))
        return torch.index_select(pool, 0, slots, out=buf[:n])

    def view(self, seqs: list[PagedSequence], new_ids: list[list[int]]) -> "PagedView":
        """The cache one forward of these sequences reads (call prepare for each first)."""
        return PagedView(self, seqs, new_ids)


def _ints(rows: list[list[int]], device) -> torch.Tensor:
    """Equal-length rows of ints -> an int64 tensor (len(rows), len(row)). Through numpy: torch.tensor
    reads a nested list element by element, four times slower for the few hundred block ids of a
    32-row decode step."""
    return torch.from_numpy(np.array(rows, dtype=np.int64)).to(device)


class PagedView:
    """The cache protocol over B sequences for one forward (see the module docstring).

    ids (B, T), positions (B, T), attn_mask (B, S) and last (B,) (the index of each row's last new
    position) are what the caller passes to the model and reads the logits at."""

    rotates_keys = False

    def __init__(self, cache: PagedCache, seqs: list[PagedSequence], new_ids: list[list[int]]):
        if len(seqs) != len(new_ids) or not seqs or any(not ids for ids in new_ids):
            raise ValueError("PagedView: one non-empty list of new ids per sequence is needed")
        self.cache, self.seqs, self.new_ids = cache, seqs, new_ids
        self.layer_types = cache.layer_types
        bs, device = cache.block_size, cache.device
        n, c = [q.length for q in seqs], [len(ids) for ids in new_ids]                  # cached, new per row
        B, L, T = len(seqs), max(n), max(c)
        if cache.has_state and any(x != T for x in c):
            raise ValueError("PagedView: with Gated DeltaNet layers every row must feed as many ids (no padding)")
        self.batch_size, self.length, self.T = B, L, T
        lengths, counts = torch.tensor(n, device=device), torch.tensor(c, device=device)    # (B,), (B,)
        self.ids = _ints([ids + [0] * (T - len(ids)) for ids in new_ids], device)              # (B, T)
        t = torch.arange(T, device=device)
        self.positions = (lengths[:, None] + t[None, :]).clamp(max=cache.context - 1)    # (B, T)
        self.last = counts - 1                                                           # (B,)
        # each row's position at every slot s of [0, S): p = s - (L - n_b); real when 0 <= p < n_b + t_b
        s = torch.arange(L + T, device=device)
        pos = s[None, :] - (L - lengths)[:, None]                                        # (B, S)
        self.attn_mask = (pos >= 0) & (pos < (lengths + counts)[:, None])                # (B, S)
        n_table = max(len(q.table) for q in seqs)
        tables = _ints([q.table + [0] * (n_table - len(q.table)) for q in seqs], device)       # (B, nb)
        p = pos.clamp(min=0)
        slot = tables.gather(1, (p // bs).clamp(max=n_table - 1)) * bs + p % bs           # (B, S)
        self.slot = torch.where(self.attn_mask, slot, 0)                                  # padding reads slot 0
        # the new positions, row by row (the order of (B, T) flattened, padding left out): their pool
        # slots, and which of the B*T rows they are (None: all of them, no padding)
        self.new_slot = torch.tensor([q.table[p // bs] * bs + p % bs for q, nb, cb in zip(seqs, n, c)
                                      for p in range(nb, nb + cb)], device=device)        # (n_new,)
        self.new_rows = None if min(c) == T else torch.tensor(
            [b * T + j for b, cb in enumerate(c) for j in range(cb)], device=device)      # (n_new,) of B*T
        self._states: dict[int, _StateRows] = {}

    # --- the protocol the model calls ----------------------------------------------------------

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write k_new, v_new (B, Hkv, T, Dh) into their blocks -> every row's keys and values
        (B, Hkv, S, Dh), cached positions right-aligned before slot L, then the new ones."""
        k, v = self._write_read(((self.cache.k[layer], k_new), (self.cache.v[layer], v_new)))
        return k, v

    def update_latent(self, layer: int, latent_new: torch.Tensor) -> torch.Tensor:
        """Multi-head latent attention (mla.py): latent_new (B, 1, T, R + Dr) into its blocks -> every
        row's latent rows (B, 1, S, R + Dr), laid out as update lays out keys."""
        return self._write_read(((self.cache.k[layer], latent_new),))[0]

    def _write_read(self, pairs) -> list:
        """For each (pool (N*bs, Hkv, Dh), new (B, Hkv, T, Dh)): write, then gather (B, Hkv, S, Dh)."""
        if self.cache.gather == "reference":
            return self._reference(pairs)
        out = []
        for j, (pool, new) in enumerate(pairs):
            B, Hkv, T, Dh = new.shape
            new = new.transpose(1, 2).reshape(B * T, Hkv, Dh)                            # (B*T, Hkv, Dh)
            if self.new_rows is not None:
                new = new.index_select(0, self.new_rows)                                  # (n_new, Hkv, Dh)
            pool.index_copy_(0, self.new_slot, new.to(pool.dtype))
            flat = self.cache.read_slots(j, pool, self.slot.view(-1))                     # (B*S, Hkv, Dh)
            out.append(flat.view(B, -1, Hkv, Dh).transpose(1, 2))                         # (B, Hkv, S, Dh)
        return out

    def _reference(self, pairs) -> list:
        """The same as _write_read, one block at a time: write each new position at its block and
        offset, then copy each row's blocks into its place on the batch's timeline."""
        bs, L, T = self.cache.block_size, self.length, self.T
        result = []
        for pool, new in pairs:
            B, Hkv, _, Dh = new.shape
            out = torch.zeros(B, Hkv, L + T, Dh, dtype=pool.dtype, device=pool.device)  # (B, Hkv, S, Dh)
            for b, (seq, ids) in enumerate(zip(self.seqs, self.new_ids)):
                n = seq.length
                for t in range(len(ids)):                                   # write position n + t
                    block, offset = seq.table[(n + t) // bs], (n + t) % bs
                    pool[block * bs + offset] = new[b, :, t]                # (Hkv, Dh)
                for j in range(self.cache.blocks_for(n + len(ids))):       # read block j: positions j*bs ..
                    count = min(bs, n + len(ids) - j * bs)
                    rows = pool[seq.table[j] * bs: seq.table[j] * bs + count]            # (count, Hkv, Dh)
                    start = L - n + j * bs
                    out[b, :, start:start + count] = rows.transpose(0, 1)
            result.append(out)
        return result

    def key_slots(self, layer: int):
        return None                      # every row is contiguous on the timeline: slot distance = position distance

    def linear_state(self, layer: int) -> _StateRows:
        """The rows' Gated DeltaNet state for `layer`, gathered from their slots once per forward."""
        if layer not in self.cache.conv:
            raise ValueError(f"PagedView: layer {layer} is {self.layer_types[layer]}, not linear_attention")
        if layer not in self._states:
            rows = torch.tensor([s.slot for s in self.seqs], device=self.cache.device)
            self._states[layer] = _StateRows(self.cache.conv[layer][rows], self.cache.recurrent[layer][rows])
        return self._states[layer]

    def advance(self, n: int) -> None:
        """Called by the model after its last layer: the state rows go back to their slots and
        each sequence's new ids count as cached."""
        if self._states:
            rows = torch.tensor([s.slot for s in self.seqs], device=self.cache.device)
            for layer, state in self._states.items():
                self.cache.conv[layer].index_copy_(0, rows, state.conv)
                self.cache.recurrent[layer].index_copy_(0, rows, state.recurrent)
        for seq, ids in zip(self.seqs, self.new_ids):
            self.cache.commit(seq, ids)


def run(model, view: PagedView) -> torch.Tensor:
    """One forward of the view's rows -> (B, V) float32 logits at each row's last new position."""
    h = model.forward_features(view.ids, cache=view, positions=view.positions, attn_mask=view.attn_mask)
    last = h[torch.arange(h.shape[0], device=h.device), view.last]                       # (B, D)
    return model.unembed(last[:, None])[:, 0].float()                                  # (B, V)
