"""The GPU check: one command that runs every GPU-only part of logitlab once, within a time budget,
and writes what it measured as a table (gpu_check.md) and a JSON file (gpu_check.json).

    python3 -m bench.gpu_check                          # on a CUDA machine; --out DIR, --budget-s 420
    python3 -m bench.gpu_check --cpu --backend eager    # tiny shapes on CPU: the check of the check
    python3 -m bench.gpu_check --parts attention,train  # some parts only
    python3 -m bench.gpu_check --publish DIR/gpu_check.json   # its tables into docs/benchmarks.md
                                                        # (--publish repeated: runs merged, the later wins)
    bash bench/gpu_check.sh OUT_DIR                     # a lent machine: nothing installed, results in OUT_DIR

Parts, in the order they run (each one a child process, see below):
  device     the GPU, versions, and the bf16 peak that MFU is read against: the vendor's dense
             figure for a known device name, else (and besides) an 8192^3 bf16 matmul measured;
  kernels    the fused RMSNorm, SwiGLU and LM head + cross-entropy (Triton) against the eager path:
             error, fwd+bwd time, peak memory;
  dist       one optimizer step after another through torchrun (1 rank, NCCL; gloo on CPU): plain,
             DDP and FSDP2 on the same weights and batches, losses compared;
  attention  Triton FlashAttention forward and backward against SDPA (flash backend): the
             interpreter tests' shapes (errors) and realistic ones (errors, TFLOP/s, ratio);
  train      compiled bf16 training steps of GPT-2 small and a Qwen3.5-style hybrid: tokens/s, MFU;
  decode     compiled decode steps, batch 1 and 32, the same shapes: tokens/s.

Budget: each part gets a share of the time still left (its weight over the weights of the parts
not yet run, so time a part leaves unused goes to the next ones), skips its remaining cases once
its share is spent (saying so), and is killed at the end of its share plus a short grace if a
compile or a kernel hangs; the cases it finished are kept, the one it was in is named. A part
that raises is recorded with its error and the next part runs, so the files are always written.

Without CUDA (or with --cpu) every part runs tiny shapes on the CPU, the Triton parts in Triton's
interpreter (TRITON_INTERPRET=1 in the child's environment) and dist over gloo; speeds there are
not the GPU's, and TFLOP/s, MFU and the kernels' speed are reported "n/a on CPU". A part whose
dependency is missing (triton, torch.distributed) is refused with one line naming it.

Child protocol: `python3 -m MODULE PART SPEC_JSON ROWS_JSONL` runs one part; it appends one JSON
line per event to ROWS_JSONL: {"event": "begin", "case": ...} before a case, {"event": "row",
...} after it, {"event": "info", ...} for facts about the part. Part modules call child_main.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu-check"
DEFAULT_BUDGET_S = 420.0
GRACE_S = 10.0          # past its share, a part still running is killed after this
SECTION = "GPU"


@dataclass(frozen=True)
class Part:
    """One part of the check: `python3 -m module name ...` in a child process. weight: its share
    of the remaining budget; min_s: skipped when less than this is left; needs: modules it imports
    (a missing one refuses the part, naming it)."""

    name: str
    module: str
    weight: float = 1.0
    min_s: float = 5.0
    needs: tuple[str, ...] = ()


PARTS = (
    Part("device", "bench.gpu_model", weight=0.5),
    Part("kernels", "bench.gpu_kernels", weight=1.0, needs=("triton",)),
    Part("dist", "bench.gpu_dist", weight=1.0, min_s=15.0, needs=("torch.distributed",)),
    Part("attention", "bench.gpu_kernels", weight=3.5, min_s=15.0, needs=("triton",)),
    Part("train", "bench.gpu_model", weight=3.0, min_s=20.0),
    Part("decode", "bench.gpu_model", weight=2.0, min_s=20.0),
)
PART_NAMES = tuple(p.name for p in PARTS)


# --------------------------------------------------------------------------------------------
# The child side: one part in its own process
# --------------------------------------------------------------------------------------------

class Rows:
    """A part's events, one JSON line each, flushed at once so that a killed part keeps them."""

    def __init__(self, path: str | Path):
        self._file = open(path, "a")

    def emit(self, event: str, **data) -> None:
        self._file.write(json.dumps({"event": event, **data}, default=str) + "\n")
        self._file.flush()

    def begin(self, case: str) -> None:
        self.emit("begin", case=case)

    def row(self, case: str, **data) -> None:
        self.emit("row", case=case, **data)

    def info(self, **data) -> None:
        self.emit("info", **data)


def time_left(spec: dict) -> float:
    """Seconds until this part's share of the budget ends."""
    return spec["deadline"] - time.time()


