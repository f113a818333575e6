"""The reference BPE trainer's merge counts (bpe.reference_merge_counts): each merge with how often
its pair occurred when it was chosen, on the textbook corpus and against a recount by hand."""

from __future__ import annotations

import random
from collections import Counter

from logitlab.tokenizer.bpe import learn_merges, reference_merge_counts, reference_merges

END = b"\x00"
TEXTBOOK = {b"low" + END: 5, b"lower" + END: 2, b"newest" + END: 6, b"widest" + END: 3}


def test_textbook_corpus_merges_and_counts():
    got = [((a.replace(END, b"</w>"), b.replace(END, b"</w>")), n) for (a, b), n in reference_merge_counts(TEXTBOOK, 6)]
    assert got == [((b"t", b"</w>"), 9), ((b"s", b"t</w>"), 9), ((b"e", b"st</w>"), 9),
                   ((b"o", b"w"), 7), ((b"l", b"ow"), 7), ((b"w", b"est</w>"), 6)]


def _recount(words: dict[bytes, int], merges) -> list[int]:
    """Each merge's count by applying the earlier merges to every word and counting the pair."""
    counts = []
    split = {w: [bytes([x]) for x in w] for w in words}
    for a, b in merges:
        counts.append(sum(n * sum(p == (a, b) for p in zip(split[w], split[w][1:])) for w, n in words.items()))
        for w, parts in split.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = out
    return counts


def test_counts_equal_a_recount_and_the_merges_the_other_trainers_learn():
    rng = random.Random(0)
    words = Counter(bytes(rng.choice(b"abcde") for _ in range(rng.randint(1, 7))) for _ in range(300))
    counted = reference_merge_counts(dict(words), 40)
    merges = [pair for pair, _ in counted]
    assert merges == reference_merges(dict(words), 40) == learn_merges(dict(words), 40)
    assert [n for _, n in counted] == _recount(dict(words), merges)
    assert all(n >= 1 for _, n in counted)
    assert reference_merge_counts({b"a": 3}, 5) == []          # a one-byte word has no pair
