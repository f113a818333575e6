"""bench.load at a tiny size: the synthetic sharded checkpoint is one that transformers and
logitlab both load to the same logits, and a measured round reports both sides."""

from __future__ import annotations

import json

import pytest
import torch

from bench import load as load_bench
from logitlab.io import hf
from logitlab.model import ModelConfig

MICRO = dict(vocab_size=256, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
             norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False)


def test_the_synthetic_checkpoint_is_sharded_and_loads_alike(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "c"
    size = load_bench.write_checkpoint(ModelConfig(**MICRO), d, "bf16", shard_bytes=40_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and index["metadata"]["total_size"] == size
    ours = hf.load_pretrained(d)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype="auto").eval()
    assert next(ours.parameters()).dtype == torch.bfloat16 == next(theirs.parameters()).dtype
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).float(), theirs(input_ids=ids).logits.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_a_measured_round_reports_both_sides(tmp_path, monkeypatch):
    monkeypatch.setitem(load_bench.SHAPES, "micro", (MICRO, "fp32", "bf16", 40_000))
    (out,) = load_bench.measure("micro", tmp_path, repeats=1, threads=1)    # a cast: no mmap=False row
    assert out["dtype"] == "bf16" and out["shards"] > 2 and out["speed"] > 0 and out["memory"] > 0
    monkeypatch.setitem(load_bench.SHAPES, "micro-bf16", (MICRO, "bf16", None, 40_000))
    rows = load_bench.measure("micro-bf16", tmp_path, repeats=1, threads=1)
    assert [r["shape"] for r in rows] == ["micro-bf16", "micro-bf16, mmap=False"]
    assert all(r["speed"] > 0 and r["memory"] > 0 for r in rows)
    text = load_bench.render(dict(machine=dict(nproc=2, cpu="c", torch="t", transformers="x", commit="c"),
                                  command="python3 -m bench.load", repeats=1, threads=1, results=[out, *rows],
                                  skipped=["qwen3.5-2b"]))
    assert "micro" in text and "micro-bf16, mmap=False" in text
