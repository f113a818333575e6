"""The second pass of the scaled-out pipeline: N part directories -> one sharded token directory.

merge.py owns `merge_parts`. It checks that the parts are one job (indices 0..N-1, the same
inputs, options and tokenizer), then in two passes over them in global order:

1. plan (metadata only, docs.bin): deduplicate (dedup.duplicate_codes, first occurrence kept),
   split the kept documents by the document rule of tokens.py (kept document j is validation iff
   floor((j+1)·f) > floor(j·f)), count each source's training tokens, and turn the mixture's
   weights into copies per document (mixture.py; the uniform draw is keyed by the document's
   global index, before dedup);
2. write: copy each kept document's tokens (tokens.bin) `copies` times into train-NNNNN.bin or
   once into val-NNNNN.bin (shards.ShardWriter). When the rule holds out no document and f > 0,
   the tail of the training stream becomes validation, as in the single-file layout.

Beside the shards, filtered.jsonl and duplicates.jsonl name every removed document (id, source,
reason), and manifest.json (format "logitlab-tokens", version 2: each split lists its shards)
holds the per-source counts, filter and dedup reports, realised mixture, the document-length
histogram and bytes per token. The output appears whole or not at all. Everything depends on the documents'
global order only, never on how many parts there were.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from logitlab.data import dedup as dd
from logitlab.data import mixture as mx
from logitlab.data.dedup import DedupConfig
from logitlab.data.filters import FilterStats
from logitlab.data.parts import FILTERED_FILE, doc_dtype, read_part
from logitlab.data.shards import ShardWriter
from logitlab.data.tokens import DOCUMENT_RULE, MANIFEST_FILE, TAIL_RULE, TOKENS_KIND, tail_size
from logitlab.io import workdir

DUPLICATES_FILE = "duplicates.jsonl"
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MB of uint16 per shard
_SAME = ("num_shards", "inputs", "config", "tokenizer_fingerprint", "vocab_size", "dtype", "eot_id", "sources")


@dataclass(frozen=True)
class MergeConfig:
    """The split, the shard size, the mixture weights ({source: weight}, None: as read) and its seed."""

    val_fraction: float = 0.01
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    mix: dict | None = None
    seed: int = 0
    min_val_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {self.shard_tokens}")


def read_parts(part_dirs: Sequence[str | os.PathLike]) -> list[tuple[Path, dict]]:
    """The finished parts of one job, ordered by shard index; errors name what differs."""
    parts = sorted(((Path(d), read_part(d)) for d in part_dirs), key=lambda p: p[1]["shard_index"])
    if not parts:
        raise ValueError("merge needs at least one part directory")
    first = parts[0][1]
    for path, info in parts:
        for key in _SAME:
            if info.get(key) != first.get(key):
                raise ValueError(f"{path} is not from the same job as {parts[0][0]}: {key} differs "
                                 f"({info.get(key)!r} vs {first.get(key)!r})")
    have = [info["shard_index"] for _, info in parts]
    if have != list(range(first["num_shards"])):
        missing = sorted(set(range(first["num_shards"])) - set(have))
        raise ValueError(f"merge needs parts 0..{first['num_shards'] - 1} exactly once; have {have}"
                         + (f", missing {missing}" if missing else ""))
    return parts


def _records(path: Path, info: dict) -> np.ndarray:
    n = info["documents"]
    if n == 0:
        return np.zeros(0, dtype=doc_dtype(info["bands"]))
    return np.memmap(path / "docs.bin", dtype=doc_dtype(info["bands"]), mode="r", shape=(n,))


def _plan(parts, cfg: MergeConfig) -> dict:
    """Per part: each document's split code (-1 duplicate, 0 train, 1 val); dedup report; counts."""
    dcfg = DedupConfig(**parts[0][1]["dedup"])
    recs = [_records(path, info) for path, info in parts]
    exact = np.concatenate([r["exact"] for r in recs])
    codes = dd.duplicate_codes(exact, lambda b: np.concatenate([r["bands"][:, b] for r in recs]), dcfg)
    kept = codes == dd.KEEP
    j = np.cumsum(kept) - 1  # index among kept documents
    split = np.where(kept, np.where(validation_mask(j, cfg.val_fraction), 1, 0), -1).astype(np.int8)
    bounds = np.cumsum([0] + [len(r) for r in recs])
    cut = list(zip(bounds[:-1], bounds[1:]))
    return {"splits": [split[a:b] for a, b in cut], "reasons": [codes[a:b] for a, b in cut],
            "dedup": dd.report(codes, dcfg), "kept": int(kept.sum())}


def validation_mask(j: np.ndarray, val_fraction: float) -> np.ndarray:
    """tokens.is_validation for many indices at once (the same float arithmetic, floored)."""
    j = j.astype(np.float64)
    return np.floor((j + 1) * val_fraction) > np.floor(j * val_fraction)


