"""Learning byte-level BPE merges: streamed, parallel pre-tokenization and incremental pair counts.

`train_bpe(paths, vocab_size, special_tokens)` returns `(vocab, merges)`; `train_tokenizer(...)`
wraps them in a `Tokenizer`. Encoding lives in core.py.

The algorithm, and why it is fast:

1. pretokenize.py reads the files in blocks, in worker processes (all cores by default),
   splits the text at special tokens (so no merge crosses a document boundary), pre-tokenizes
   it and counts each distinct pre-token once; memory is bounded by the distinct pre-tokens.
2. Each distinct pre-token becomes a word: a list of token ids with a frequency. Ids 0..255 are
   the byte values, merge i gets id 256 + i, special tokens come last.
3. Pair counts live in a dict keyed by one int per pair (left << 20 | right), with an index
   pair -> words that contain it. Merging (a, b) -> c visits only the words in that index and
   adjusts the counts of the pairs around each occurrence (x a b y: x a, b y go down by the word's
   frequency, x c, c y go up), so nothing is recounted.
4. The best pair comes from a heap with lazy deletion: entries are (-count, tie key, pair); a
   popped entry whose count is stale is pushed back with the current count. Only pairs whose
   count grew (those with the new token) are pushed after a merge.

Steps 3 and 4 also exist in C (_bpe_fast.c, built at install when a C compiler is present; see
setup.py), with the same data layout and rule: `learn_merges` runs it by default and the Python
loop (`learn_merges_python`) otherwise; tests check that both give identical merges. The C file
also counts GPT-2 pre-tokens of ASCII text (pretokenize.py). On 30 MB of Python source with a 32k
vocabulary the compiled merge loop takes about a tenth of the Python loop's time.

Rule: the most frequent pair wins; ties go to the lexicographically greatest pair of byte strings
(`max` over `(count, (bytes_a, bytes_b))`). When a merge's result already exists as a token
(different parts, same bytes, which happens rarely), the merge is recorded and reuses that token's
id, as Hugging Face `tokenizers` does; the vocabulary then grows by one less and training goes on
until it has `vocab_size` ids.

Non-UTF-8 input is decoded with U+FFFD replacement, with a warning naming the file and the byte
offset of the first bad byte. Results do not depend on the number of workers.
"""

from __future__ import annotations

import heapq
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from logitlab.tokenizer.core import Tokenizer, check_special_tokens, resolve_pattern
from logitlab.tokenizer.pretokenize import count_pretokens, expand_paths, stdlib_files

try:  # built from _bpe_fast.c at install when a C compiler is present (setup.py: optional extension)
    from logitlab.tokenizer import _bpe_fast as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

__all__ = ["BPEConfig", "ProgressCallback", "ShortVocabularyWarning", "train_bpe", "train_tokenizer", "learn_merges",
           "learn_merges_python", "native_available", "reference_merge_counts", "reference_merges", "count_pretokens",
           "expand_paths", "stdlib_files"]


class ShortVocabularyWarning(UserWarning):
    """Training ended with fewer merges than vocab_size asked for: the corpus ran out of pairs."""


SHIFT = 20  # pair key = left << SHIFT | right; ids stay below 2**20
MASK = (1 << SHIFT) - 1


# ------------------------------------------------------------------------------ merges
def native_available() -> bool:
    """Whether the compiled merge loop (logitlab.tokenizer._bpe_fast) was built by this install."""
    return _native is not None


def _tie_key(token: bytes) -> bytes:
    """A byte string whose order is the reverse of `token`'s (prefixes sort after longer strings),
    so a min-heap on (-count, key(a) + key(b)) pops the greatest (a, b) among equal counts."""
    return bytes([v for x in token for v in (0, 255 - x)]) + b"\x01\x00"


def learn_merges(word_counts: dict[bytes, int], n_merges: int, first_id: int = 256,
                 progress=None, native: bool | None = None) -> list[tuple[bytes, bytes]]:
    """BPE merges from distinct words (bytes -> frequency). The first new token gets `first_id`.

    `native`: None (default) runs the compiled merge loop (_bpe_fast.c) when the install built it
    and the Python one otherwise; False always runs Python; True requires the compiled one. Both
    give identical merges (tested); the compiled loop is about ten times faster."""
    if native is None:
        native = _native is not None
    if native:
        if _native is None:
            raise ValueError("native=True, but the compiled merge loop logitlab.tokenizer._bpe_fast is not "
                             "built (reinstall with a C compiler available: pip install -e .)")
        items = [(w, f) for w, f in word_counts.items() if len(w) > 1]
        return _native.learn_merges([w for w, _ in items], [f for _, f in items], n_merges, first_id,
                                    progress)
    return learn_merges_python(word_counts, n_merges, first_id, progress)


