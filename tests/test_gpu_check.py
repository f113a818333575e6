"""bench.gpu_check, the check prepared for the day a GPU is lent, kept working on the CPU: the
budget, the parts' processes and their failures (a part that raises, hangs, lacks a dependency or
finds no time left), the report and the docs section; the device part for real on this CPU, and
(slow) every part on the CPU: tiny shapes, Triton's interpreter, gloo."""

from __future__ import annotations

import json
import textwrap

import pytest

from bench import common, gpu_check, gpu_report
from bench.gpu_check import PARTS, Part, Rows, run_cases, run_parts
from bench.gpu_model import known_peak


def fake_module(tmp_path, monkeypatch, name: str, body: str) -> Part:
    """A part module MODULE.py in tmp_path (on the children's PYTHONPATH) whose part runs `body`."""
    source = ("import sys, time\nfrom bench.gpu_check import child_main, run_cases\n\n\ndef part(spec, rows):\n"
              + textwrap.indent(textwrap.dedent(body), "    ")
              + f"\n\nsys.exit(child_main({{'{name}': part}}, sys.argv[1:]))\n")
    (tmp_path / f"fake_{name}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return Part(name, f"fake_{name}", min_s=0.1)


def by_part(records: list[dict]) -> dict:
    return {r["part"]: r for r in records}


def test_a_failing_part_is_recorded_and_the_next_part_runs(tmp_path, monkeypatch):
    boom = fake_module(tmp_path, monkeypatch, "boom", 'raise ValueError("no such kernel: flash_fwd")')
    fine = fake_module(tmp_path, monkeypatch, "fine", """\
        def broken():
            raise RuntimeError("out of shared memory")
        run_cases([("first", lambda: {"x": 1.0}), ("second", broken), ("third", lambda: {"x": 3.0})], spec, rows)
        """)
    got = by_part(run_parts([boom, fine], budget_s=60, cpu=True))
    assert got["boom"]["status"] == "failed"
    assert got["boom"]["note"] == "ValueError: no such kernel: flash_fwd"
    assert got["fine"]["status"] == "errors" and got["fine"]["note"] == "1 of 3 cases failed"
    rows = {r["case"]: r for r in got["fine"]["rows"]}
    assert rows["first"]["x"] == 1.0 and rows["third"]["x"] == 3.0
    assert rows["second"]["error"] == "RuntimeError: out of shared memory"


def test_a_hanging_part_is_killed_at_its_share_and_keeps_its_finished_cases(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "GRACE_S", 0.5)
    hang = fake_module(tmp_path, monkeypatch, "hang", """\
        rows.row("done", x=1.0)
        rows.begin("compiling")
        time.sleep(120)
        """)
    after = fake_module(tmp_path, monkeypatch, "after", 'rows.row("ran", x=2.0)')
    hang = Part(hang.name, hang.module, weight=1.0, min_s=0.1)
    after = Part(after.name, after.module, weight=1.0, min_s=0.1)
    got = by_part(run_parts([hang, after], budget_s=4, cpu=True))
    assert got["hang"]["status"] == "timeout" and got["hang"]["seconds"] < 6
    assert got["hang"]["rows"][0] == {"case": "done", "x": 1.0}
    assert got["hang"]["rows"][1]["case"] == "compiling" and "killed" in got["hang"]["rows"][1]["error"]
    assert got["after"]["status"] == "ok" and got["after"]["rows"] == [{"case": "ran", "x": 2.0}]


def test_a_missing_dependency_refuses_the_part_in_one_line(tmp_path, monkeypatch):
    part = Part("attention", "bench.gpu_kernels", needs=("triton_that_is_not_installed",))
    (record,) = run_parts([part], budget_s=60, cpu=True)
    assert record["status"] == "refused" and record["rows"] == []
    assert record["note"].startswith("refused: attention needs triton_that_is_not_installed")
    assert "\n" not in record["note"]


def test_triton_missing_names_the_extra(monkeypatch):
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    kernels = next(p for p in PARTS if p.name == "kernels")
    assert gpu_check.missing_need(kernels) == ("refused: kernels needs triton, which is not installed here; "
                                                "pip install 'logitlab[kernels]' (triton)")


def test_a_part_with_no_time_left_is_skipped(tmp_path, monkeypatch):
    late = fake_module(tmp_path, monkeypatch, "late", 'rows.row("never", x=1.0)')
    (record,) = run_parts([Part(late.name, late.module, min_s=1000.0)], budget_s=60, cpu=True)
    assert record["status"] == "skipped" and "needs at least 1000" in record["note"]


def test_cases_past_the_share_are_skipped_and_said_so(tmp_path):
    path = tmp_path / "rows.jsonl"
    spec = {"deadline": gpu_check.time.time() - 1}
    run_cases([("a", lambda: {"x": 1})], spec, Rows(path), min_s=1.0)
    rows, _ = gpu_check.collect(gpu_check.read_events(path), "unfinished")
    assert rows[0]["case"] == "a" and rows[0]["skipped"].startswith("not started")


def test_peak_figures_by_device_name():
    assert known_peak("NVIDIA H200") == 989e12
    assert known_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert known_peak("NVIDIA H100 PCIe") == 756e12
    assert known_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert known_peak("NVIDIA L4") == 121e12 and known_peak("NVIDIA L40S") == 362e12
    assert known_peak("NVIDIA GeForce RTX 4090") == 165.2e12
    assert known_peak("NVIDIA A10G") is None and known_peak("Some Future GPU") is None   # measured instead


def _result(mode: str) -> dict:
    gpu = mode == "cuda"
    return {"command": "python3 -m bench.gpu_check", "started_utc": "2026-01-01T00:00:00+00:00", "mode": mode,
            "budget_s": 420, "backend": "inductor", "elapsed_s": 400.0, "parts": [
                {"part": "device", "status": "ok", "seconds": 5.0, "note": "",
                 "info": {"device": "NVIDIA H200", "peak_flops": 989e12 if gpu else None, "peak_source": "datasheet"},
                 "rows": [{"case": "bf16 matmul", "tflops": 790.0}] if gpu else []},
                {"part": "train", "status": "errors", "seconds": 200.0, "note": "1 of 2 cases failed", "info": {},
                 "rows": [{"case": "gpt2-small", "params_m": 124.4, "batch": 8, "seq": 1024, "dtype": "bf16 autocast",
                           "compile_s": 50.0, "step_ms": 100.0, "tokens_per_s": 81920.0,
                           "mfu": 0.41 if gpu else None, "loss_first": 11.0, "loss_last": 9.0, "peak_gib": None},
                          {"case": "hybrid", "error": "Unsupported: graph break"}]},
                {"part": "decode", "status": "timeout", "seconds": 90.0, "note": "killed", "info": {},
                 "rows": [{"case": "gpt2-small, batch 32", "skipped": "not started: 3 s left"}]}]}


def test_the_report_on_a_gpu_and_on_a_cpu():
    gpu = gpu_report.render(_result("cuda"))
    assert "MFU against 989 TFLOP/s bf16 (datasheet)" in gpu
    assert "| gpt2-small | 124.4 | 8 x 1024 | bf16 autocast | 50.0 | 100.0 | 81920 | 41.0% |" in gpu
    assert "- hybrid: **failed**: Unsupported: graph break" in gpu
    assert "- gpt2-small, batch 32: skipped (not started: 3 s left)" in gpu
    assert "| decode | timeout | 90 | killed |" in gpu
    cpu = gpu_report.render(_result("cpu"))
    assert "MFU" not in cpu.split("**train**")[1].split("\n\n")[1]          # the table has no GPU-only column
    assert "MFU and memory: n/a on CPU." in cpu
    for result in (None, _result("cpu")):
        assert gpu_report.NOT_RUN in gpu_report.render_doc(result)
    assert gpu_report.NOT_RUN not in gpu_report.render_doc(_result("cuda"))


def test_publish_writes_the_gpu_section_and_leaves_the_others(tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Model\n\nCPU table\n\n## GPU\n\nold\n\n## Data preparation\n\nmore\n")
    monkeypatch.setattr(common, "DOC", doc)
    first, second = _result("cuda"), _result("cuda")
    second["command"] = "bash bench/gpu_check.sh OUT 200 decode"
    second["parts"] = [{"part": "decode", "status": "ok", "seconds": 60.0, "note": "", "info": {},
                        "rows": [{"case": "gpt2-small, batch 32", "prompt": 128, "new": 64, "compile_s": 20.0,
                                  "tokens_per_s": 3000.0, "ms_per_step": 10.7, "peak_gib": 2.0}]}]
    for name, result in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(result))
    assert gpu_check.main(["--publish", str(tmp_path / "a.json"), "--publish", str(tmp_path / "b.json")]) == 0
    text = doc.read_text()
    assert "CPU table" in text and "more" in text and "old" not in text
    section = text.split("## GPU")[1].split("## Data preparation")[0]
    assert "| gpt2-small | 124.4 |" in section                                 # train: the first run's
    assert "| gpt2-small, batch 32 | 128 + 64 | 20.0 | 3000 | 10.70 | 2.0 |" in section   # decode: the second's
    assert "| decode | ok | 60 |  |" in section and "bench/gpu_check.sh OUT 200 decode" in section


def test_the_docs_gpu_section_says_what_was_measured():
    body = common.DOC.read_text().split("\n## GPU\n", 1)[1].split("\n## ", 1)[0].strip()
    assert body == gpu_report.render_doc(None) or "**train**" in body


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit, match="unknown part.*attn.*known: device, kernels"):
        gpu_check.parse_parts("device,attn")