def _copies(parts, plan: dict, cfg: MergeConfig) -> tuple[list[np.ndarray], dict | None]:
    """Copies of each document in train (0 for val and duplicates), from the mixture's rates."""
    names = parts[0][1]["sources"]
    available = dict.fromkeys(names, 0)
    for (path, info), code in zip(parts, plan["splits"]):
        recs = _records(path, info)
        for s, name in enumerate(names):
            available[name] += int(recs["tokens"][(code == 0) & (recs["source"] == s)].sum())
    rates = mx.sampling_rates(cfg.mix, available) if cfg.mix is not None else None
    out, offset = [], 0
    for (path, info), code in zip(parts, plan["splits"]):
        recs = _records(path, info)
        n = (code == 0).astype(np.int64)
        if rates is not None:
            index = np.arange(offset, offset + len(recs))
            for s, name in enumerate(names):
                rows = np.flatnonzero((code == 0) & (recs["source"] == s))
                n[rows] = mx.copies_of(rates[name], cfg.seed, index[rows])
        out.append(n)
        offset += len(recs)
    return out, None if rates is None else {"rates": rates, "available": available}


def merge_parts(part_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, cfg: MergeConfig | None = None,
                progress: Callable[[int, int], None] | None = None) -> dict:
    """Merge finished parts into a sharded token directory (module docstring); -> its manifest."""
    cfg = cfg or MergeConfig()
    parts = read_parts(part_dirs)
    plan = _plan(parts, cfg)
    copies, mix = _copies(parts, plan, cfg)
    train_total = sum(int((_records(p, i)["tokens"] * c).sum()) for (p, i), c in zip(parts, copies))
    val_docs = sum(int((code == 1).sum()) for code in plan["splits"])
    n_tail = tail_size(train_total, cfg.val_fraction, cfg.min_val_tokens) if cfg.val_fraction and not val_docs else 0
    out = Path(out_dir)
    with workdir.tracked_directory(out, TOKENS_KIND, overwrite=True) as (tmp, _):
        info0 = parts[0][1]
        shutil.copyfile(parts[0][0] / info0["tokenizer_file"], tmp / info0["tokenizer_file"])
        written = _write_shards(tmp, parts, plan, copies, cfg, train_total - n_tail, progress)
        _write_removed(tmp, parts, plan)
        manifest = _manifest(parts, plan, mix, written, cfg, n_tail)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_shards(tmp: Path, parts, plan, copies, cfg: MergeConfig, train_keep: int, progress) -> dict:
    """Stream every kept document into the shard writers; -> shards, per-source and length counts."""
    dtype = np.dtype(parts[0][1]["dtype"])
    names = parts[0][1]["sources"]
    train, val = ShardWriter(tmp, "train", cfg.shard_tokens, dtype), ShardWriter(tmp, "val", cfg.shard_tokens, dtype)
    totals = np.zeros((len(names), 8), dtype=np.int64)
    lengths, done = [], 0
    for (path, info), code, n_copies in zip(parts, plan["splits"], copies):
        recs = _records(path, info)
        totals += _source_counts(recs, code, n_copies, len(names))
        lengths.append(np.asarray(recs["tokens"][code >= 0]))
        starts = np.cumsum(recs["tokens"]) - recs["tokens"]
        # plain reads in order, not a memory map: mapped pages would count as this process's memory
        with (path / "tokens.bin").open("rb") as f:
            for i in np.flatnonzero(code >= 0):
                f.seek(int(starts[i]) * dtype.itemsize)
                ids = np.fromfile(f, dtype=dtype, count=int(recs["tokens"][i]))
                if code[i] == 1:
                    val.write(ids)
                for _ in range(int(n_copies[i])):
                    _route(ids, train, val, train_keep)
        done += len(recs)
        if progress is not None:
            progress(done, train.tokens + val.tokens)
    per_source = {name: dict(zip(_COUNTS, map(int, row))) for name, row in zip(names, totals)}
    return {"train": train.close(), "val": val.close(), "per_source": per_source,
            "lengths": np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)}


_COUNTS = ("documents", "tokens", "bytes", "duplicates", "train_documents", "train_tokens", "val_documents",
           "val_tokens")


def _source_counts(recs: np.ndarray, code: np.ndarray, n_copies: np.ndarray, n_sources: int) -> np.ndarray:
    """(sources, len(_COUNTS)) counts of one part: read, duplicates, written to train (copies
    included) and to validation."""
    src, toks = recs["source"], recs["tokens"].astype(np.int64)
    columns = [np.ones(len(recs), np.int64), toks, recs["bytes"].astype(np.int64), (code < 0).astype(np.int64),
               n_copies, n_copies * toks, (code == 1).astype(np.int64), (code == 1) * toks]
    return np.stack([np.bincount(src, weights=c, minlength=n_sources).astype(np.int64) for c in columns], axis=1)


