"""Deduplication: exact (a hash of the normalised text) and near-duplicate (MinHash + LSH bands).

dedup.py owns the pieces and the rule:

- `normalise`: NFKC, lower case, every run of whitespace one space, stripped; `exact_hash` is a
  64-bit BLAKE2b of it, so documents that differ only in case or spacing are exact duplicates.
- `shingles`: the set of word n-grams of the normalised text (words are runs of letters and
  digits); a document shorter than n words is one shingle.
- `signature`: the MinHash of the shingles through `datasketch.MinHash` (bands x rows
  permutations of its 32-bit "affine32" scheme, a fixed seed), as uint32 values; `band_keys`
  hashes each band of `rows` values to one 64-bit key. Two documents of Jaccard similarity s
  share at least one band key with probability 1 - (1 - s^rows)^bands, an S-curve that rises
  steepest near `implied_threshold` = (1/bands)^(1/rows).
- the rule: documents are visited in the global order (sources in the order given, files sorted
  within a source, lines/rows in file order), and a document is removed when ANY earlier document
  has the same exact hash ("exact") or shares a band key with it ("near"). So the first document
  of every group connected by band collisions is kept: the union-find clusters other pipelines
  build, without building them. `Deduplicator` applies the rule one document at a time (the
  reference); `duplicate_codes` applies it to whole columns of keys with a stable sort per band
  (what merge uses: one column of n keys in memory at a time, no Python sets). A test checks they
  agree.

Documents are hashed where they are read (each worker of `logitlab prepare --num-shards`), and the
decision is taken once, over all workers' keys in order, by `logitlab prepare merge`: signatures
first, then a merge. It imports nothing from logitlab but the optional compiled sibling
_text_fast.c (`ascii_normalised` in one C pass when the install built it; the same bytes, tested);
datasketch is imported when a signature is first computed.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

import numpy as np

try:  # compiled from _text_fast.c at install when a C compiler is present (setup.py: optional extension)
    from logitlab.data._text_fast import ascii_normalised as _native_ascii_normalised
except ImportError:  # pragma: no cover - depends on the install
    _native_ascii_normalised = None

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class DedupConfig:
    """`exact` / `near` switch the two kinds on; `bands` x `rows` MinHash permutations over word
    `ngram`s, seeded with `seed`."""

    exact: bool = False
    near: bool = False
    bands: int = 16
    rows: int = 8
    ngram: int = 5
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("bands", "rows", "ngram"):
            if getattr(self, name) < 1:
                raise ValueError(f"dedup option {name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    @property
    def threshold(self) -> float:
        return implied_threshold(self.bands, self.rows)


def implied_threshold(bands: int, rows: int) -> float:
    """The Jaccard similarity (1/bands)^(1/rows) near which the LSH S-curve rises steepest."""
    return (1.0 / bands) ** (1.0 / rows)


def collision_probability(similarity: float, bands: int, rows: int) -> float:
    """Probability that two documents of Jaccard `similarity` share at least one band."""
    return 1.0 - (1.0 - similarity ** rows) ** bands


def normalise(text: str) -> str:
    """NFKC, lower case, runs of whitespace as one space, stripped: str.split() splits at exactly
    the characters the regex \\s matches, so this is re.sub(r"\\s+", " ", t).strip(), in one C pass."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


_TO_SPACE = bytes(32 if b < 128 and chr(b).isspace() else b for b in range(256))  # what str.split() splits at
_SPACES = re.compile(b"  +")


def ascii_normalised(text: str) -> bytes:
    """normalise(text).encode() for an ASCII text, with no str per word: NFKC leaves ASCII as it
    is, so this is the lower-cased bytes with every whitespace byte a space, each run of spaces
    one, and none at either end."""
    return _SPACES.sub(b" ", text.encode("ascii").lower().translate(_TO_SPACE)).strip(b" ")


def exact_hash(text: str) -> int:
    """64-bit hash of the normalised text (of ascii_normalised for an ASCII text, compiled when
    built: the same bytes)."""
    if not text.isascii():
        data = normalise(text).encode("utf-8")
    else:
        data = (_native_ascii_normalised or ascii_normalised)(text)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def shingles(text: str, n: int) -> set[bytes]:
    """The word n-grams of the normalised text, each as UTF-8 bytes joined by spaces."""
    words = _WORD.findall(normalise(text))
    if len(words) < n:
        return {" ".join(words).encode("utf-8")}
    return {" ".join(words[i:i + n]).encode("utf-8") for i in range(len(words) - n + 1)}