def test_the_device_part_runs_here_and_the_files_are_written(tmp_path):
    assert gpu_check.main(["--cpu", "--parts", "device", "--out", str(tmp_path), "--no-doc"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    (device,) = result["parts"]
    assert result["mode"] == "cpu" and device["status"] == "ok", device
    assert device["info"]["torch"] and device["info"]["peak_flops"] is None
    assert "Device: device CPU" in (tmp_path / "gpu_check.md").read_text()
    assert "===== device (exit 0) =====" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.slow  # several minutes on 2 cores: every part, its compiles traced by dynamo alone
def test_every_part_runs_on_the_cpu(tmp_path):
    assert gpu_check.main(["--cpu", "--backend", "eager", "--out", str(tmp_path), "--budget-s", "3000",
                           "--no-doc"]) == 0
    got = by_part(json.loads((tmp_path / "gpu_check.json").read_text())["parts"])
    assert list(got) == list(gpu_check.PART_NAMES)
    for name in ("device", "kernels", "dist", "attention", "train", "decode"):
        assert got[name]["status"] == "ok", (name, got[name])
    for name in ("kernels", "attention"):
        assert all(r["ok"] for r in got[name]["rows"]), got[name]["rows"]
    assert [r["case"] for r in got["dist"]["rows"]] == ["plain", "DDP", "FSDP2"]
    assert all(r["equal"] and r["backend"] == "gloo" for r in got["dist"]["rows"])
    trained = {r["case"]: r for r in got["train"]["rows"]}
    for name in ("gpt2-tiny", "qwen3.5-tiny", "gpt2-tiny, Triton attention"):   # the last: one graph, no break
        assert trained[name]["tokens_per_s"] > 0 and trained[name]["loss_last"] < trained[name]["loss_first"]
    assert all(r["tokens_per_s"] > 0 for r in got["decode"]["rows"]) and len(got["decode"]["rows"]) == 4