def _write_removed(tmp: Path, parts, plan) -> None:
    """filtered.jsonl (what the parts' filters removed) and duplicates.jsonl ({"id", "source",
    "reason"} of every document dedup removed), both in global order."""
    with (tmp / FILTERED_FILE).open("wb") as out:
        for path, _ in parts:
            with (path / FILTERED_FILE).open("rb") as f:
                shutil.copyfileobj(f, out)
    with (tmp / DUPLICATES_FILE).open("w", encoding="utf-8") as out:
        for (path, info), code, dup in zip(parts, plan["splits"], plan["reasons"]):
            names, recs = info["sources"], _records(path, info)
            with (path / "doc_ids.jsonl").open(encoding="utf-8") as ids:
                for i, line in enumerate(ids):
                    if code[i] < 0:
                        reason = "exact" if dup[i] == dd.EXACT else "near"
                        out.write(json.dumps({"id": json.loads(line), "source": names[recs["source"][i]],
                                              "reason": reason}) + "\n")


def _route(ids: np.ndarray, train: ShardWriter, val: ShardWriter, train_keep: int) -> None:
    """Write `ids` to train up to `train_keep` tokens in all; the rest (the held-out tail) to val."""
    room = max(train_keep - train.tokens, 0)
    if room:
        train.write(ids[:room])
    if ids.size > room:
        val.write(ids[room:])


def length_histogram(lengths: np.ndarray) -> dict:
    """Documents per power-of-two length bin [2^k, 2^(k+1)) tokens: {"edges": [...], "counts": [...]}."""
    if lengths.size == 0:
        return {"edges": [], "counts": []}
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [2 ** k for k in range(top + 1)]
    counts, _ = np.histogram(lengths, bins=edges + [2 ** (top + 1)])
    return {"edges": edges, "counts": [int(c) for c in counts]}


def _manifest(parts, plan, mix, written: dict, cfg: MergeConfig, n_tail: int) -> dict:
    info0 = parts[0][1]
    filters = {}
    for _, info in parts:
        for name, st in info["filters"].items():
            filters.setdefault(name, FilterStats()).merge(st)
    splits = {s: {"shards": written[s], "tokens": sum(x["tokens"] for x in written[s]),
                  "documents": sum(v[f"{s}_documents"] for v in written["per_source"].values())}
              for s in ("train", "val")}
    tokens_out = {n: v["train_tokens"] for n, v in written["per_source"].items()}
    in_bytes = sum(v["bytes"] for v in written["per_source"].values())
    # the end-of-text id after each document carries no bytes
    in_tokens = sum(v["tokens"] - v["documents"] for v in written["per_source"].values())
    return {
        "format": "logitlab-tokens", "version": 2, "layout": "shards", "shard_tokens": cfg.shard_tokens,
        "tokenizer_fingerprint": info0["tokenizer_fingerprint"], "tokenizer_file": info0["tokenizer_file"],
        "vocab_size": info0["vocab_size"], "eot_id": info0["eot_id"], "dtype": info0["dtype"],
        "val_fraction": cfg.val_fraction, **_validation(splits, cfg, n_tail),
        "sources": info0["sources"], "workers": info0["num_shards"],
        "files": sum(i["files"] for _, i in parts), "documents": plan["kept"], "splits": splits,
        "per_source": written["per_source"], "filters": {n: s.to_dict() for n, s in filters.items()},
        "dedup": plan["dedup"], "mixture": None if mix is None else {
            "weights": cfg.mix, "seed": cfg.seed, **mix, "realised": mx.realised(tokens_out, cfg.mix)},
        "doc_length_histogram": length_histogram(written["lengths"]),
        "input_bytes": in_bytes, "bytes_per_token": in_bytes / in_tokens if in_tokens else 0.0,
    }


def _validation(splits: dict, cfg: MergeConfig, n_tail: int) -> dict:
    val = splits["val"]
    if n_tail:
        return {"validation": "tail", "val_rule": TAIL_RULE, "val_tail_tokens": n_tail,
                "val_note": f"validation: the last {n_tail:,} tokens of the training stream (no document fell "
                            f"in the val_fraction={cfg.val_fraction} document split)"}
    if val["documents"]:
        return {"validation": "documents", "val_rule": DOCUMENT_RULE,
                "val_note": f"validation: {val['documents']} documents ({val['tokens']:,} tokens; every kept "
                            f"document j with floor((j+1)*f) > floor(j*f), f={cfg.val_fraction})"}
    return {"validation": "none", "val_rule": "none (val_fraction 0)" if not cfg.val_fraction else DOCUMENT_RULE,
            "val_note": "validation: none: no validation loss will be reported"}


def prepare_sharded(sources, tokenizer, out_dir: str | os.PathLike, cfg=None, merge_cfg: MergeConfig | None = None,
                    *, workers: int | None = None, progress: Callable[[int, int], None] | None = None,
                    notice: Callable[[str], None] | None = None) -> dict:
    """The whole pipeline on one machine: one part (prepare_part, tokenizing in `workers`
    processes) written beside `out_dir` as `.NAME.part`, then merge_parts into `out_dir`. The part
    is removed after a successful merge; after a failure it stays, and the same call resumes from
    it instead of tokenizing again (a killed part too, from its last progress record)."""
    from logitlab.data.parts import prepare_part

    out = Path(out_dir)
    part = out.parent / f".{out.name}.part"
    prepare_part(sources, tokenizer, part, cfg, workers=workers, progress=progress, notice=notice)
    manifest = merge_parts([part], out, merge_cfg)
    shutil.rmtree(part)
    return manifest
