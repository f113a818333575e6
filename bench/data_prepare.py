"""Data preparation benchmark: `prepare` against the encoder alone on the same text (MB/s per
worker, the ratio, how 2 workers scale), against Hugging Face `datasets` `map` with a
`tokenizers` tokenizer of the same vocabulary, the cost of MinHash near-dedup, and peak memory.

    python3 -m bench.data_prepare            # 48 MB corpus (several minutes on 2 idle cores)
    python3 -m bench.data_prepare --quick    # 8 MB

The corpus is the standard library's *.py files (valid UTF-8), one JSON line per file, repeated to
the size asked; every repeat starts with a comment line naming its copy, so no two documents are
equal and exact dedup removes nothing (prepare then encodes all the text the encoder does). One
BPE vocabulary (4096 ids, trained by logitlab on a 1 MB sample) is used by every side: logitlab's
own file and its Hugging Face `tokenizer.json` export. Each measurement runs in a fresh
subprocess, which reports its wall time, its CPU time and its workers' (getrusage), and its peak
resident memory (VmHWM; with workers, plus the largest worker's ru_maxrss).

- Encoder against prepare: the encoder alone (the texts read into memory untimed, then
  `Tokenizer.encode_ordinary` over each) alternates with `prepare_part` on 1 and 2 workers with
  cleaning on (the code rules: the corpus is code) and exact dedup (reading, filtering, hashing,
  encoding, writing the part; the merge into shards is timed apart). `--prose FILE` adds the
  same on documents cut from a text file, under the Gopher prose rules. Where the compiled
  measurements (logitlab.data._text_fast) are built, one more side runs one worker with them
  hidden: the pure-Python route an install without a C compiler takes.
- The peer: `datasets.map` with `num_proc` = workers and `RAYON_NUM_THREADS=1` per process against
  the plain single-file `prepare` (no cleaning, no dedup), so both sides do the same work; its
  Arrow cache lives in a temporary directory and its time includes loading the JSON into Arrow.
Sides alternate A B A B.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, command_line, machine_info, markdown_table, publish, rss_kib, run_child

EOT = "<|endoftext|>"
PROSE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def _stdlib_texts() -> list[str]:
    from logitlab.data.corpus import default_corpus_files

    out = []
    for path in default_corpus_files():
        try:
            out.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return out


def _write_corpus(path: Path, texts: list[str], megabytes: float) -> int:
    """About `megabytes` MB of JSON lines ({"text": ...}), cycling through `texts`, each repeat
    headed by a line naming its copy (no two documents equal); -> bytes of text."""
    target, total, copy = int(megabytes * 1e6), 0, 0
    with path.open("w", encoding="utf-8") as f:
        while total < target:
            for text in texts:
                text = text if copy == 0 else f"# copy {copy}\n{text}"
                f.write(json.dumps({"text": text}) + "\n")
                total += len(text.encode("utf-8"))
                if total >= target:
                    break
            copy += 1
    return total


def make_corpus(path: Path, megabytes: float) -> int:
    """The stdlib corpus (module docstring); -> bytes of text."""
    return _write_corpus(path, _stdlib_texts(), megabytes)


def make_prose_corpus(path: Path, source: Path, megabytes: float) -> int:
    """Documents of 2-6 KB cut at random (seeded) from a text file; -> bytes of text."""
    import random

    text, rng = source.read_text(encoding="utf-8"), random.Random(0)
    docs = []
    for _ in range(int(megabytes * 1e6 / 4000) + 1):
        start, size = rng.randrange(max(1, len(text) - 6000)), rng.randrange(2000, 6000)
        docs.append(text[start:start + size])
    return _write_corpus(path, docs, megabytes)


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
def _encoder(spec: dict) -> dict:
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer.load(spec["tok"])
    with open(spec["corpus"], encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok.encode_ordinary("warm up")  # the encoder's one-time checks are not its throughput
    start, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(tok.encode_ordinary(t)) + 1 for t in texts)
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu, "tokens": tokens}


def _part(spec: dict) -> dict:
    from logitlab.data.dedup import DedupConfig
    from logitlab.data.filters import FilterConfig
    from logitlab.data.merge import MergeConfig, merge_parts
    from logitlab.data.parts import PrepareConfig, prepare_part
    from logitlab.tokenizer.core import Tokenizer

    if spec.get("python_route"):  # what an install without a C compiler runs
        from logitlab.data import dedup, measures

        measures._native = dedup._native_ascii_normalised = None
    from logitlab.data.measures import native_available

    tok = Tokenizer.load(spec["tok"])
    name = spec.get("source", "code")
    cfg = PrepareConfig(filters=FilterConfig(code_sources=("code",)),
                        dedup=DedupConfig(exact=True, near=bool(spec.get("near"))))
    tok.encode_ordinary("warm up")
    if spec.get("near"):
        import datasketch  # noqa: F401  its import (seconds, once) is not MinHash's cost per MB
    start, cpu = time.perf_counter(), time.process_time()
    info = prepare_part([f"{name}={spec['corpus']}"], tok, Path(spec["out"]) / "part", cfg, workers=spec["workers"])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    merged = time.perf_counter()
    merge_parts([Path(spec["out"]) / "part"], Path(spec["out"]) / "data", MergeConfig(val_fraction=0.0))
    return {"seconds": seconds, "cpu": cpu, "worker_cpu": usage.ru_utime + usage.ru_stime, "tokens": info["tokens"],
            "kept_bytes": info["bytes"], "merge_seconds": time.perf_counter() - merged,
            "route": "compiled" if native_available() else "python"}


def _ours(spec: dict) -> dict:
    from logitlab.data.tokens import prepare_corpus
    from logitlab.tokenizer.core import Tokenizer

    start = time.perf_counter()
    tok = Tokenizer.load(spec["tok"])
    m = prepare_corpus([spec["corpus"]], tok, spec["out"], val_fraction=0.0, workers=spec["workers"])
    return {"seconds": time.perf_counter() - start, "tokens": sum(s["tokens"] for s in m["splits"].values())}


def _peer(spec: dict) -> dict:
    import numpy as np
    from datasets import load_dataset
    from tokenizers import Tokenizer

    start = time.perf_counter()
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
    return {"seconds": time.perf_counter() - start, "tokens": n}


SIDES = {"encoder": _encoder, "part": _part, "ours": _ours, "peer": _peer}


def _child(spec: dict) -> None:
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    result = SIDES[spec["side"]](spec)
    own = rss_kib("VmHWM") / 1024
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps(dict(result, peak_mib=own + (workers if spec.get("workers", 1) > 1 else 0))))


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
def _median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def bench_encoder_ratio(corpus: Path, text_bytes: int, tok: Path, repeats: int, source: str = "code") -> dict:
    """The encoder alone, prepare_part on 1 and on 2 workers (and on 1 by the Python route where the
    compiled one is built), alternating; -> MB/s, ratios, scaling."""
    from logitlab.data.measures import native_available

    mb = text_bytes / 1e6
    base = {"corpus": str(corpus), "tok": str(tok), "source": source}
    runs: dict[str, list] = {"encoder": [], "1": [], "2": []}
    sides = [("1", dict(base, side="part", workers=1)), ("2", dict(base, side="part", workers=2))]
    if native_available():
        runs["python"] = []
        sides.append(("python", dict(base, side="part", workers=1, python_route=True)))
    for _ in range(repeats):
        runs["encoder"].append(run_once(dict(base, side="encoder", workers=1)))
        for key, spec in sides:
            runs[key].append(run_once(spec))
    enc = runs["encoder"]
    rows = [{"side": "encoder alone", "workers": 1, "mb_per_s": mb / _median(enc, "seconds"), "ratio": 1.0,
             "cpu_ratio": 1.0}]
    for key, spec in sides:
        res, w = runs[key], spec["workers"]
        pairs = [(e["seconds"] / r["seconds"], e["cpu"] / (r["cpu"] + r["worker_cpu"])) for e, r in zip(enc, res)]
        rows.append({"side": f"prepare part ({res[0]['route']} route)", "workers": w,
                     "mb_per_s": mb / _median(res, "seconds"),
                     "ratio": statistics.median(a for a, _ in pairs) / w,  # per worker, to the encoder
                     "cpu_ratio": statistics.median(b for _, b in pairs),
                     "merge_s": _median(res, "merge_seconds"), "peak_mib": max(r["peak_mib"] for r in res),
                     "parent_cpu_share": _median(res, "cpu") / (_median(res, "cpu") + _median(res, "worker_cpu"))
                     if w > 1 else 1.0})
    scaling = [r1["seconds"] / (2 * r2["seconds"]) for r1, r2 in zip(runs["1"], runs["2"])]
    return {"source": source, "mb": mb, "kept_mb": runs["1"][0]["kept_bytes"] / 1e6, "rows": rows,
            "efficiency_2": statistics.median(scaling), "efficiency_2_all": scaling}


def bench_throughput(corpus: Path, text_bytes: int, toks: tuple[Path, Path], repeats: int) -> list[dict]:
    rows = []
    for workers in (1, 2):
        runs = {"ours": [], "peer": []}
        for _ in range(repeats):
            for side in ("ours", "peer"):
                runs[side].append(run_once({"side": side, "corpus": str(corpus), "tok": str(toks[0]),
                                            "hf_tok": str(toks[1]), "workers": workers}))
        for side, results in runs.items():
            secs = _median(results, "seconds")
            rows.append({"side": side, "workers": workers, "seconds": secs, "tokens": results[0]["tokens"],
                         "mb_per_s": text_bytes / 1e6 / secs, "tokens_per_s": results[0]["tokens"] / secs,
                         "peak_mib": max(r["peak_mib"] for r in results)})
    return rows


def bench_dedup_and_memory(workdir: Path, megabytes: float, toks: tuple[Path, Path], repeats: int) -> dict:
    small = workdir / "small.jsonl"
    small_bytes = make_corpus(small, megabytes / 4)
    spec = {"side": "part", "corpus": str(small), "tok": str(toks[0]), "workers": 1}
    base, near = [], []
    for _ in range(repeats):  # alternating, one worker; the import of datasketch is outside the timing
        base.append(run_once(spec))
        near.append(run_once(dict(spec, near=True)))
    extra = [(n["seconds"] - b["seconds"]) / (small_bytes / 1e6) for b, n in zip(base, near)]
    big = workdir / "corpus.jsonl"
    full = run_once({"side": "ours", "corpus": str(big), "tok": str(toks[0]), "workers": 1})
    return {"dedup_mb": small_bytes / 1e6, "dedup_extra_s_per_mb": statistics.median(extra),
            "dedup_ratio": statistics.median(b["seconds"] / n["seconds"] for b, n in zip(base, near)),
            "memory": [{"input_mb": small.stat().st_size / 1e6, "peak_mib": base[0]["peak_mib"]},
                       {"input_mb": big.stat().st_size / 1e6, "peak_mib": full["peak_mib"]}]}


def _ratio_table(case: dict) -> str:
    rows = [[r["side"], r["workers"], f"{r['mb_per_s']:.2f}", f"{r['mb_per_s'] / r['workers']:.2f}",
             f"{r['ratio']:.2f}", f"{r['cpu_ratio']:.2f}"] for r in case["rows"]]
    return markdown_table(["pipeline", "workers", "MB/s", "MB/s per worker", "per worker / encoder (wall)",
                           "encoder CPU / prepare CPU"], rows)


def render(result: dict) -> str:
    lines = [f"Corpus: {result['corpus_mb']:.1f} MB of JSON lines (stdlib *.py files), 4096-id BPE on every side. "
             f"`{result['command']}` at commit {result['machine'].get('commit')}; load average "
             f"{result['machine'].get('load_avg_1m')} on {result['machine']['nproc']} cores when it started (a shared "
             f"machine: other jobs ran beside it, so the ratios of alternating runs count, not the MB/s). The compiled "
             f"route is the cleaning filters' measurements and the exact-dedup normalisation in C "
             f"(logitlab.data._text_fast, built at install when a C compiler is present); the Python route is what "
             f"runs without it.", ""]
    for case in result["encoder_ratio"]:
        two = next(r for r in case["rows"] if r["workers"] == 2)
        lines += [f"**prepare against the encoder alone** ({case['source']}: {case['mb']:.1f} MB, "
                  f"{case['kept_mb']:.1f} MB kept by the filters; cleaning and exact dedup on; median of "
                  f"alternating runs):", "", _ratio_table(case), "",
                  f"Two workers against one: efficiency {case['efficiency_2']:.2f} (throughput(2) / "
                  f"(2 x throughput(1))); the parent (reading, writing) used {two['parent_cpu_share']:.0%} of the "
                  f"CPU time, so the workers' share bounds the speedup near {1 / max(two['parent_cpu_share'], 1e-9):.0f} "
                  f"workers on as many idle cores. The merge into shards took {two['merge_s']:.2f} s.", ""]
    rows = [[r["side"].replace("peer", "datasets.map + tokenizers").replace("ours", "logitlab prepare (plain)"),
             r["workers"], f"{r['mb_per_s']:.2f}", f"{r['tokens_per_s'] / 1e6:.2f}", f"{r['peak_mib']:.0f}"]
            for r in result["throughput"]]
    mem = result["dedup_memory"]
    lines += [markdown_table(["pipeline", "workers", "MB/s", "M tokens/s", "peak MiB"], rows), "",
              f"MinHash near-dedup (16 bands x 8 rows, 5-grams) adds {mem['dedup_extra_s_per_mb']:.2f} s per MB "
              f"(one worker, {mem['dedup_mb']:.1f} MB; prepare's throughput x{mem['dedup_ratio']:.2f}).", "",
              markdown_table(["input MB", "peak MiB (prepare, 1 worker)"],
                             [[f"{m['input_mb']:.1f}", f"{m['peak_mib']:.0f}"] for m in mem["memory"]])]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.data_prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="an 8 MB corpus instead of 48 MB")
    parser.add_argument("--megabytes", type=float, default=None, help="corpus size in MB (overrides --quick)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds per case (default 2)")
    parser.add_argument("--prose", type=Path, default=PROSE if PROSE.is_file() else None, metavar="FILE",
                        help="also measure prose documents cut from FILE under the Gopher rules (default: "
                        "../shared/data/tinyshakespeare.txt when present)")
    parser.add_argument("--only-encoder-ratio", action="store_true", help="skip the peer, MinHash and memory")
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
        result = {"machine": machine_info(), "command": command_line(), "corpus_mb": text_bytes / 1e6}
        result["encoder_ratio"] = [bench_encoder_ratio(corpus, text_bytes, toks[0], args.repeats)]
        if args.prose is not None:
            prose = workdir / "prose.jsonl"
            prose_bytes = make_prose_corpus(prose, args.prose, megabytes / 2)
            result["encoder_ratio"].append(bench_encoder_ratio(prose, prose_bytes, toks[0], args.repeats, "prose"))
        if args.only_encoder_ratio:
            print("\n\n".join(_ratio_table(c) for c in result["encoder_ratio"]))
            return 0
        result["throughput"] = bench_throughput(corpus, text_bytes, toks, args.repeats)
        result["dedup_memory"] = bench_dedup_and_memory(workdir, megabytes, toks, args.repeats)
    print(render(result))
    publish("data_prepare", "Data preparation", result, render, quick=args.quick, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
