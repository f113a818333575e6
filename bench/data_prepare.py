"""Data preparation benchmark: throughput of `prepare` (MB/s of input, tokens/s; 1 and 2 workers)
against Hugging Face `datasets` `map` with a `tokenizers` tokenizer of the same vocabulary on the
same corpus, the cost of MinHash near-dedup per MB, and peak memory as the input grows.

    python3 -m bench.data_prepare            # 48 MB corpus (a few minutes on 2 idle cores)
    python3 -m bench.data_prepare --quick    # 8 MB

The corpus is the standard library's *.py files (valid UTF-8), one JSON line per file, repeated to
the size asked. One BPE vocabulary (4096 ids, trained by logitlab on a 1 MB sample) is used by both
sides: logitlab's own file and its Hugging Face `tokenizer.json` export. Each measurement runs in a
fresh subprocess, which reports its wall time (reading the JSON lines, tokenizing, writing a flat
uint16 token file) and its peak resident memory (VmHWM; with workers, plus the largest worker's
ru_maxrss). The peer's `map` runs with `num_proc` = workers and `RAYON_NUM_THREADS=1` per process,
so both sides use the same number of cores; its Arrow cache lives in a temporary directory and its
time includes loading the JSON into Arrow. Sides alternate A B A B.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import machine_info, markdown_table, publish, rss_kib, run_child

EOT = "<|endoftext|>"


def _stdlib_texts() -> list[str]:
    from logitlab.data.corpus import default_corpus_files

    out = []
    for path in default_corpus_files():
        try:
            out.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return out


def make_corpus(path: Path, megabytes: float) -> int:
    """Write about `megabytes` MB of JSON lines ({"text": a stdlib file}); -> bytes of text."""
    texts, target, total = _stdlib_texts(), int(megabytes * 1e6), 0
    with path.open("w", encoding="utf-8") as f:
        while total < target:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
                total += len(text.encode("utf-8"))
                if total >= target:
                    break
    return total


def make_tokenizers(workdir: Path, vocab_size: int = 4096) -> tuple[Path, Path]:
    from logitlab.tokenizer import bpe

    sample = workdir / "sample.txt"
    sample.write_text("".join(_stdlib_texts()[::9])[:1_000_000], encoding="utf-8")
    tok = bpe.train_tokenizer([str(sample)], vocab_size, [EOT])
    ours, hf = workdir / "tok.json", workdir / "tokenizer.json"
    tok.save(ours)
    from logitlab.tokenizer.formats import save_hf

    save_hf(tok, hf)
    return ours, hf


# ------------------------------------------------------------------------------ one run, in a child
def _ours(spec: dict) -> int:
    from logitlab.data.dedup import DedupConfig
    from logitlab.data.merge import MergeConfig, prepare_sharded
    from logitlab.data.parts import PrepareConfig
    from logitlab.data.tokens import prepare_corpus
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer.load(spec["tok"])
    if spec.get("near"):
        cfg = PrepareConfig(dedup=DedupConfig(near=True))
        m = prepare_sharded([spec["corpus"]], tok, spec["out"], cfg, MergeConfig(val_fraction=0.0),
                            workers=spec["workers"])
    else:
        m = prepare_corpus([spec["corpus"]], tok, spec["out"], val_fraction=0.0, workers=spec["workers"])
    return sum(s["tokens"] for s in m["splits"].values())


def _peer(spec: dict) -> int:
    import numpy as np
    from datasets import load_dataset
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(spec["hf_tok"])
    eot = tok.token_to_id(EOT)

    def encode(batch):
        return {"ids": [e.ids + [eot] for e in tok.encode_batch(batch["text"])]}

    ds = load_dataset("json", data_files=spec["corpus"], split="train", cache_dir=spec["cache"])
    ds = ds.map(encode, batched=True, num_proc=spec["workers"] if spec["workers"] > 1 else None,
                remove_columns=["text"])
    n = 0
    with open(Path(spec["out"]) / "train.bin", "wb") as f:
        for batch in ds.iter(batch_size=1000):
            for ids in batch["ids"]:
                f.write(np.asarray(ids, dtype=np.uint16).tobytes())
                n += len(ids)
    return n


def _child(spec: dict) -> None:
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tokens = _ours(spec) if spec["side"] == "ours" else _peer(spec)
    seconds = time.perf_counter() - start
    own = rss_kib("VmHWM") / 1024
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "tokens": tokens, "peak_mib": own + (workers if spec["workers"] > 1 else 0)}))


def run_once(spec: dict) -> dict:
    env_before = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            lines = run_child("bench.data_prepare", "--child", dict(spec, out=f"{tmp}/out", cache=f"{tmp}/cache"))
    finally:
        if env_before is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = env_before
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ the cases
def bench_throughput(corpus: Path, text_bytes: int, toks: tuple[Path, Path], repeats: int) -> list[dict]:
    rows = []
    for workers in (1, 2):
        runs = {"ours": [], "peer": []}
        for _ in range(repeats):
            for side in ("ours", "peer"):
                runs[side].append(run_once({"side": side, "corpus": str(corpus), "tok": str(toks[0]),
                                            "hf_tok": str(toks[1]), "workers": workers}))
        for side, results in runs.items():
            secs = statistics.median(r["seconds"] for r in results)
            rows.append({"side": side, "workers": workers, "seconds": secs, "tokens": results[0]["tokens"],
                         "mb_per_s": text_bytes / 1e6 / secs, "tokens_per_s": results[0]["tokens"] / secs,
                         "peak_mib": max(r["peak_mib"] for r in results)})
    return rows


def bench_dedup_and_memory(workdir: Path, megabytes: float, toks: tuple[Path, Path]) -> dict:
    small = workdir / "small.jsonl"
    small_bytes = make_corpus(small, megabytes / 4)
    base = run_once({"side": "ours", "corpus": str(small), "tok": str(toks[0]), "workers": 1})
    near = run_once({"side": "ours", "corpus": str(small), "tok": str(toks[0]), "workers": 1, "near": True})
    big = workdir / "corpus.jsonl"
    big_bytes = big.stat().st_size
    full = run_once({"side": "ours", "corpus": str(big), "tok": str(toks[0]), "workers": 1})
    return {"dedup_mb": small_bytes / 1e6, "dedup_extra_s_per_mb": (near["seconds"] - base["seconds"]) / (small_bytes / 1e6),
            "memory": [{"input_mb": small.stat().st_size / 1e6, "peak_mib": base["peak_mib"]},
                       {"input_mb": big_bytes / 1e6, "peak_mib": full["peak_mib"]}]}


def render(result: dict) -> str:
    rows = [[r["side"].replace("peer", "datasets.map + tokenizers").replace("ours", "logitlab prepare"), r["workers"],
             f"{r['mb_per_s']:.2f}", f"{r['tokens_per_s'] / 1e6:.2f}", f"{r['peak_mib']:.0f}"]
            for r in result["throughput"]]
    mem = result["dedup_memory"]
    lines = [f"Corpus: {result['corpus_mb']:.1f} MB of JSON lines (stdlib *.py files), 4096-id BPE on both sides. "
             f"`{result['command']}`.", "",
             markdown_table(["pipeline", "workers", "MB/s", "M tokens/s", "peak MiB"], rows), "",
             f"MinHash near-dedup (16 bands x 8 rows, 5-grams) adds {mem['dedup_extra_s_per_mb']:.2f} s per MB "
             f"(one worker, {mem['dedup_mb']:.1f} MB).", "",
             markdown_table(["input MB", "peak MiB (prepare, 1 worker)"],
                            [[f"{m['input_mb']:.1f}", f"{m['peak_mib']:.0f}"] for m in mem["memory"]])]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.data_prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="an 8 MB corpus instead of 48 MB")
    parser.add_argument("--megabytes", type=float, default=None, help="corpus size in MB (overrides --quick)")
    parser.add_argument("--repeats", type=int, default=2, help="timed pairs per case (default 2)")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    megabytes = args.megabytes or (8 if args.quick else 48)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        toks = make_tokenizers(workdir)
        corpus = workdir / "corpus.jsonl"
        text_bytes = make_corpus(corpus, megabytes)
        result = {"machine": machine_info(), "command": " ".join(["python3 -m bench.data_prepare", *(argv or sys.argv[1:])]),
                  "corpus_mb": text_bytes / 1e6}
        result["throughput"] = bench_throughput(corpus, text_bytes, toks, args.repeats)
        result["dedup_memory"] = bench_dedup_and_memory(workdir, megabytes, toks)
    print(render(result))
    publish("data_prepare", "Data preparation", result, render, quick=args.quick, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
