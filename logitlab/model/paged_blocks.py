"""The bookkeeping of a paged KV cache: which block holds what, who uses it, what may be reused.

paged_blocks.py owns the numbers only (block ids, reference counts, hashes, an LRU order); the
tensors that hold keys and values live in paged.py. A block holds `block_size` consecutive
positions of one sequence. A block that is full gets a hash that names its tokens AND everything
before them (a chain: hash(previous block's hash, this block's tokens)), so two requests whose
prompts start with the same tokens find the same blocks and share them instead of computing them
again (prefix caching). A shared block is read-only: a sequence that must write into one copies
it first (copy on write, paged.py). A block nobody references but whose hash is known stays
cached, in least-recently-used order, until an allocation needs the memory (LRU eviction under the
pool's budget).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Sequence


def block_hashes(tokens: Sequence[int], block_size: int, previous: bytes = b"") -> list[bytes]:
    """The chained hash of each FULL block of `tokens` (a trailing partial block gets none):
    h_i = blake2b(h_{i-1} + the block's token ids as 4-byte little-endian), h_{-1} = `previous`."""
    hashes, h = [], previous
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = b"".join(int(t).to_bytes(4, "little") for t in tokens[start:start + block_size])
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        hashes.append(h)
    return hashes


class BlockManager:
    """n_blocks blocks of block_size positions: a free list, a reference count per block, the hash
    of each full cached block, and the unreferenced cached blocks in LRU order (oldest first).

    allocate() takes a free block, else evicts the least recently used cached one (forgetting its
    hash); match() finds the longest cached chain of a prompt's blocks and takes a reference to
    each; release() drops a reference, and a block left unreferenced goes back to the free list, or
    to the LRU end if its hash is known. Counters: hits (blocks found by match), evictions."""

    def __init__(self, n_blocks: int, block_size: int):
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockManager: {name} must be an integer >= 1, got {value!r}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free: deque[int] = deque(range(n_blocks))
        self.refs = [0] * n_blocks
        self.hash_of: dict[int, bytes] = {}          # block -> its chained hash (full, cached blocks)
        self.by_hash: dict[bytes, int] = {}          # the same, the other way round
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, oldest first
        self.hits = self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks an allocation can get now: free ones and evictable cached ones."""
        return len(self.free) + len(self.lru)

    @property
    def in_use(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.n_blocks - self.available

    def allocate(self) -> int:
        """A block with one reference, its old content forgotten. RuntimeError when none is left
        (the scheduler reserves blocks before admitting a request, so this is a bug)."""
        if self.free:
            block = self.free.popleft()
        elif self.lru:
            block, _ = self.lru.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
            self.evictions += 1
        else:
            raise RuntimeError(f"BlockManager: all {self.n_blocks} blocks are in use")
        self.refs[block] = 1
        return block

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first; each gets a reference."""
        found = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        for block in found:
            self.lru.pop(block, None)
            self.refs[block] += 1
        self.hits += len(found)
        return found

    def register(self, block: int, h: bytes) -> None:
        """`block` is full and holds the positions named by hash h: later prompts may share it. A
        block with the same hash already cached keeps its place (this one stays private)."""
        if h not in self.by_hash and block not in self.hash_of:
            self.by_hash[h], self.hash_of[block] = block, h

    def writable(self, block: int) -> bool:
        """Whether a sequence may write into `block` in place: it alone references it and no hash
        names its content."""
        return self.refs[block] == 1 and block not in self.hash_of

    def release(self, block: int) -> None:
        if self.refs[block] < 1:
            raise RuntimeError(f"BlockManager: block {block} released more often than taken")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.lru[block] = None                 # the most recently used end
            else:
                self.free.append(block)
