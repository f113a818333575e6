"""Shared benchmark plumbing: alternating timings, ratios, machine facts, result files.

Every benchmark runs logitlab and its peer alternately (A B A B ...) after a warm-up, so slow
drift of a shared machine hits both sides alike, and reports the median of the per-pair ratios
with their min and max. Results go to bench/results/<name>.json (git-ignored) and a markdown
table into this benchmark's own `## <title>` section of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


# The clock of timed(): wall time by default. use_cpu_time() switches to this process's CPU time,
# the measure that holds on a loaded machine for a single-threaded benchmark (other jobs' time
# slices are not counted); with several threads it also counts their spin-waits.
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def use_cpu_time(on: bool = True) -> str:
    """Time with time.process_time (on) or time.perf_counter; returns the clock's name for reports."""
    CLOCK[0] = time.process_time if on else time.perf_counter
    return "process CPU time" if on else "wall time"


def timed(fn: Callable[[], object]) -> float:
    clock = CLOCK[0]
    start = clock()
    fn()
    return clock() - start


def alternate(ours: Callable[[], object], peer: Callable[[], object], repeats: int = 3,
              warmup: int = 1) -> dict:
    """Time `ours` and `peer` in pairs (A B A B ...) after `warmup` untimed pairs.

    -> {"ours": [s, ...], "peer": [s, ...], "ratio": median of peer/ours per pair (> 1: ours faster),
        "ratio_min", "ratio_max"}"""
    for _ in range(warmup):
        ours()
        peer()
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(ours))
        b.append(timed(peer))
    ratios = [pb / pa for pa, pb in zip(a, b)]
    return {"ours": a, "peer": b, "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import torch

    info = {"nproc": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    try:
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)   # others' work on a shared machine
    except OSError:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def command_line() -> str:
    """The command as typed, for a results file and its docs section; an absolute path outside
    the repository (a peer's clone) is shown by its last part only, as `.../name`, since where
    one machine keeps its clones says nothing to a reader."""
    module = Path(sys.argv[0]).stem
    return shlex.join(["python3", "-m", "bench." + module, *map(_shown_path, sys.argv[1:])])


def _shown_path(arg: str) -> str:
    if not arg.startswith("/") or Path(arg).resolve().is_relative_to(ROOT):
        return arg
    return ".../" + Path(arg).name


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def publish(name: str, title: str, result: dict, render, quick: bool = False, doc: bool = True) -> Path:
    """A benchmark's ending: results to bench/results/<name>[-quick].json (printed), and unless
    doc is False its `## title` section of docs/benchmarks.md rewritten from render(result)."""
    path = write_results(f"{name}-quick" if quick else name, result)
    print(f"results: {path}")
    if doc:
        update_doc_section(title, render(result))
    return path


def add_section_option(parser, default: str) -> None:
    """--section TITLE: the docs/benchmarks.md section a benchmark writes (default its own), so
    that another machine's run keeps the default section and writes one of its own."""
    parser.add_argument("--section", default=default, metavar="TITLE",
                        help=f"the docs/benchmarks.md section to write (default {default!r}); another title keeps "
                             "that one and writes or rewrites its own, e.g. for another machine, with the results "
                             "in bench/results/<name>-<title>.json")


def results_name(name: str, section: str, default: str) -> str:
    """The results file's name for a run written to `section`: `name` for the default section,
    else `name` and the title's words joined by '-'."""
    if section == default:
        return name
    return name + "-" + re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


def update_doc_section(title: str, body: str) -> Path:
    """Replace (or append) the `## title` section of docs/benchmarks.md, leaving the others intact."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    header = f"## {title}"
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == header)
    except StopIteration:
        new = text.rstrip("\n") + f"\n\n{header}\n\n{body.strip()}\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "\n".join(lines[:start] + [header, "", body.strip(), ""] + lines[end:]).rstrip("\n") + "\n"
    DOC.write_text(new)
    return DOC



# --------------------------------------------------------------------------------------------
# Peak resident memory, measured in a fresh child process (Linux /proc)
# --------------------------------------------------------------------------------------------

def rss_kib(field: str = "VmRSS") -> int:
    """This process's /proc/self/status `field` (VmRSS: resident now; VmHWM: the peak), KiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the peak (VmHWM) to the current RSS (writing 5 to /proc/self/clear_refs); -> that RSS (KiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS")


def run_child(module: str, flag: str, spec: dict) -> list[str]:
    """Run `python3 -m module flag JSON(spec)` in a fresh interpreter (so nothing this process
    allocated or imported counts) and return its stdout lines; a failure raises with its stderr."""
    args = [sys.executable, "-m", module, flag, json.dumps(spec)]
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{module} {flag} {spec} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()

CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags(wanted: tuple[str, ...] = CPU_FEATURES) -> list[str]:
    """The instruction-set features from /proc/cpuinfo that matter for matmul speed (bf16/AMX)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []
