"""SentencePiece-style BPE on one word, written to be read: characters -> symbols -> merges.

This is the model step of the Hugging Face `tokenizer.json` files that Llama-2, Mistral,
TinyLlama and Gemma ship (sentencepiece.py runs the steps around it: added tokens, "▁" for
spaces, the decoder). It differs from byte-level BPE (reference.py) in two ways:

1. A word starts as its *characters*, not its bytes (`symbols`). A character in the vocabulary
   is its id. One that is not becomes the ids of its UTF-8 bytes' tokens `<0xE2>` `<0x82>`
   `<0xAC>` (byte fallback); without byte fallback (or when a byte token is missing) it becomes
   the unknown token, and with `fuse_unk` a run of unknown characters becomes one. Example, with
   "€" outside the vocabulary: "▁€5" -> [id("▁"), id("<0xE2>"), id("<0x82>"), id("<0xAC>"), id("5")].
2. Merges are applied one at a time: the adjacent pair with the lowest rank, and of its
   occurrences the leftmost, is merged; then the pairs around the new symbol may merge
   (`merge_plain`). Byte-level BPE merges every occurrence of a rank before looking at the next;
   the two agree unless a pair made by a merge has a lower rank than that merge, which
   SentencePiece vocabularies allow.

`merge` is the same rule kept fast for long words (a heap of candidate pairs, O(n log n)), tested
against `merge_plain`. The pair table both read maps (left id, right id) -> (rank, merged id); a
pair listed twice keeps its last rank, as `tokenizers` reads such a file.

`independent_parts` cuts a word where no token can cross: between two characters of the
vocabulary that stand side by side in no merge result (`joined_pairs`). A token spanning that
place would be a merge result holding both, so each part merges alone, with the ids of the whole
word, and can be cached: that is what makes long texts fast. (In SentencePiece's vocabularies a
piece starts with its "▁"s, so every word's end is such a place.)
"""

from __future__ import annotations

import heapq

__all__ = ["BYTE_PIECE", "byte_of_piece", "independent_parts", "joined_pairs", "merge", "merge_plain",
           "pair_table", "symbols"]

SPACE = "▁"  # U+2581, SentencePiece's visible space


def BYTE_PIECE(b: int) -> str:  # noqa: N802  (a constant-like formatter: the spelling of byte b)
    """The vocabulary's spelling of byte b: "<0x0A>" for a newline (two upper-case hex digits)."""
    return f"<0x{b:02X}>"


_HEX = set("0123456789abcdefABCDEF")


def byte_of_piece(piece: str) -> int | None:
    """The byte a piece stands for when a ByteFallback decoder reads it, else None. Its rule is
    `tokenizers`': six bytes "<0x" + two characters + ">", the two read as a base-16 number
    (Rust's parser, which also takes "+F")."""
    if len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">"):
        return None
    digits = piece[3:5]
    if all(c in _HEX for c in digits) or (digits[0] == "+" and digits[1] in _HEX):
        return int(digits, 16)
    return None


def symbols(word: str, vocab: dict[str, int], byte_ids: list[int | None] | None,
            unk_id: int | None, fuse_unk: bool) -> list[int]:
    """A word's characters -> ids. byte_ids: the id of each byte's <0xNN> token (None where the
    vocabulary lacks it), or None without byte fallback. unk_id: the unknown token's id, or None:
    then a character with neither an id nor byte tokens is dropped, as `tokenizers` drops it."""
    out: list[int] = []
    pending_unk = False  # an unknown run not yet written (with fuse_unk it may grow)
    for ch in word:
        found = vocab.get(ch)
        if found is not None:
            if pending_unk:
                out.append(unk_id)
                pending_unk = False
            out.append(found)
            continue
        if byte_ids is not None:
            ids = [byte_ids[b] for b in ch.encode("utf-8")]
            if None not in ids:
                # `tokenizers` leaves a pending unknown run where it is here and writes it after
                # these bytes; with all 256 byte tokens present (every file we know) there is none.
                out.extend(ids)
                continue
        if unk_id is not None:
            if pending_unk and not fuse_unk:
                out.append(unk_id)
            pending_unk = True
    if pending_unk:
        out.append(unk_id)
    return out


def pair_table(merges: list[tuple[int, int, int]]) -> dict[tuple[int, int], tuple[int, int]]:
    """[(left id, right id, merged id)] in rank order -> {(left, right): (rank, merged id)}."""
    return {(a, b): (rank, new) for rank, (a, b, new) in enumerate(merges)}


def merge_plain(ids: list[int], pairs: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """The rule written the obvious way, O(n^2): merge the lowest-rank adjacent pair (leftmost of
    its occurrences), and repeat until no adjacent pair is in the table."""
    ids = list(ids)
    while True:
        best = None  # (rank, position, merged id)
        for i in range(len(ids) - 1):
            found = pairs.get((ids[i], ids[i + 1]))
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], i, found[1])
        if best is None:
            return ids
        _, i, new = best
        ids[i:i + 2] = [new]


def merge(ids: list[int], pairs: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """`merge_plain`'s rule in O(n log n), as `tokenizers` runs it.

    Symbols form a linked list over their first positions (prv, nxt); a heap holds (rank,
    position, merged id) for every adjacent pair in the table, so its top is the lowest rank,
    leftmost. An entry is stale when its left symbol was merged away or now has another right
    neighbour (checked by looking the pair up again); stale entries are skipped when they come up.
    After a merge the pairs with the new symbol's neighbours are pushed."""
    n = len(ids)
    ids = list(ids)
    alive = [True] * n
    nxt = list(range(1, n + 1))  # nxt[i]: position of the symbol after symbol i (n: none)
    prv = list(range(-1, n - 1))  # prv[i]: position of the symbol before symbol i (-1: none)
    heap = []
    for i in range(n - 1):
        found = pairs.get((ids[i], ids[i + 1]))
        if found is not None:
            heap.append((found[0], i, found[1]))
    heapq.heapify(heap)
    while heap:
        _, i, new = heapq.heappop(heap)
        j = nxt[i]
        if not alive[i] or j == n or pairs.get((ids[i], ids[j]), (0, -1))[1] != new:
            continue  # stale
        ids[i], alive[j] = new, False  # symbol j joins symbol i
        nxt[i] = nxt[j]
        if nxt[j] < n:
            prv[nxt[j]] = i
        for left, right in ((prv[i], i), (i, nxt[i])):
            if left >= 0 and right < n:
                found = pairs.get((ids[left], ids[right]))
                if found is not None:
                    heapq.heappush(heap, (found[0], left, found[1]))
    return [t for t, keep in zip(ids, alive) if keep]


def joined_pairs(merged_pieces) -> set[str]:
    """Every two characters that stand side by side in some merge result: the only places where
    a token can join two characters of a word."""
    return {p[k:k + 2] for p in merged_pieces for k in range(len(p) - 1)}


def independent_parts(word: str, vocab: dict[str, int], joined: set[str]) -> list[str]:
    """The word cut between each two characters that are both in the vocabulary (so neither
    becomes byte tokens or <unk>) and side by side in no merge result: "▁the▁cat" -> ["▁the",
    "▁cat"] when no merge result holds "e▁"."""
    parts, start = [], 0
    for i in range(1, len(word)):
        if word[i - 1:i + 1] not in joined and word[i - 1] in vocab and word[i] in vocab:
            parts.append(word[start:i])
            start = i
    parts.append(word[start:])
    return parts