def run_cases(cases: list[tuple[str, Callable[[], dict]]], spec: dict, rows: Rows, min_s: float = 2.0) -> None:
    """Each (name, fn) in turn: fn() -> the row's data. A case that raises is recorded with its
    error (the next one runs). A case starts only while the part's share has at least min_s left,
    and at least the shortest time a case took so far (a case cut off by the kill is lost); the
    others are recorded as skipped."""
    took: list[float] = []
    for name, fn in cases:
        need = max([min_s] + ([min(took)] if took else []))
        if time_left(spec) < need:
            rows.row(name, skipped=f"not started: {max(0.0, time_left(spec)):.0f} s of the part's share left, "
                                   f"a case takes {need:.0f} s or more")
            continue
        rows.begin(name)
        t0 = time.time()
        try:
            rows.row(name, **fn(), seconds=round(time.time() - t0, 1))
        except Exception as exc:  # one case's failure is a finding; the next case runs
            rows.row(name, error=one_line(exc), seconds=round(time.time() - t0, 1))
            traceback.print_exc()
        took.append(time.time() - t0)


def one_line(exc: BaseException) -> str:
    """The exception on one line, with the first lines of what caused it (a compiler's error
    wraps the user-code exception it met, which says more)."""
    def short(e: BaseException, n: int) -> str:
        text = " ".join(str(e).split())
        return f"{type(e).__name__}: {text[:n]}{'...' if len(text) > n else ''}"
    line = short(exc, 300)
    if exc.__cause__ is not None:
        line += f" (caused by {short(exc.__cause__, 300)})"
    return line


def child_main(parts: dict[str, Callable[[dict, Rows], None]], argv: list[str]) -> int:
    """`python3 -m MODULE PART SPEC_JSON ROWS_JSONL`: run parts[PART](spec, rows)."""
    if len(argv) != 3 or argv[0] not in parts:
        print(f"usage: python3 -m MODULE {{{','.join(parts)}}} SPEC_JSON ROWS_JSONL", file=sys.stderr)
        return 2
    name, spec, rows = argv[0], json.loads(argv[1]), Rows(argv[2])
    parts[name](spec, rows)
    return 0


# --------------------------------------------------------------------------------------------
# The parent side: the budget, the children, the files
# --------------------------------------------------------------------------------------------

def missing_need(part: Part) -> str | None:
    """The line that refuses `part` when a module it needs is missing, else None."""
    for need in part.needs:
        try:
            found = importlib.util.find_spec(need) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            extra = {"triton": "pip install 'logitlab[kernels]' (triton)"}.get(need, f"a torch build with {need}")
            return f"refused: {part.name} needs {need}, which is not installed here; {extra}"
    return None


def child_env(part: Part, cpu: bool) -> dict:
    """The child's environment: this checkout first on PYTHONPATH; on CPU no visible GPU and
    Triton's interpreter (chosen before the kernels are imported, which is why parts are processes)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:   # a line cut off by a kill
            pass
    return events


def collect(events: list[dict], unfinished: str) -> tuple[list[dict], dict]:
    """(rows, info) from a child's events; a case begun without its row gets `unfinished`."""
    rows, info, open_case = [], {}, None
    for e in events:
        kind = e.pop("event", None)
        if kind == "begin":
            open_case = e["case"]
        elif kind == "row":
            rows.append(e)
            open_case = None if e.get("case") == open_case else open_case
        elif kind == "info":
            info.update(e)
    if open_case is not None:
        rows.append({"case": open_case, "error": unfinished})
    return rows, info


def run_child(part: Part, spec: dict, kill_at: float, log) -> dict:
    """Run one part to its end or to kill_at (time.time()); -> its record (status, rows, ...)."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{part.name}-") as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        cmd = [sys.executable, "-m", part.module, part.name, json.dumps(spec), str(rows_path)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(part, spec["cpu"]), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(1.0, kill_at - time.time()))
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # the part and anything it started (torchrun, compile workers)
            out, _ = proc.communicate()
            killed = True
        log.write(f"\n===== {part.name} (exit {proc.returncode}{', killed' if killed else ''}) =====\n{out}")
        log.flush()
        reason = "killed at the end of the part's share of the budget while running" if killed else \
            f"the part's process died while running (exit {proc.returncode})"
        rows, info = collect(read_events(rows_path), reason)
    record = {"rows": rows, "info": info}
    if killed:
        record.update(status="timeout", note="killed at the end of its share of the budget; finished cases kept")
    elif proc.returncode != 0:
        record.update(status="failed", note=last_error(out, proc.returncode), output_tail=out[-3000:])
    elif any("error" in r for r in rows):
        record.update(status="errors", note=f"{sum('error' in r for r in rows)} of {len(rows)} cases failed")
    else:
        record.update(status="ok", note="")
    if any("skipped" in r for r in rows) and record["status"] in ("ok", "errors"):
        skipped = sum("skipped" in r for r in rows)
        record["note"] = "; ".join(n for n in (record["note"], f"{skipped} cases skipped for time") if n)
    return record


def last_error(output: str, code: int) -> str:
    """The exception line of a traceback in `output`, or the exit status."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith((" ", "\t")) and ("Error" in line or "Exception" in line):
            return line.strip()[:600]
    return f"exit status {code}" + (f": {lines[-1].strip()[:400]}" if lines else "")


