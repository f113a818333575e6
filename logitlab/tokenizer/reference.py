"""The reference encoder: byte-level BPE written to be read, in the spirit of minbpe.

A pre-token's UTF-8 bytes start as one id per byte. Merges are replayed lowest rank first, each
rank merging all its occurrences left to right, until no adjacent pair is a merge. Two versions
of that one rule live here:

* `bpe_plain`: the rule written the obvious way, O(n^2) in the pre-token's length: the
  readable definition;
* `bpe`: the same rule kept fast for long pre-tokens, O(n log n), tested against `bpe_plain`.

The merge table both read is built by `merge_table`: pair key `left << 20 | right` ->
`rank << 20 | merged id`, so the smallest value is the lowest rank. `encode_pieces` runs `bpe`
over a splitter's pieces with a bounded cache of pieces already encoded. The splitter itself (the
`regex` module, with code points classified as tiktoken's engine classifies them) lives in
patterns.py. `Tokenizer.encode(..., fast=False)` (core.py) takes this path.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["REFERENCE_CACHE_LIMIT", "bpe", "bpe_plain", "consistent_for_tiktoken", "encode_pieces", "merge_table"]

REFERENCE_CACHE_LIMIT = 100_000  # encoded pre-tokens kept by the reference path
_NO_MERGE = 1 << 62


def merge_table(encoder: dict[bytes, int], merges: list[tuple[bytes, bytes]]
                ) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """(merge_ids, pair_rank): the ids of each merge's parts in rank order, and the pair table
    left << 20 | right -> rank << 20 | merged id (the first merge of a pair wins)."""
    merge_ids = [(encoder[a], encoder[b]) for a, b in merges]
    pair_rank: dict[int, int] = {}
    for rank, (a, b) in enumerate(merge_ids):
        pair_rank.setdefault(a << 20 | b, rank << 20 | encoder[merges[rank][0] + merges[rank][1]])
    return merge_ids, pair_rank


def bpe(data: bytes, byte_ids: list[int], pair_rank: dict[int, int], merge_ids: list[tuple[int, int]]) -> list[int]:
    """Replay merges on one pre-token's bytes: the reference encoder, O(n log n) in its length.

    The rule is `bpe_plain`'s (merge the lowest-rank adjacent pair, all its occurrences left
    to right, until no adjacent pair is a merge), kept fast for long pre-tokens:

    * the parts form a doubly linked list over byte positions (a part is named by the position
      of its first byte, so positions order the parts left to right);
    * a heap holds (rank value, position) for each adjacent pair that is a merge. The rank
      value is rank << 20 | merged id, so the top is the lowest rank and, among its entries,
      the leftmost occurrence;
    * entries are never removed: one whose pair has changed since it was pushed is stale and
      skipped when it comes up (lazy deletion);
    * all occurrences of one rank are merged before the pairs that those merges made are
      pushed, exactly as one left-to-right pass of `bpe_plain` does.

    Each merge costs O(log n) heap work and at most two pair look-ups."""
    ids = [byte_ids[b] for b in data]
    n = len(ids)
    get = pair_rank.get
    nxt = list(range(1, n + 1))  # nxt[i]: position of the part after part i (n: none)
    prv = list(range(-1, n - 1))  # prv[i]: position of the part before part i (-1: none)
    heap = []
    for i in range(n - 1):
        r = get(ids[i] << 20 | ids[i + 1])
        if r is not None:
            heap.append((r, i))
    heapq.heapify(heap)
    while heap:
        value = heap[0][0]
        a, b = merge_ids[value >> 20]
        new = value & 0xFFFFF
        merged = []
        while heap and heap[0][0] == value:  # this pair's occurrences, leftmost first
            i = heapq.heappop(heap)[1]
            j = nxt[i]
            if ids[i] != a or j == n or ids[j] != b:
                continue  # stale: part i changed, or was merged into its left neighbour
            ids[i], ids[j] = new, -1  # part j joins part i and is gone
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            merged.append(i)
        # The pairs on either side of each new part (a new part is neither `a` nor `b`, so
        # none of them could have been merged in this pass).
        for left in sorted({p for i in merged for p in (prv[i], i) if p >= 0}):
            right = nxt[left]
            if right < n:
                r = get(ids[left] << 20 | ids[right])
                if r is not None:
                    heapq.heappush(heap, (r, left))
    return [t for t in ids if t >= 0]


def bpe_plain(data: bytes, byte_ids: list[int], pair_rank: dict[int, int],
              merge_ids: list[tuple[int, int]]) -> list[int]:
    """The same rule written the obvious way, O(n^2) in the pre-token's length: find the
    lowest-rank adjacent pair, merge all its occurrences left to right, repeat until no
    adjacent pair is a merge. Kept as the readable definition `bpe` is tested against."""
    parts = [byte_ids[b] for b in data]
    get, none = pair_rank.get, _NO_MERGE
    while len(parts) > 1:
        best = min((get(x << 20 | y, none) for x, y in zip(parts, parts[1:])), default=none)
        if best == none:
            break
        a, b = merge_ids[best >> 20]
        new_id, out, i, n = best & 0xFFFFF, [], 0, len(parts)
        while i < n:
            if parts[i] == a and i + 1 < n and parts[i + 1] == b:
                out.append(new_id)
                i += 2
            else:
                out.append(parts[i])
                i += 1
        parts = out
    return parts


def encode_pieces(text: str, split: Callable[[str], list[str]], encode_piece: Callable[[bytes], list[int]],
                  cache: dict[str, list[int]], out: list[int]) -> None:
    """Split `text` and append each piece's ids to `out`, remembering up to REFERENCE_CACHE_LIMIT
    pieces in `cache` (emptied when full). The splitter checks that its pieces cover the text."""
    for piece in split(text):
        ids = cache.get(piece)
        if ids is None:
            ids = encode_piece(utf8(piece))
            if len(cache) >= REFERENCE_CACHE_LIMIT:
                cache.clear()
            cache[piece] = ids
        out.extend(ids)


def utf8(text: str) -> bytes:
    """UTF-8 bytes; lone surrogates become U+FFFD (as tiktoken does)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def consistent_for_tiktoken(encoder: dict[bytes, int], merges: list[tuple[bytes, bytes]],
                            encode_piece: Callable[[bytes], list[int]]) -> bool:
    """True when merging by rank of the concatenation (tiktoken's rule) gives the same ids as
    replaying `merges` in order: merge results are distinct, their ids grow with merge order, each
    part is made before the merge that uses it, and every token's own bytes encode to that token."""
    last = -1
    seen: set[bytes] = set()
    for a, b in merges:
        ab = a + b
        i = encoder[ab]
        if ab in seen or i <= last or encoder[a] >= i or encoder[b] >= i:
            return False  # duplicate result, ids out of merge order, or a part made later
        seen.add(ab)
        last = i
    return all(encode_piece(tok) == [i] for tok, i in encoder.items() if len(tok) > 1)
