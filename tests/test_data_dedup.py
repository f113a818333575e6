"""dedup.py and mixture.py: exact and MinHash near-duplicates at planted Jaccard similarities (against
datasketch's own LSH index), the keep-first rule, and the mixture's weights and sampling."""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logitlab.data import dedup as dd
from logitlab.data import mixture as mx

WORDS = [f"w{i}" for i in range(20_000)]


def planted_pair(n: int, shared: int, offset: int) -> tuple[str, str]:
    """Two documents of n distinct words each sharing `shared` words: word-set Jaccard
    shared / (2n - shared)."""
    base = WORDS[offset:offset + n]
    other = base[:shared] + WORDS[offset + n:offset + 2 * n - shared]
    return " ".join(base), " ".join(other)


def test_exact_hash_ignores_case_and_spacing_only():
    assert dd.exact_hash("Hello  World\n") == dd.exact_hash("hello world")
    assert dd.exact_hash("hello world") != dd.exact_hash("hello world!")
    assert dd.normalise("  A\tb\n\nC ") == "a b c"
    # every whitespace character of Unicode lies below U+3001: str.split() and the regex \s agree on all
    above = "".join(map(chr, range(0x3001, 0x110000)))
    assert not re.search(r"\s", above) and not any(map(str.isspace, above))
    every = "".join(map(chr, range(0x3001)))
    text = "x" + "x".join(every[i:i + 3] for i in range(0, len(every), 3)) + " "
    assert dd.normalise(text) == re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).lower()).strip()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([chr(i) for i in range(128)] + ["  ", "\n\n", "Ab"]), max_size=40).map("".join))
def test_ascii_normalised_equals_normalise(text):
    assert dd.ascii_normalised(text) == dd.normalise(text).encode("utf-8")
    assert dd.exact_hash(text) == int.from_bytes(
        hashlib.blake2b(dd.normalise(text).encode("utf-8"), digest_size=8).digest(), "little")


def test_shingles_are_word_ngrams():
    assert dd.shingles("The cat, the hat.", 2) == {b"the cat", b"cat the", b"the hat"}
    assert dd.shingles("one two", 5) == {b"one two"}


@pytest.mark.parametrize("n,shared,jaccard", [(190, 180, 0.9), (150, 100, 0.5), (150, 50, 0.2)])
def test_planted_pairs_have_known_jaccard_and_minhash_estimates_it(n, shared, jaccard):
    a, b = planted_pair(n, shared, 0)
    sa, sb = dd.shingles(a, 1), dd.shingles(b, 1)
    assert len(sa & sb) / len(sa | sb) == pytest.approx(jaccard)
    cfg = dd.DedupConfig(near=True, bands=32, rows=8, ngram=1)
    assert dd.estimated_jaccard(dd.signature(a, cfg), dd.signature(b, cfg)) == pytest.approx(jaccard, abs=0.12)


def test_lsh_catches_high_similarity_and_spares_low():
    cfg = dd.DedupConfig(near=True, bands=16, rows=8, ngram=1)  # threshold (1/16)^(1/8) ~ 0.707
    assert cfg.threshold == pytest.approx(0.7071, abs=1e-4)
    assert dd.collision_probability(0.9, 16, 8) > 0.999 and dd.collision_probability(0.2, 16, 8) < 1e-3
    for shared, n, expect_removed in ((180, 190, 20), (50, 150, 0)):
        dedup = dd.Deduplicator(cfg)
        removed = 0
        for pair in range(20):
            for text in planted_pair(n, shared, pair * 400):
                sig = dd.signature(text, cfg)
                removed += dedup.check(dd.exact_hash(text), dd.band_keys(sig, cfg.bands, cfg.rows)) == "near"
        assert removed == expect_removed, (shared, n)