def run_parts(parts: tuple[Part, ...] | list[Part], budget_s: float, cpu: bool, backend: str = "inductor",
              log=None, progress: Callable[[str], None] = lambda line: None,
              done: Callable[[list[dict]], None] = lambda records: None) -> list[dict]:
    """Every part in turn within budget_s seconds -> one record per part (name, status, seconds,
    note, rows, info); done(records so far) after each. Never raises for a part's failure."""
    log = log or open(os.devnull, "w")
    start = time.time()
    end = start + budget_s
    records, peak = [], None
    for i, part in enumerate(parts):
        left = end - time.time()
        share = left * part.weight / sum(p.weight for p in parts[i:])
        t0 = time.time()
        refused = missing_need(part)
        if refused:
            record = {"status": "refused", "note": refused, "rows": [], "info": {}}
        elif left < part.min_s:
            record = {"status": "skipped", "note": f"not started: {max(left, 0):.0f} s of the budget left, "
                                                   f"it needs at least {part.min_s:.0f}", "rows": [], "info": {}}
        else:
            spec = {"cpu": cpu, "deadline": t0 + share, "backend": backend, "peak_flops": peak}
            try:
                record = run_child(part, spec, min(t0 + share + GRACE_S, end + GRACE_S), log)
            except Exception as exc:  # the child could not even start: recorded, the next part runs
                record = {"status": "failed", "note": one_line(exc), "rows": [], "info": {}}
        peak = record["info"].get("peak_flops", peak)
        records.append({"part": part.name, "seconds": round(time.time() - t0, 1), **record})
        progress(f"== {part.name}: {record['status']} in {time.time() - t0:.0f} s"
                 + (f" ({record['note']})" if record["note"] else ""))
        done(records)
    return records


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def write_outputs(result: dict, out: Path) -> tuple[Path, Path]:
    """gpu_check.json and gpu_check.md in `out`, each written whole (temp file, then rename)."""
    from bench.gpu_report import render

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in (("gpu_check.json", json.dumps(result, indent=2, default=str) + "\n"),
                       ("gpu_check.md", render(result) + "\n")):
        path = out / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


def parse_parts(text: str) -> tuple[Part, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PART_NAMES]
    if unknown or not names:
        raise SystemExit(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(PART_NAMES)}")
    return tuple(p for p in PARTS if p.name in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for gpu_check.json/.md (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for all parts together")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU even where CUDA is available")
    parser.add_argument("--parts", default=",".join(PART_NAMES), help=f"comma-separated, of {','.join(PART_NAMES)}")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of train and decode (eager: dynamo's trace alone, a quick CPU check)")
    parser.add_argument("--no-doc", action="store_true", help="leave docs/benchmarks.md as it is")
    parser.add_argument("--publish", type=Path, metavar="JSON", action="append",
                        help="write JSON's tables into docs/benchmarks.md and stop; repeated, the runs are merged "
                             "(each part as the last file that has it recorded it)")
    args = parser.parse_args(argv)
    from bench.common import command_line, update_doc_section
    from bench.gpu_report import merge, render_doc

    if args.publish:
        result = merge([json.loads(path.read_text()) for path in args.publish])
        print(f"wrote the {SECTION!r} section of {update_doc_section(SECTION, render_doc(result))}")
        return 0
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    parts = parse_parts(args.parts)
    cpu = args.cpu or not cuda_available()
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"gpu check on {'CPU (tiny shapes, Triton interpreter, gloo)' if cpu else 'CUDA'}: "
          f"{', '.join(p.name for p in parts)} within {args.budget_s:.0f} s", flush=True)

    def result(records: list[dict]) -> dict:
        return {"command": command_line(), "started_utc": started.isoformat(timespec="seconds"),
                "mode": "cpu" if cpu else "cuda", "budget_s": args.budget_s, "backend": args.backend,
                "elapsed_s": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
                "parts": records}

    with open(args.out / "gpu_check.log", "w") as log:   # the files are rewritten after every part
        records = run_parts(parts, args.budget_s, cpu, args.backend, log, lambda line: print(line, flush=True),
                            lambda so_far: write_outputs(result(so_far), args.out))
    json_path, md_path = write_outputs(result(records), args.out)
    print(md_path.read_text())
    print(f"results: {json_path}, {md_path}")
    if not cpu and not args.no_doc:
        update_doc_section(SECTION, render_doc(result(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
