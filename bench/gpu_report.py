"""The GPU check's report: its JSON result (bench.gpu_check) as markdown tables, for gpu_check.md
and the "GPU" section of docs/benchmarks.md. Imports no torch: it renders saved results anywhere.
"""

from __future__ import annotations

from typing import Callable

from bench.common import markdown_table

CPU_NA = "n/a on CPU"
RUN_HOW = """\
`python3 -m bench.gpu_check` runs every GPU-only part of logitlab once within a time budget
(`--budget-s`, default 420 s; each part takes a share of the time left, skips what would not fit
and says so; a part that fails is recorded and the next one runs) and writes gpu_check.json and
gpu_check.md to `--out` (default bench/results/gpu-check). On a machine lent for a few minutes,
with its own python3, torch and triton and nothing installed: `bash bench/gpu_check.sh OUT_DIR`.
`python3 -m bench.gpu_check --publish OUT_DIR/gpu_check.json` then writes the tables into this
section. Without CUDA (or with `--cpu`) the same parts run tiny shapes on the CPU (Triton's
interpreter, gloo), which tests/test_gpu_check.py does so that the check keeps working; those
numbers are not GPU numbers and are never published here."""
NOT_RUN = "**Nothing in this file has been measured on a GPU yet.** Every other table in this file ran on a CPU."