SCHEME = "affine32"  # datasketch's 32-bit permutation scheme: the values are uint32
_PERMUTATIONS: dict = {}


def signature(text: str, cfg: DedupConfig) -> np.ndarray:
    """MinHash signature (num_perm,) uint32 of the document's shingles (datasketch.MinHash)."""
    from datasketch import MinHash

    key = (cfg.num_perm, cfg.seed)
    if key not in _PERMUTATIONS:  # the permutations depend on (num_perm, seed) only: made once
        _PERMUTATIONS[key] = MinHash(num_perm=cfg.num_perm, seed=cfg.seed, scheme=SCHEME).permutations
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed, permutations=_PERMUTATIONS[key], scheme=SCHEME)
    m.update_batch(sorted(shingles(text, cfg.ngram)))
    return np.asarray(m.hashvalues, dtype=np.uint32)


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(bands,) uint64: one key per band of `rows` consecutive signature values."""
    if sig.shape != (bands * rows,):
        raise ValueError(f"signature has shape {sig.shape}, expected ({bands * rows},) = bands x rows")
    keys = np.empty(bands, dtype=np.uint64)
    for b in range(bands):
        digest = hashlib.blake2b(sig[b * rows:(b + 1) * rows].tobytes(), digest_size=8).digest()
        keys[b] = int.from_bytes(digest, "little")
    return keys


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Share of equal MinHash values: an unbiased estimate of the shingles' Jaccard similarity."""
    return float(np.mean(a == b))


RULE = ("documents in global order; one is removed when any earlier document has its normalised-text hash "
        "(exact) or shares a MinHash LSH band key with it (near)")
KEEP, EXACT, NEAR = 0, 1, 2  # duplicate codes


class Deduplicator:
    """The rule one document at a time, in global order (module docstring): the reference for
    `duplicate_codes`. Memory: Python sets of every document's keys."""

    def __init__(self, cfg: DedupConfig) -> None:
        self.cfg = cfg
        self._exact: set[int] = set()
        self._bands: list[set[int]] = [set() for _ in range(cfg.bands)]

    def check(self, exact: int, bands: np.ndarray | None) -> str | None:
        """"exact" or "near" when an earlier document has the same hash or a shared band key,
        else None; the document's keys are recorded either way."""
        keys = [int(k) for k in bands] if self.cfg.near and bands is not None else []
        verdict = None
        if self.cfg.exact and exact in self._exact:
            verdict = "exact"
        elif any(k in table for k, table in zip(keys, self._bands)):
            verdict = "near"
        self._exact.add(exact)
        for k, table in zip(keys, self._bands):
            table.add(k)
        return verdict


def repeats_earlier(keys: np.ndarray) -> np.ndarray:
    """(n,) bool: True where keys[i] equals some keys[j], j < i. A stable sort puts each key's
    occurrences together in index order; all but the first of each run repeat an earlier one."""
    order = np.argsort(keys, kind="stable")
    ranked = keys[order]
    later = np.zeros(len(keys), dtype=bool)
    later[1:] = ranked[1:] == ranked[:-1]
    out = np.empty(len(keys), dtype=bool)
    out[order] = later
    return out


def duplicate_codes(exact: np.ndarray, band_column, cfg: DedupConfig) -> np.ndarray:
    """(n,) int8 codes (KEEP, EXACT, NEAR) of n documents in global order, from their exact hashes
    (n,) and `band_column(b)` -> the (n,) keys of band b (read one band at a time)."""
    codes = np.zeros(len(exact), dtype=np.int8)
    if cfg.exact:
        codes[repeats_earlier(np.asarray(exact))] = EXACT
    if cfg.near:
        near = np.zeros(len(exact), dtype=bool)
        for b in range(cfg.bands):
            near |= repeats_earlier(np.asarray(band_column(b)))
        codes[near & (codes == KEEP)] = NEAR
    return codes


def report(codes: np.ndarray, cfg: DedupConfig) -> dict:
    """The manifest's dedup entry: the options, the implied threshold, what was removed, the rule."""
    n, exact, near = len(codes), int((codes == EXACT).sum()), int((codes == NEAR).sum())
    return {"exact": cfg.exact, "near": cfg.near, "bands": cfg.bands, "rows": cfg.rows, "ngram": cfg.ngram,
            "seed": cfg.seed, "threshold": round(cfg.threshold, 4), "documents": n,
            "removed": {"exact": exact, "near": near}, "duplicate_rate": (exact + near) / n if n else 0.0,
            "rule": RULE}