def learn_merges_python(word_counts: dict[bytes, int], n_merges: int, first_id: int = 256,
                        progress=None) -> list[tuple[bytes, bytes]]:
    """The merge loop in Python (the same algorithm as the compiled one): see the module docstring."""
    words: list[list[int]] = []
    freqs: list[int] = []
    for w, f in word_counts.items():
        if len(w) > 1:
            words.append(list(w))
            freqs.append(f)
    counts: dict[int, int] = {}
    where: dict[int, list[int]] = {}  # pair -> words holding it (each word once; may be stale)
    for wi, word in enumerate(words):
        f = freqs[wi]
        for k in [a << SHIFT | b for a, b in zip(word, word[1:])]:
            counts[k] = counts.get(k, 0) + f
            s = where.get(k)
            if s is None:
                where[k] = [wi]
            elif s[-1] != wi:  # words are indexed one at a time: a repeat is always the last
                s.append(wi)
    tok_bytes = [bytes([b]) for b in range(256)]
    tie = [_tie_key(t) for t in tok_bytes]
    existing: dict[bytes, int] = {t: i for i, t in enumerate(tok_bytes)}
    heap = [(-c, tie[k >> SHIFT] + tie[k & MASK], k) for k, c in counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[bytes, bytes]] = []
    next_id = first_id
    heappop, heappush = heapq.heappop, heapq.heappush
    while next_id < first_id + n_merges and heap:
        negc, key, k = heappop(heap)
        c = counts.get(k, 0)
        if c != -negc:
            if c > 0:
                heappush(heap, (-c, key, k))
            continue
        a, b = k >> SHIFT, k & MASK
        ab = tok_bytes[a] + tok_bytes[b]
        merges.append((tok_bytes[a], tok_bytes[b]))
        new = existing.get(ab)
        if new is None:  # internal ids index tok_bytes; only the count of new tokens depends on first_id
            new = len(tok_bytes)
            next_id += 1
            existing[ab] = new
            tok_bytes.append(ab)
            tie.append(_tie_key(ab))
        fresh = _apply_merge(words, freqs, counts, where, a, b, new, where.pop(k))
        del counts[k]
        for fk in fresh:
            fc = counts[fk]
            if fc > 0:
                heappush(heap, (-fc, tie[fk >> SHIFT] + tie[fk & MASK], fk))
        if progress:
            progress(1)
    return merges


def reference_merges(word_counts: dict[bytes, int], n_merges: int) -> list[tuple[bytes, bytes]]:
    """The slow, obviously correct trainer: recount every pair before each merge. For tests."""
    return [pair for pair, _ in reference_merge_counts(word_counts, n_merges)]


def reference_merge_counts(word_counts: dict[bytes, int], n_merges: int) -> list[tuple[tuple[bytes, bytes], int]]:
    """reference_merges with the count of each merge: [((a, b), n), ...], n how often the pair
    (a, b) occurred, frequency-weighted, when it was chosen (the most of any pair; a tie goes to
    the larger pair, compared as byte strings)."""
    words = {tuple(bytes([x]) for x in w): f for w, f in word_counts.items()}
    merges: list[tuple[tuple[bytes, bytes], int]] = []
    vocab = {bytes([x]) for x in range(256)}
    size = 256
    while size < 256 + n_merges:
        pairs: Counter = Counter()
        for w, f in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += f
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append((best, pairs[best]))
        if best[0] + best[1] not in vocab:
            vocab.add(best[0] + best[1])
            size += 1
        merged: dict = {}
        for w, f in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + f
        words = merged
    return merges


def _apply_merge(words, freqs, counts, where, a: int, b: int, new: int, word_ids: list[int]) -> set[int]:
    """Replace (a, b) by `new` in the given words, left to right; adjust neighbouring pair counts.
    Returns the pair keys whose count grew (each contains `new`)."""
    fresh: set[int] = set()
    get, where_get = counts.get, where.get
    b_key, new_key = b << SHIFT, new << SHIFT
    for wi in word_ids:
        word = words[wi]
        n_a = word.count(a)  # 0 when the (lazy) index lists a word that lost the pair
        if not n_a:
            continue
        n, f = len(word), freqs[wi]
        out: list[int] = []
        copied = search = 0  # word[:copied] is in `out`; look for `a` from `search`
        remaining = n_a  # occurrences of `a` at or after `search`
        while remaining and search < n - 1:
            j = word.index(a, search)
            remaining -= 1
            if j + 1 == n or word[j + 1] != b:
                search = j + 1
                continue
            out += word[copied:j]
            if out:  # left neighbour (may be `new` from the previous occurrence)
                left = out[-1]
                counts[left << SHIFT | a] -= f
                k = left << SHIFT | new
                counts[k] = get(k, 0) + f
                fresh.add(k)
                s = where_get(k)
                if s is None:
                    where[k] = [wi]
                elif s[-1] != wi:
                    s.append(wi)
            if j + 2 < n:  # right neighbour, as it stands before merging
                right = word[j + 2]
                counts[b_key | right] -= f
                k = new_key | right
                counts[k] = get(k, 0) + f
                fresh.add(k)
                s = where_get(k)
                if s is None:
                    where[k] = [wi]
                elif s[-1] != wi:
                    s.append(wi)
            out.append(new)
            copied = search = j + 2
            if a == b:
                remaining -= 1  # word[j + 1] was an `a` too
        if copied:  # at least one occurrence merged
            out += word[copied:]
            words[wi] = out
    return fresh


