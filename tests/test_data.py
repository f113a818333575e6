"""data.py: sources, prepare (round trip, split, dtype, determinism), batches and their state."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from logitlab.data import tokens as data
from logitlab.data.batches import IGNORE_INDEX
from logitlab.tokenizer.core import Tokenizer

EOT = "<|endoftext|>"


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens + <|endoftext|> = 257 ids: no merges, so any text round-trips."""
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=[EOT])


def small_bpe() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"t", b"h"), (b"th", b"e"), (b" ", b"the")]
    for j, (a, b) in enumerate(merges):
        vocab[256 + j] = a + b
    return Tokenizer(vocab, merges, special_tokens=[EOT])


DOCS = [f"document {k}: the quick brown fox {'jumps ' * (k % 5)}über 🦊 <|endoftext|> literal\n" for k in range(40)]


def _write_docs(tmp_path, docs=DOCS):
    d = tmp_path / "docs"
    d.mkdir()
    for k, text in enumerate(docs):
        (d / f"{k:03d}.txt").write_text(text, encoding="utf-8")
    return d


def _split_docs(out, tok, split):
    manifest = data.read_manifest(out)
    ids = data.load_tokens(out, split).tolist()
    assert ids[-1] == manifest["eot_id"]
    pieces, cur = [], []
    for i in ids:
        if i == tok.eot_id:
            pieces.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return pieces


@pytest.mark.parametrize("make_tok", [byte_tokenizer, small_bpe])
def test_decode_of_prepare_is_the_text(tmp_path, make_tok):
    tok = make_tok()
    src = _write_docs(tmp_path)
    manifest = data.prepare_corpus([src], tok, tmp_path / "out", val_fraction=0.1, workers=1)
    assert manifest["dtype"] == "uint16" and manifest["documents"] == len(DOCS)
    train = _split_docs(tmp_path / "out", tok, "train")
    val = _split_docs(tmp_path / "out", tok, "val")
    splits = data.split_of_documents(len(DOCS), 0.1)
    assert train == [d for d, s in zip(DOCS, splits) if s == "train"]
    assert val == [d for d, s in zip(DOCS, splits) if s == "val"]
    # the special-token string inside the text is plain text, not the separator
    assert sum(1 for i in data.load_tokens(tmp_path / "out", "train") if i == tok.eot_id) == len(train)


def test_validation_split_disjoint_deterministic_and_worker_independent(tmp_path):
    tok = small_bpe()
    src = _write_docs(tmp_path)
    m1 = data.prepare_corpus([src], tok, tmp_path / "a", val_fraction=0.2, workers=1)
    m2 = data.prepare_corpus([src], tok, tmp_path / "b", val_fraction=0.2, workers=2)
    for split in ("train", "val"):
        assert (tmp_path / "a" / f"{split}.bin").read_bytes() == (tmp_path / "b" / f"{split}.bin").read_bytes()
    assert m1["splits"] == m2["splits"]
    train, val = set(_split_docs(tmp_path / "a", tok, "train")), set(_split_docs(tmp_path / "a", tok, "val"))
    assert not train & val
    assert len(val) == 8 and len(train) == 32  # exactly floor(40 * 0.2), spread evenly
    assert m1["splits"]["val"]["documents"] == 8
    assert m1["tokenizer_fingerprint"] == tok.fingerprint()


def test_jsonl_parquet_globs_and_errors(tmp_path):
    tok = byte_tokenizer()
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": f"line {i}"}) for i in range(5)) + "\n")
    docs = list(data.iter_documents(data.resolve_sources([tmp_path / "a.jsonl"]), text_field="body"))
    assert docs == [f"line {i}" for i in range(5)]
    with pytest.raises(ValueError, match="no field 'text'"):
        list(data.iter_documents([tmp_path / "a.jsonl"]))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["alpha", "beta", None, "gamma"]}), tmp_path / "b.parquet")
    assert list(data.iter_documents([tmp_path / "b.parquet"], column="content")) == ["alpha", "beta", "gamma"]
    with pytest.raises(ValueError, match="no column 'text'"):
        list(data.iter_documents([tmp_path / "b.parquet"]))
    files = data.resolve_sources([str(tmp_path / "*.jsonl"), tmp_path / "b.parquet"])
    assert [f.name for f in files] == ["a.jsonl", "b.parquet"]
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.resolve_sources([tmp_path / "missing.txt"])
    with pytest.raises(FileNotFoundError, match="matched no files"):
        data.resolve_sources([str(tmp_path / "*.nothing")])
    m = data.prepare_corpus([tmp_path / "b.parquet"], tok, tmp_path / "p", val_fraction=0.0, column="content")
    assert m["splits"]["train"]["documents"] == 3 and m["splits"]["val"]["tokens"] == 0


def test_token_dtype_widens_past_65536():
    assert data.token_dtype(65536) == np.uint16
    assert data.token_dtype(65537) == np.uint32
    assert data.token_dtype(50257) == np.uint16


def test_default_corpus_is_stdlib_source():
    files = data.default_corpus_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert any(f.name == "argparse.py" for f in files)


def _tokens(n=1000):
    return np.arange(n, dtype=np.uint16) % 251


