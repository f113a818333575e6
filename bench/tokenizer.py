"""Tokenizer benchmark: BPE training time and peak memory vs Hugging Face `tokenizers` and rustbpe,
and encode throughput of both our encoders vs tiktoken and `tokenizers`.

    python3 -m bench.tokenizer            # all cases (about 2-3 minutes on 2 idle cores)
    python3 -m bench.tokenizer --quick    # tinyshakespeare only

Training: each side trains in its own fresh subprocess (same files, same number of merges, GPT-2
pre-tokenization; logitlab and `tokenizers` reserve one id for a special token, rustbpe, which has
none, gets a vocabulary one smaller; rustbpe is skipped when it is not installed), which reports its wall time around the training call
and its peak resident memory (VmHWM of the process; for logitlab plus nproc times the largest
worker's ru_maxrss, an upper bound: forked workers share pages with their parent). Sides alternate
A B C A B C after one warm-up round. The stdlib
corpus is the standard library's *.py files that are valid UTF-8 (`tokenizers` refuses the others).

Encoding: GPT-2's vocabulary from ../shared/data/gpt2 (the same ranks for all four encoders),
single-threaded, whole text per call; the reference path's cache is cleared before each run.
Then a 32k vocabulary that logitlab trains on the stdlib corpus without special tokens, our
`encode_ordinary` against tiktoken's `encode_ordinary` with the same ranks, on short strings
(many calls, per-call overhead) and on 1 and 8 MB texts.
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

from bench.common import ROOT, machine_info, markdown_table, rss_kib, run_child, update_doc_section, write_results

SHARED = ROOT.parent / "shared" / "data"
EOT = "<|endoftext|>"


# ------------------------------------------------------------------------------ one training run
def _train_child(side: str, list_file: str, vocab_size: int) -> None:
    files = Path(list_file).read_text().splitlines()
    if side == "ours":
        from logitlab.tokenizer.bpe import train_bpe

        start = time.perf_counter()
        vocab, _ = train_bpe(files, vocab_size, [EOT])
        seconds = time.perf_counter() - start
        size = len(vocab)
    elif side == "rustbpe":
        import rustbpe

        from logitlab.tokenizer.core import GPT2_PATTERN

        def texts():  # the file reading is inside the timed call, as for the other sides
            for path in files:
                yield Path(path).read_text(encoding="utf-8", errors="replace")

        tok = rustbpe.Tokenizer()
        start = time.perf_counter()
        tok.train_from_iterator(texts(), vocab_size - 1, pattern=GPT2_PATTERN)  # no special token
        seconds = time.perf_counter() - start
        size = tok.vocab_size + 1
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        start = time.perf_counter()
        tok.train(files, trainer)
        seconds = time.perf_counter() - start
        size = tok.get_vocab_size()
    # VmHWM starts afresh at exec (ru_maxrss would include the parent's size at fork).
    own = rss_kib("VmHWM") / 1024
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    n_workers = (os.cpu_count() or 1) if side == "ours" else 0  # concurrent worker processes
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))  # all threads and worker processes, whole run
    print(json.dumps({"seconds": seconds, "peak_mb": own + n_workers * workers, "own_mb": own,
                      "worker_mb": workers, "cpu_s": cpu, "vocab": size}))


def _run_side(side: str, list_file: Path, vocab_size: int) -> dict:
    spec = dict(side=side, list_file=str(list_file), vocab_size=vocab_size)
    return json.loads(run_child("bench.tokenizer", "--child", spec)[-1])


def utf8_stdlib_files() -> list[Path]:
    from logitlab.tokenizer.bpe import stdlib_files

    good = []
    for path in stdlib_files():
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        good.append(path)
    return good


def training_peers() -> list[str]:
    """Peer trainers that are installed: `tokenizers` always (a test extra), rustbpe when present."""
    import importlib.util

    return ["hf"] + (["rustbpe"] if importlib.util.find_spec("rustbpe") is not None else [])


PEER_NAMES = {"hf": "tokenizers", "rustbpe": "rustbpe"}


def bench_training(cases, repeats: int) -> list[dict]:
    """One row per (case, peer); every round runs ours then each peer, so ratios pair up in time."""
    rows = []
    peers = training_peers()
    with tempfile.TemporaryDirectory() as tmp:
        for name, files, vocab_size in cases:
            list_file = Path(tmp) / f"{name}.txt"
            list_file.write_text("\n".join(str(f) for f in files))
            mb = sum(f.stat().st_size for f in files) / 1e6
            if not rows:  # one warm-up round (imports, page cache) before the first case
                for side in ["ours"] + peers:
                    _run_side(side, list_file, vocab_size)
            runs: dict[str, list[dict]] = {side: [] for side in ["ours"] + peers}
            for _ in range(repeats):
                for side in ["ours"] + peers:
                    runs[side].append(_run_side(side, list_file, vocab_size))
            ours = runs["ours"]
            for peer in peers:
                theirs = runs[peer]
                ratios = [o["seconds"] / h["seconds"] for o, h in zip(ours, theirs)]
                cpu_ratios = [o["cpu_s"] / h["cpu_s"] for o, h in zip(ours, theirs)]
                mem = [o["peak_mb"] / h["peak_mb"] for o, h in zip(ours, theirs)]
                row = {"corpus": name, "mb": mb, "vocab": vocab_size, "peer": PEER_NAMES[peer],
                       "ours_cpu_s": [o["cpu_s"] for o in ours], "peer_cpu_s": [h["cpu_s"] for h in theirs],
                       "ours_s": [o["seconds"] for o in ours], "peer_s": [h["seconds"] for h in theirs],
                       "ours_peak_mb": [o["peak_mb"] for o in ours], "peer_peak_mb": [h["peak_mb"] for h in theirs],
                       "time_ratio": statistics.median(ratios), "time_ratio_min": min(ratios),
                       "time_ratio_max": max(ratios), "cpu_ratio": statistics.median(cpu_ratios),
                       "cpu_ratio_min": min(cpu_ratios), "cpu_ratio_max": max(cpu_ratios),
                       "mem_ratio": statistics.median(mem)}
                rows.append(row)
                print(f"train {name} {mb:.1f} MB vocab {vocab_size}: ours {statistics.median(row['ours_s']):.2f} s, "
                      f"{row['peer']} {statistics.median(row['peer_s']):.2f} s, time ratio {row['time_ratio']:.2f} "
                      f"({min(ratios):.2f}-{max(ratios):.2f}), CPU ratio {row['cpu_ratio']:.2f} "
                      f"({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}), memory ratio {row['mem_ratio']:.2f}",
                      flush=True)
    return rows


# ------------------------------------------------------------------------------ encoding
def bench_encoding(texts: dict[str, str], repeats: int) -> list[dict]:
    import tiktoken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from logitlab.tokenizer.core import Tokenizer
    from logitlab.tokenizer.formats import bytes_to_unicode

    vocab_json, merges_txt = SHARED / "gpt2" / "vocab.json", SHARED / "gpt2" / "merges.txt"
    ours = Tokenizer.from_gpt2_files(vocab_json, merges_txt)
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    raw = json.loads(vocab_json.read_text(encoding="utf-8"))
    enc = tiktoken.Encoding("gpt2-files", pat_str=ours.pattern, special_tokens={EOT: raw.pop(EOT)},
                            mergeable_ranks={bytes(u2b[c] for c in t): i for t, i in raw.items()})
    hf = HFTokenizer(models.BPE.from_file(str(vocab_json), str(merges_txt)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOT])

    def reference(text):
        ours._cache.clear()
        return ours.encode(text, fast=False)

    encoders = {"logitlab fast": ours.encode, "logitlab reference": reference,
                "tiktoken": lambda t: enc.encode(t, allowed_special="all"), "tokenizers": lambda t: hf.encode(t).ids}
    rows = []
    for name, text in texts.items():
        want = enc.encode(text, allowed_special="all")
        times: dict[str, list[float]] = {k: [] for k in encoders}
        for k, fn in encoders.items():  # warm-up, and every encoder must give the same ids
            assert fn(text) == want, f"{k} disagrees with tiktoken on {name}"
        for _ in range(repeats):
            for k, fn in encoders.items():
                start = time.perf_counter()
                fn(text)
                times[k].append(time.perf_counter() - start)
        mb = len(text.encode("utf-8")) / 1e6
        speed = {k: mb / statistics.median(v) for k, v in times.items()}
        ratio_fast = [t / o for o, t in zip(times["logitlab fast"], times["tiktoken"])]
        ratio_ref = [h / r for r, h in zip(times["logitlab reference"], times["tokenizers"])]
        row = {"text": name, "mb": mb, "mb_per_s": speed, "times": times,
               "fast_vs_tiktoken": statistics.median(ratio_fast), "fast_vs_tiktoken_min": min(ratio_fast),
               "fast_vs_tiktoken_max": max(ratio_fast), "reference_vs_tokenizers": statistics.median(ratio_ref),
               "reference_vs_tokenizers_min": min(ratio_ref), "reference_vs_tokenizers_max": max(ratio_ref)}
        rows.append(row)
        print(f"encode {name} {mb:.1f} MB: " + ", ".join(f"{k} {v:.1f} MB/s" for k, v in speed.items())
              + f"; fast/tiktoken speed {row['fast_vs_tiktoken']:.2f}, reference/tokenizers speed "
              f"{row['reference_vs_tokenizers']:.2f}", flush=True)
    return rows


def bench_trained_encoding(stdlib: list[Path], repeats: int) -> list[dict]:
    """encode_ordinary on a 32k vocabulary that logitlab trained (no special tokens) vs tiktoken's
    encode_ordinary with the same ranks. CPU time (single thread), alternating, median (min-max)."""
    import tiktoken

    from logitlab.tokenizer.bpe import train_tokenizer

    tok = train_tokenizer(stdlib, 32_000)
    enc = tiktoken.Encoding("logitlab-32k", pat_str=tok.pattern, special_tokens={},
                            mergeable_ranks={tok.token_bytes(i): i for i in range(tok.vocab_size)})
    corpus = "".join(p.read_text(encoding="utf-8") for p in stdlib[1::2])
    lines = [line for line in corpus.splitlines() if line.strip()][:20_000]
    cases = {"short lines (20k calls)": lines, "1 MB text": [corpus[:1_000_000]], "8 MB text": [corpus[:8_000_000]]}
    rows = []
    for name, texts in cases.items():
        assert [tok.encode_ordinary(t) for t in texts[:200]] == [enc.encode_ordinary(t) for t in texts[:200]]

        def run(fn):
            start = time.process_time()
            for t in texts:
                fn(t)
            return time.process_time() - start

        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(run(tok.encode_ordinary))
            theirs.append(run(enc.encode_ordinary))
        ratios = [t / o for o, t in zip(ours, theirs)]  # speed ratio: > 1 means ours is faster
        mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        row = {"text": name, "mb": mb, "ours_mb_per_s": mb / statistics.median(ours),
               "tiktoken_mb_per_s": mb / statistics.median(theirs), "speed_ratio": statistics.median(ratios),
               "speed_ratio_min": min(ratios), "speed_ratio_max": max(ratios)}
        rows.append(row)
        print(f"encode_ordinary, logitlab-trained 32k, {name}: ours {row['ours_mb_per_s']:.1f} MB/s, tiktoken "
              f"{row['tiktoken_mb_per_s']:.1f} MB/s, speed ratio {row['speed_ratio']:.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    return rows


# ------------------------------------------------------------------------------ report
def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def report(train_rows, encode_rows, info, command, trained_rows=()) -> str:
    import tiktoken
    import tokenizers

    from logitlab.tokenizer.bpe import native_available

    lines = [f"Command: `{command}` (commit {info.get('commit')}). Machine: {info['nproc']} cores, {info['cpu']}; "
             f"Python {info['python']}, torch {info['torch']} ({info['torch_threads']} threads), tiktoken "
             f"{tiktoken.__version__}, tokenizers {tokenizers.__version__}, rustbpe {_version('rustbpe')}, logitlab "
             f"native BPE paths {'built' if native_available() else 'NOT built'}. The machine is shared (load "
             f"average {info['load'][0]:.1f} at the start, {info['load_end'][0]:.1f} at the end, on "
             f"{info['nproc']} cores), so absolute times move between runs; the ratios come from "
             f"alternating runs.", ""]
    if train_rows:
        lines += ["Training (time ratio = our wall time / the peer's, CPU ratio = our CPU s / the peer's, "
                  "median (min-max) of alternating rounds; < 1 means faster; CPU s = user + system seconds "
                  "of the whole child process, all threads and workers, interpreter start-up included, a "
                  "load-independent view of the work done; memory ratio = our peak RSS (main + nproc x "
                  "largest worker) / theirs):", ""]
        lines.append(markdown_table(
            ["corpus", "MB", "vocab", "peer", "logitlab s", "peer s", "time ratio", "CPU s (ours / peer)",
             "CPU ratio", "logitlab MB", "peer MB", "memory ratio"],
            [[r["corpus"], f"{r['mb']:.1f}", r["vocab"], r["peer"], f"{statistics.median(r['ours_s']):.2f}",
              f"{statistics.median(r['peer_s']):.2f}",
              f"{r['time_ratio']:.2f} ({r['time_ratio_min']:.2f}-{r['time_ratio_max']:.2f})",
              f"{statistics.median(r['ours_cpu_s']):.1f} / {statistics.median(r['peer_cpu_s']):.1f}",
              f"{r['cpu_ratio']:.2f} ({r['cpu_ratio_min']:.2f}-{r['cpu_ratio_max']:.2f})",
              f"{statistics.median(r['ours_peak_mb']):.0f}", f"{statistics.median(r['peer_peak_mb']):.0f}",
              f"{r['mem_ratio']:.2f}"] for r in train_rows]))
        lines.append("")
    if encode_rows:
        lines += ["Encoding with GPT-2's vocabulary, MB/s (single thread, one call per text; speed ratios "
                  "> 1 mean ours is faster):", ""]
        lines.append(markdown_table(
            ["text", "MB", "logitlab fast", "tiktoken", "fast / tiktoken", "logitlab reference", "tokenizers",
             "reference / tokenizers"],
            [[r["text"], f"{r['mb']:.1f}", f"{r['mb_per_s']['logitlab fast']:.1f}", f"{r['mb_per_s']['tiktoken']:.1f}",
              f"{r['fast_vs_tiktoken']:.2f} ({r['fast_vs_tiktoken_min']:.2f}-{r['fast_vs_tiktoken_max']:.2f})",
              f"{r['mb_per_s']['logitlab reference']:.1f}", f"{r['mb_per_s']['tokenizers']:.1f}",
              f"{r['reference_vs_tokenizers']:.2f} ({r['reference_vs_tokenizers_min']:.2f}-"
              f"{r['reference_vs_tokenizers_max']:.2f})"] for r in encode_rows]))
    if trained_rows:
        lines += ["", "`encode_ordinary` with a 32k vocabulary logitlab trained on the stdlib corpus (no special "
                  "tokens) vs tiktoken's `encode_ordinary` with the same ranks, MB/s of CPU time (speed ratio "
                  "> 1 means ours is faster, median (min-max)):", ""]
        lines.append(markdown_table(
            ["text", "MB", "logitlab", "tiktoken", "speed ratio"],
            [[r["text"], f"{r['mb']:.2f}", f"{r['ours_mb_per_s']:.1f}", f"{r['tiktoken_mb_per_s']:.1f}",
              f"{r['speed_ratio']:.2f} ({r['speed_ratio_min']:.2f}-{r['speed_ratio_max']:.2f})"]
             for r in trained_rows]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tinyshakespeare only")
    parser.add_argument("--repeats", type=int, default=2, help="timed pairs per case (default 2)")
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    parser.add_argument("--only-32k", action="store_true",
                        help="training: only the stdlib 30 MB / 32k case (plus the trained-vocabulary encoding)")
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)   # one training run, in a child
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        _train_child(spec["side"], spec["list_file"], int(spec["vocab_size"]))
        return 0
    if not SHARED.is_dir():
        print(f"reference data {SHARED} is absent; nothing to benchmark", file=sys.stderr)
        return 1
    shakespeare = SHARED / "tinyshakespeare.txt"
    cases = [("tinyshakespeare", [shakespeare], 10_000)]
    texts = {"tinyshakespeare": shakespeare.read_text(encoding="utf-8")}
    stdlib = [] if args.quick else utf8_stdlib_files()
    if args.only_32k:
        cases, texts = [("stdlib *.py", stdlib, 32_000)], {}
    elif not args.quick:
        cases += [("stdlib *.py", stdlib, 10_000), ("stdlib *.py", stdlib, 32_000)]
        sample, size = [], 0
        for path in stdlib[::7]:
            sample.append(path.read_text(encoding="utf-8"))
            size += len(sample[-1])
            if size > 4_000_000:
                break
        texts["stdlib sample"] = "".join(sample)
    info = machine_info()
    info["load"] = os.getloadavg()
    command = "python3 -m bench.tokenizer" + (" --quick" if args.quick else "") + (
        " --only-32k" if args.only_32k else "") + (f" --repeats {args.repeats}" if args.repeats != 2 else "")
    train_rows = bench_training(cases, args.repeats)  # first: the children fork from a lean parent
    encode_rows = bench_encoding(texts, args.repeats + 1) if texts else []
    trained_rows = bench_trained_encoding(stdlib, max(3, args.repeats + 1)) if stdlib else []
    info["load_end"] = os.getloadavg()
    payload = {"machine": info, "command": command, "training": train_rows, "encoding": encode_rows,
               "trained_encoding": trained_rows}
    print(f"wrote {write_results('tokenizer', payload)}")
    if not args.no_doc:
        doc = report(train_rows, encode_rows, info, command, trained_rows)
        print(f"updated {update_doc_section('Tokenizer', doc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
