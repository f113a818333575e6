"""bench/mla.py at a tiny size: the two forms agree before they are timed, and the result renders."""

from __future__ import annotations

from bench import mla as mla_bench


def test_decode_bench_compares_equal_forms_and_renders(monkeypatch):
    monkeypatch.setattr(mla_bench, "SHAPES", [("tiny", 64, 2, 8)])
    rows = mla_bench.bench_decode(quick=True, repeats=1)
    assert len(rows) == 1 and rows[0]["ratio"] > 0
    assert rows[0]["cached_values"] == 8 * 576 and rows[0]["expanded_values"] == 8 * 2 * 256
    text = mla_bench.render({"command": "python3 -m bench.mla", "clock": "wall time", "rows": rows,
                             "machine": {"cpu": "cpu", "nproc": 2, "torch_threads": 1, "torch": "2",
                                         "load_avg_1m": 1.0}})
    assert "| tiny, S 8 | 4,608 | 4,096 |" in text