def fmt(value, digits: int = 1) -> str:
    """A cell: None -> "-"; floats to `digits` decimals (below 10^-digits: two significant digits)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** -digits:
            return f"{value:.2g}"
        return f"{value:.{digits}f}"
    return str(value)


def _pair(row: dict, a: str, b: str, digits: int) -> str:
    return f"{fmt(row.get(a), digits)} ({fmt(row.get(b), digits)})"


def _slash(row: dict, a: str, b: str, digits: int) -> str:
    return f"{fmt(row.get(a), digits)} / {fmt(row.get(b), digits)}"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


# part -> [(header, row -> cell, GPU only)]; GPU-only columns are left out of a CPU run's tables
Column = tuple[str, Callable[[dict], str], bool]
COLUMNS: dict[str, list[Column]] = {
    "device": [("measurement", lambda r: r["case"], False), ("TFLOP/s", lambda r: fmt(r.get("tflops"), 0), True)],
    "kernels": [
        ("case", lambda r: r["case"], False),
        ("err fused (eager)", lambda r: _pair(r, "err_fused", "err_eager", 4), False),
        ("grad err fused (eager)", lambda r: _pair(r, "grad_err_fused", "grad_err_eager", 4), False),
        ("ok", lambda r: fmt(r.get("ok")), False),
        ("fwd+bwd ms fused / eager", lambda r: _slash(r, "fused_ms", "eager_ms", 2), True),
        ("speed-up", lambda r: fmt(r.get("speedup"), 2), True),
        ("peak MiB fused / eager", lambda r: _slash(r, "fused_peak_mib", "eager_peak_mib", 0), True)],
    "attention": [
        ("shape", lambda r: r["case"], False), ("dtype", lambda r: r.get("dtype", ""), False),
        ("out err triton (sdpa)", lambda r: _pair(r, "err_out", "err_out_sdpa", 4), False),
        ("grad err triton (sdpa)", lambda r: _pair(r, "err_grad", "err_grad_sdpa", 4), False),
        ("ok", lambda r: fmt(r.get("ok")), False), ("sdpa", lambda r: r.get("sdpa_backend", ""), False),
        ("first call s", lambda r: fmt(r.get("first_call_s"), 1), False),
        ("fwd TFLOP/s triton / sdpa", lambda r: _slash(r, "fwd_tflops", "sdpa_fwd_tflops", 0), True),
        ("ratio", lambda r: fmt(r.get("fwd_ratio"), 2), True),
        ("fwd+bwd TFLOP/s triton / sdpa", lambda r: _slash(r, "fb_tflops", "sdpa_fb_tflops", 0), True),
        ("ratio", lambda r: fmt(r.get("fb_ratio"), 2), True)],
    "train": [
        ("model", lambda r: r["case"], False), ("params (M)", lambda r: fmt(r.get("params_m"), 1), False),
        ("B x T", lambda r: f"{r.get('batch')} x {r.get('seq')}", False), ("dtype", lambda r: r.get("dtype", ""), False),
        ("compile s", lambda r: fmt(r.get("compile_s"), 1), False), ("step ms", lambda r: fmt(r.get("step_ms"), 1), False),
        ("tokens/s", lambda r: fmt(r.get("tokens_per_s"), 0), False), ("MFU", lambda r: _percent(r.get("mfu")), True),
        ("loss first -> last", lambda r: f"{fmt(r.get('loss_first'), 3)} -> {fmt(r.get('loss_last'), 3)}", False),
        ("peak GiB", lambda r: fmt(r.get("peak_gib"), 1), True)],
    "decode": [
        ("model, batch", lambda r: r["case"], False), ("prompt + new", lambda r: f"{r.get('prompt')} + {r.get('new')}", False),
        ("compile s", lambda r: fmt(r.get("compile_s"), 1), False), ("tokens/s", lambda r: fmt(r.get("tokens_per_s"), 0), False),
        ("ms per step", lambda r: fmt(r.get("ms_per_step"), 2), False), ("peak GiB", lambda r: fmt(r.get("peak_gib"), 1), True)],
    "dist": [
        ("mode", lambda r: r["case"], False), ("backend", lambda r: r.get("backend", ""), False),
        ("losses", lambda r: ", ".join(f"{x:.5f}" for x in r.get("losses", [])), False),
        ("max rel diff vs plain", lambda r: fmt(r.get("max_diff"), 2), False), ("equal", lambda r: fmt(r.get("equal")), False),
        ("step ms", lambda r: fmt(r.get("step_ms"), 1), False)],
}
GPU_ONLY_NOTE = {"device": "TFLOP/s", "kernels": "speed and memory", "attention": "TFLOP/s",
                 "train": "MFU and memory", "decode": "memory"}


def part_table(record: dict, cpu: bool) -> str:
    """The rows of one part as a table; failed and skipped cases as a line each below it."""
    columns = [c for c in COLUMNS.get(record["part"], [("case", lambda r: r["case"], False)]) if not (cpu and c[2])]
    good = [r for r in record["rows"] if "error" not in r and "skipped" not in r]
    lines = [markdown_table([c[0] for c in columns], [[c[1](r) for c in columns] for r in good])] if good else []
    if cpu and good and record["part"] in GPU_ONLY_NOTE:
        lines.append(f"{GPU_ONLY_NOTE[record['part']]}: {CPU_NA}.")
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"- {r['case']}: **failed**: {r['error']}")
        elif "skipped" in r:
            lines.append(f"- {r['case']}: skipped ({r['skipped']})")
    return "\n\n".join(lines) if lines else "(no cases ran)"


def summary(result: dict) -> str:
    rows = [[r["part"], r["status"], fmt(r.get("seconds"), 0), r.get("note", "")] for r in result["parts"]]
    return markdown_table(["part", "status", "seconds", "note"], rows)


def device_line(result: dict) -> str:
    info = next((r["info"] for r in result["parts"] if r["part"] == "device" and r.get("info")), {})
    if not info:
        return "Device: not recorded (the device part did not run)."
    keys = ("device", "capability", "memory_gib", "cpu", "nproc", "python", "torch", "cuda", "triton")
    facts = ", ".join(f"{k} {info[k]}" for k in keys if info.get(k) not in (None, ""))
    peak = info.get("peak_flops")
    source = f"; MFU against {peak / 1e12:.0f} TFLOP/s bf16 ({info.get('peak_source')})" if peak else ""
    return f"Device: {facts}{source}."


def render(result: dict) -> str:
    """The whole report: command, device, the parts' statuses, one table per part."""
    cpu = result.get("mode") == "cpu"
    runs = result.get("runs") or [result]
    head = "\n".join(f"GPU check, `{r.get('command', '')}`, started {r.get('started_utc', '?')} "
                     f"({result.get('mode', '?')}, compile backend {result.get('backend', '?')}, "
                     f"{fmt(r.get('elapsed_s'), 0)} s of a {fmt(r.get('budget_s'), 0)} s budget)." for r in runs)
    parts = [head, device_line(result), summary(result)]
    for record in result["parts"]:
        if record["part"] != "device" or record["rows"]:
            parts.append(f"**{record['part']}**\n\n{part_table(record, cpu)}")
    return "\n\n".join(parts)


def merge(results: list[dict]) -> dict:
    """Several runs' results as one: each part as its latest run recorded it (a second, shorter run
    of the parts the first one cut short replaces them), the commands of all runs in `runs`."""
    merged = {**results[0], "parts": [], "runs": []}
    by_name: dict[str, dict] = {}
    for result in results:
        merged["runs"].append({k: result.get(k) for k in ("command", "started_utc", "elapsed_s", "budget_s")})
        for record in result["parts"]:
            by_name[record["part"]] = record
        if result.get("mode") != results[0].get("mode"):
            raise ValueError(f"cannot merge a {result.get('mode')} run into a {results[0].get('mode')} run")
    merged["parts"] = list(by_name.values())
    return merged


def render_doc(result: dict | None) -> str:
    """The body of docs/benchmarks.md's "GPU" section: how to run the check, then its report, or
    the plain statement that nothing was measured on a GPU (for None or a CPU run)."""
    if result is None or result.get("mode") != "cuda":
        return f"{RUN_HOW}\n\n{NOT_RUN}"
    return f"{RUN_HOW}\n\n{render(result)}"