def test_random_windows_shift_determinism_and_resume():
    toks = _tokens()
    s = data.RandomWindows(toks, seq_len=16, batch_size=4, seed=7)
    x, y = s.next()
    assert x.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    starts = s.offsets(0)
    for row, st in zip(x.tolist(), starts):
        assert row == toks[st:st + 16].astype(np.int64).tolist()
    batches = [s.next() for _ in range(3)]
    again = data.RandomWindows(toks, seq_len=16, batch_size=4, seed=7)
    again.next()
    state = again.state_dict()
    resumed = data.RandomWindows(toks, seq_len=16, batch_size=4, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for bx, by in batches:
        rx, ry = resumed.next()
        assert torch.equal(bx, rx) and torch.equal(by, ry)
    other = data.RandomWindows(toks, seq_len=16, batch_size=4, seed=8)
    assert not torch.equal(other.next()[0], x)
    with pytest.raises(ValueError, match="seed"):
        resumed.load_state_dict(dict(state, seed=8))


def test_rank_slices_make_up_the_global_batch():
    toks = _tokens()
    full = data.RandomWindows(toks, 8, 6, seed=3).next()[0]
    parts = [data.RandomWindows(toks, 8, 6, seed=3, rank=r, world_size=3).next()[0] for r in range(3)]
    assert torch.equal(torch.cat(parts), full)
    with pytest.raises(ValueError, match="world_size"):
        data.RandomWindows(toks, 8, 5, rank=0, world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        data.RandomWindows(toks[:5], 8, 2)


def test_eval_windows_are_sequential_and_fixed():
    toks = _tokens(200)
    batches = list(data.eval_windows(toks, seq_len=10, batch_size=4, max_tokens=100))
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    assert xs.shape == (10, 10)
    assert xs.flatten().tolist() == toks[:100].astype(np.int64).tolist()
    assert ys.flatten().tolist() == toks[1:101].astype(np.int64).tolist()
    again = torch.cat([x for x, _ in data.eval_windows(toks, 10, 4, 100)])
    assert torch.equal(xs, again)
    r0 = [x for x, _ in data.eval_windows(toks, 10, 4, 100, rank=0, world_size=2)]
    r1 = [x for x, _ in data.eval_windows(toks, 10, 4, 100, rank=1, world_size=2)]
    assert sum(x.shape[0] for x in r0 + r1) == 10


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n_windows", [1, 2, 3, 5, 9, 17])
@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_eval_windows_give_every_rank_the_same_number_of_batches(world_size, n_windows, batch_size):
    """Each batch is a forward, and a sharded model's forward a collective: a rank with one batch
    fewer would leave the others waiting. Padding batches hold only ignored targets, so the
    windows scored over all ranks are still each window once."""
    toks = _tokens(200)
    per_rank = [list(data.eval_windows(toks, 10, batch_size, 10 * n_windows, r, world_size))
                for r in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1, [len(b) for b in per_rank]
    scored = sorted(int(x[i, 0]) for batches in per_rank for x, y in batches for i in range(len(x))
                    if (y[i] != IGNORE_INDEX).all())
    assert scored == sorted(int(toks[10 * k]) for k in range(n_windows))
    for batches in per_rank:
        for x, y in batches:
            ignored = (y == IGNORE_INDEX)
            assert ignored.all(dim=1).eq(ignored.any(dim=1)).all()   # whole padding rows, never part of one
            assert (x >= 0).all()                                        # the inputs stay token ids


def test_one_file_holds_out_the_tail_of_the_token_stream(tmp_path):
    tok = byte_tokenizer()
    src = tmp_path / "one.txt"
    text = "".join(DOCS)
    src.write_text(text, encoding="utf-8")
    manifest = data.prepare_corpus([src], tok, tmp_path / "out", val_fraction=0.01, workers=1, min_val_tokens=65)
    n = len(text.encode("utf-8")) + 1
    n_val = max(65, round(0.01 * n))
    assert manifest["validation"] == "tail" and manifest["val_rule"] == "tail of the token stream"
    assert manifest["val_tail_tokens"] == n_val
    assert manifest["splits"]["val"]["tokens"] == n_val and manifest["splits"]["train"]["tokens"] == n - n_val
    assert manifest["splits"]["val"]["documents"] == 0 and "last" in manifest["val_note"]
    train, val = data.load_tokens(tmp_path / "out", "train"), data.load_tokens(tmp_path / "out", "val")
    whole = tok.encode_ordinary(text) + [tok.eot_id]
    assert train.tolist() + val.tolist() == whole  # disjoint: the tail, in order, after the rest
    again = data.prepare_corpus([src], tok, tmp_path / "again", val_fraction=0.01, workers=2, min_val_tokens=65)
    assert again["splits"] == manifest["splits"]
    assert (tmp_path / "again" / "val.bin").read_bytes() == (tmp_path / "out" / "val.bin").read_bytes()


def test_few_files_hold_out_the_tail_and_val_fraction_zero_says_none(tmp_path):
    tok = byte_tokenizer()
    src = _write_docs(tmp_path, DOCS[:10])
    m = data.prepare_corpus([src], tok, tmp_path / "a", val_fraction=0.01, workers=1)
    assert m["validation"] == "tail" and m["splits"]["val"]["tokens"] >= 1
    assert m["splits"]["train"]["documents"] == 10
    none = data.prepare_corpus([src], tok, tmp_path / "b", val_fraction=0.0, workers=1)
    assert none["validation"] == "none" and none["splits"]["val"]["tokens"] == 0
    assert "no validation" in none["val_note"]
    docs = data.prepare_corpus([src], tok, tmp_path / "d", val_fraction=0.1, workers=1)
    assert docs["validation"] == "documents" and docs["val_rule"] == data.DOCUMENT_RULE


@pytest.mark.parametrize("n,f,window,expected", [(1000, 0.01, 0, 10), (1000, 0.01, 129, 129), (100, 0.01, 129, 1),
                                                  (1000, 0.001, 0, 1), (1, 0.5, 0, 0), (300, 0.01, 129, 129)])
def test_tail_size(n, f, window, expected):
    assert data.tail_size(n, f, window) == expected