def test_band_collisions_equal_datasketch_lsh():
    from datasketch import MinHash, MinHashLSH

    cfg = dd.DedupConfig(near=True, bands=8, rows=4, ngram=1)
    texts = [t for k in range(6) for t in planted_pair(60, [58, 40, 30, 20, 45, 55][k], k * 200)]
    sigs = [dd.signature(t, cfg) for t in texts]
    keys = [set(enumerate(int(x) for x in dd.band_keys(s, cfg.bands, cfg.rows))) for s in sigs]
    lsh = MinHashLSH(num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
    for i, s in enumerate(sigs):
        lsh.insert(str(i), MinHash(num_perm=cfg.num_perm, seed=cfg.seed, hashvalues=s, scheme=dd.SCHEME))
    for i, s in enumerate(sigs):
        ours = {j for j in range(len(texts)) if keys[i] & keys[j]}
        theirs = {int(j) for j in lsh.query(MinHash(num_perm=cfg.num_perm, seed=cfg.seed, hashvalues=s,
                                                    scheme=dd.SCHEME))}
        assert ours == theirs, i
    # and our signature is datasketch's MinHash of the same shingles
    direct = MinHash(num_perm=cfg.num_perm, seed=cfg.seed, scheme=dd.SCHEME)
    direct.update_batch(list(dd.shingles(texts[0], 1)))
    assert np.array_equal(np.asarray(direct.hashvalues, dtype=np.uint32), sigs[0])


def _keys(texts, cfg):
    exact = np.array([dd.exact_hash(t) for t in texts], dtype=np.uint64)
    bands = np.stack([dd.band_keys(dd.signature(t, cfg), cfg.bands, cfg.rows) for t in texts])
    return exact, bands


def test_first_occurrence_is_kept_and_chains_are_one_group():
    cfg = dd.DedupConfig(exact=True, near=True, bands=16, rows=8, ngram=1)

    def run(texts):
        exact, bands = _keys(texts, cfg)
        ref = dd.Deduplicator(cfg)
        verdicts = [ref.check(int(e), b) for e, b in zip(exact, bands)]
        codes = dd.duplicate_codes(exact, lambda b: bands[:, b], cfg)
        assert [{None: dd.KEEP, "exact": dd.EXACT, "near": dd.NEAR}[v] for v in verdicts] == codes.tolist()
        return verdicts, codes

    a, near_a = planted_pair(190, 185, 0)
    other = planted_pair(190, 0, 5000)[0]
    verdicts, codes = run([a, "  " + a.upper(), near_a, other])
    assert verdicts == [None, "exact", "near", None]
    rep = dd.report(codes, cfg)
    assert rep["removed"] == {"exact": 1, "near": 1} and rep["duplicate_rate"] == 0.5
    assert run([near_a, a])[0] == [None, "near"]  # the order decides which one is kept
    # a chain: 1 shares band 0 with 0, and 2 shares band 1 with 1 only: one group, its first kept
    chain = np.array([[1, 2], [1, 3], [4, 3]], dtype=np.uint64)
    two = dd.DedupConfig(near=True, bands=2, rows=1)
    assert dd.duplicate_codes(np.arange(3, dtype=np.uint64), lambda b: chain[:, b], two).tolist() == [0, 2, 2]
    only_exact = dd.DedupConfig(exact=True)
    assert dd.duplicate_codes(np.array([5, 6, 5, 5], dtype=np.uint64), None, only_exact).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="bands"):
        dd.DedupConfig(bands=0)


def test_column_rule_agrees_with_the_reference_on_many_collisions():
    rng = np.random.default_rng(0)
    cfg = dd.DedupConfig(exact=True, near=True, bands=4, rows=2)
    exact = rng.integers(0, 60, size=500).astype(np.uint64)  # small key spaces: many repeats
    bands = rng.integers(0, 400, size=(500, 4)).astype(np.uint64)
    ref = dd.Deduplicator(cfg)
    expected = [{None: 0, "exact": 1, "near": 2}[ref.check(int(e), b)] for e, b in zip(exact, bands)]
    assert dd.duplicate_codes(exact, lambda b: bands[:, b], cfg).tolist() == expected
    assert 0 < expected.count(2) < 500 and expected.count(1) > 0
    assert dd.repeats_earlier(np.array([3, 1, 3, 2, 1, 3])).tolist() == [False, False, True, False, True, True]


def test_validation_mask_is_the_document_rule():
    from logitlab.data.merge import validation_mask
    from logitlab.data.tokens import is_validation

    for f in (0.0, 0.01, 0.1, 0.3333, 0.5):
        j = np.arange(5000)
        assert validation_mask(j, f).tolist() == [is_validation(int(k), f) for k in j]


# --------------------------------------------------------------------------------------------
# mixtures
# --------------------------------------------------------------------------------------------

def test_parse_mix_string_and_toml(tmp_path):
    assert mx.parse_mix("web=0.7,code=0.3") == pytest.approx({"web": 0.7, "code": 0.3})
    assert mx.parse_mix("a=2, b=6") == {"a": 0.25, "b": 0.75}
    assert mx.parse_mix(None) is None
    f = tmp_path / "mix.toml"
    f.write_text("[mix]\nweb = 3\ncode = 1\n")
    assert mx.parse_mix(str(f)) == {"web": 0.75, "code": 0.25}
    for bad, match in (("web", "NAME=WEIGHT"), ("web=x", "number"), ("web=-1", ">= 0"), ("a=0", "no positive"),
                       ("a=1,a=2", "twice")):
        with pytest.raises(ValueError, match=match):
            mx.parse_mix(bad)


def test_rates_and_copies_are_deterministic_and_unbiased():
    rates = mx.sampling_rates({"web": 0.5, "code": 0.5}, {"web": 900, "code": 100})
    assert rates == pytest.approx({"web": 500 / 900, "code": 5.0})
    assert mx.copies(2.0, 0, 7) == 2 and mx.copies(0.0, 0, 7) == 0
    n = mx.copies_of(2.5, 3, np.arange(20_000))
    assert set(n.tolist()) == {2, 3} and n.mean() == pytest.approx(2.5, abs=0.02)
    assert np.array_equal(n, mx.copies_of(2.5, 3, np.arange(20_000)))
    assert not np.array_equal(n, mx.copies_of(2.5, 4, np.arange(20_000)))
    with pytest.raises(ValueError, match="no weight"):
        mx.sampling_rates({"web": 1.0}, {"web": 5, "code": 5})
    with pytest.raises(ValueError, match="does not have"):
        mx.sampling_rates({"web": 0.5, "news": 0.5}, {"web": 5})
    with pytest.raises(ValueError, match="no training tokens"):
        mx.sampling_rates({"web": 0.5, "code": 0.5}, {"web": 5, "code": 0})
    assert mx.realised({"a": 30, "b": 10}, {"a": 0.5, "b": 0.5})["a"] == {"tokens": 30, "share": 0.75, "weight": 0.5}
