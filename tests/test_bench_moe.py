"""bench/moe.py at a tiny size: the two sides agree before they are timed, and the result renders."""

from __future__ import annotations

import torch

from bench import moe as moe_bench


def test_block_bench_compares_equal_blocks_and_renders(monkeypatch):
    monkeypatch.setattr(moe_bench, "BLOCK_SHAPES", [("tiny", 16, 4, 2, 8, 32)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows = moe_bench.bench_block(quick=True, repeats=1)
    finally:
        torch.set_num_threads(before)
    assert {(r["pass_"], r["against"]) for r in rows} == {
        (p, f"transformers {impl}") for p in ("forward", "training step") for impl in ("eager", "grouped_mm")}
    assert all(r["ratio"] > 0 for r in rows) and {r["form"] for r in rows} <= {"sorted", "grouped"}
    text = moe_bench.render({"command": "python3 -m bench.moe", "clock": "wall time", "rows": rows,
                             "machine": {"cpu": "cpu", "nproc": 2, "torch_threads": 1, "torch": "2",
                                         "transformers": "5", "load_avg_1m": 1.0}})
    assert f"| block | tiny, 32 tokens | forward | {rows[0]['form']} | transformers eager |" in text
    assert all(r["floor"] > 0 for r in rows) and "| tiny, 32 tokens | training step |" in text.split("GEMM floor:")[1]


def test_blocks_hold_the_same_weights():
    ours, theirs = moe_bench._blocks(16, 4, 2, 8)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        for block in theirs.values():
            torch.testing.assert_close(ours(x), block(x), atol=1e-6, rtol=1e-5)