# ------------------------------------------------------------------------------ entry points
@dataclass(frozen=True)
class BPEConfig:
    """Settings of one training run, checked when built."""

    vocab_size: int = field(metadata={"help": "ids in the vocabulary: 256 bytes + merges + special tokens"})
    special_tokens: tuple[str, ...] = field(default=(), metadata={"help": "never split, never merged; ids last"})
    pattern: str = field(default="gpt2", metadata={"help": "pre-tokenization: gpt2, cl100k, gpt2_digits or a regex"})
    workers: int | None = field(default=None, metadata={"help": "pre-tokenization processes (None: all cores)"})
    glob: str = field(default="**/*", metadata={"help": "files taken from directories"})

    def __post_init__(self):
        object.__setattr__(self, "special_tokens", tuple(check_special_tokens(self.special_tokens)))
        n = len(self.special_tokens)
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 256 + n:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be at least 256 + {n} special "
                             f"token(s) = {256 + n}")
        if self.vocab_size > MASK:
            raise ValueError(f"vocab_size ({self.vocab_size}) must be below {MASK + 1}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers ({self.workers}) must be >= 1 or None")
        object.__setattr__(self, "pattern", resolve_pattern(self.pattern))

    @property
    def n_merges(self) -> int:
        return self.vocab_size - 256 - len(self.special_tokens)


ProgressCallback = Callable[[str, int, int], None]
"""progress(phase, done, total): phase "pretokenize" counts bytes read of the corpus's total,
then phase "merge" counts merges learned of those asked for (fewer when the corpus runs out of
pairs). Called once with done=0 when a phase starts, then after each batch or merge."""


def _phase(progress: ProgressCallback | None, phase: str, total: int) -> Callable[[int], None] | None:
    """A callback taking increments, reporting running totals to `progress` (None: no callback)."""
    if progress is None:
        return None
    done = 0
    progress(phase, done, total)

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress(phase, done, total)

    return advance


def train_bpe(input_path, vocab_size: int, special_tokens: Iterable[str] = (), pattern: str = "gpt2",
              workers: int | None = None, progress: ProgressCallback | None = None, glob: str = "**/*"
              ) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train byte-level BPE on a file, a directory (files matching `glob`) or a list of them.

    Returns (vocab, merges): vocab maps ids 0..vocab_size-1 to bytes (bytes, then merges, then
    special tokens); merges are (left, right) byte strings in learned order. When the corpus runs
    out of pairs first (a tiny corpus), the vocabulary has fewer ids and a ShortVocabularyWarning
    says how many merges were made of how many asked for; an input with no text at all (empty
    files) is a ValueError naming it.
    `progress(phase, done, total)`, if given, is told how far training has gone (see `ProgressCallback`).
    `stdlib_files()` lists the default corpus."""
    config = BPEConfig(vocab_size, tuple(special_tokens), pattern, workers, glob)
    files = expand_paths(input_path, config.glob)
    specials = list(config.special_tokens)
    total_bytes = sum(f.stat().st_size for f in files)
    pretokens = count_pretokens(files, config.pattern, specials, config.workers,
                                _phase(progress, "pretokenize", total_bytes))
    if not pretokens:
        raise ValueError(f"{_named(files)} holds no text to learn merges from"
                         + (" (it is empty)" if total_bytes == 0 else " outside special tokens"))
    word_counts: Counter = Counter()
    for text, count in pretokens.items():
        word_counts[text.encode("utf-8")] += count
    del pretokens
    merges = learn_merges(word_counts, config.n_merges, progress=_phase(progress, "merge", config.n_merges))
    vocab = {i: bytes([i]) for i in range(256)}
    seen = set(vocab.values())
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            vocab[len(vocab)] = a + b
    for s in specials:
        vocab[len(vocab)] = s.encode("utf-8")
    new_tokens = len(vocab) - 256 - len(specials)  # merges that made a new token
    if new_tokens < config.n_merges:
        sizes = f"{len(files)} file(s), {total_bytes} bytes"
        warnings.warn(f"BPE training learned {new_tokens} of the {config.n_merges} merges that vocab_size "
                      f"{vocab_size} asks for (256 bytes + {config.n_merges} merges + {len(specials)} special "
                      f"token(s)): the corpus ({sizes}) has no more pairs to merge, so the tokenizer has "
                      f"{len(vocab)} ids, not {vocab_size}", ShortVocabularyWarning, stacklevel=2)
    return vocab, merges


def _named(files) -> str:
    """The training input for an error message: the file, or how many files and the first few."""
    if len(files) == 1:
        return str(files[0])
    shown = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"the training input ({len(files)} files: {shown})"


def train_tokenizer(input_path, vocab_size: int, special_tokens: Iterable[str] = (), pattern: str = "gpt2",
                    workers: int | None = None, progress: ProgressCallback | None = None, glob: str = "**/*"
                    ) -> Tokenizer:
    """`train_bpe` wrapped in a `Tokenizer` (same arguments)."""
    specials = list(special_tokens)
    vocab, merges = train_bpe(input_path, vocab_size, specials, pattern, workers, progress, glob)
    return Tokenizer(vocab, merges, special_tokens=specials, pattern=pattern)
