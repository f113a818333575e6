"""bench/serve_paged.py on a tiny model: both engines, and transformers' continuous batching on the same
weights, give every request the same tokens; the report names its ratios and the peer's error."""

from __future__ import annotations

import pytest
import torch

from bench import serve_paged
from logitlab.model import ModelConfig, Transformer


def _tiny():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=257, context_length=256, d_model=32, n_layers=2, n_heads=4,
                                   norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)).eval()


def _result(loads, peer_error=None):
    return dict(command="python3 -m bench.serve_paged --quick", peer_error=peer_error, load_avg_end=3.5,
                machine=dict(nproc=2, torch_threads=1, commit="abc1234", load_avg_1m=2.5, transformers="5.0"),
                model=dict(d_model=32, n_layers=2), runs=[loads, loads],
                prefix=dict(cached_ms=1, uncached_ms=9, contiguous_ms=8, ratio=9, ratio_min=8, ratio_max=10,
                            repeats=1),
                gathers=dict(rows=2, index_ms=1, reference_ms=2, ratio=2),
                growth=dict(rows=2, steps=4, reused_ms=1.0, fresh_ms=2.5, reused_faults=3, fresh_faults=900, ratio=2.5),
                profile=dict(system=20, clients=3, wall_s=2.0, parts={"forward": 1.5, "linear layers": 0.5}))


def test_one_load_both_engines_same_tokens_and_the_report_renders(monkeypatch):
    model = _tiny()
    requests = serve_paged._workload(6, system=20, seed=3)
    runs = {kind: serve_paged._load(serve_paged._engine(kind, model, 3), requests, 3) for kind in serve_paged.ENGINES}
    assert runs["paged"]["outputs"] == runs["contiguous"]["outputs"]
    assert runs["paged"]["tokens"] == sum(n for _, n in requests)        # no end-of-text id: every budget spent
    assert runs["paged"]["tokens_recomputed"] == 0 and runs["paged"]["prefix_hit_tokens"] >= 5 * 16
    monkeypatch.setattr(serve_paged, "SYSTEMS", (20,))
    monkeypatch.setattr(serve_paged, "_workload", lambda n, system, seed: requests[:n])
    loads = serve_paged._loads(model, quick=True)
    assert all(load["differ"] == {"contiguous": 0} for load in loads)
    text = serve_paged.render(_result(loads, "RuntimeError: no device"))
    assert "**paged / contiguous**" in text and "contiguous 0." in text and "9.0x" in text
    assert "did not run here: `RuntimeError: no device`" in text and "at commit abc1234" in text
    assert "900 page faults" in text and "| forward | 1.50 | 75% |" in text


def test_transformers_continuous_batching_serves_the_same_tokens():
    pytest.importorskip("transformers")
    model = _tiny()
    hf, error = serve_paged.transformers_twin(model)
    assert error is None
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)    # the same weights
    requests = serve_paged._workload(4, system=20, seed=3)
    peer = serve_paged._load_transformers(hf, requests, 2)
    ours = serve_paged._load(serve_paged._engine("paged", model, 2), requests, 2)
    assert peer["outputs"] == ours["outputs"] and peer["tokens"] == sum(n for _, n in requests)
    assert peer["ttft_p50_ms"] > 0 and peer["itl_p50_ms"] > 0
    loads = [dict(system=20, clients=2, requests=4, differ={"contiguous": 0, "transformers": 0}, paged=ours,
                  contiguous=ours, transformers=peer)]
    text = serve_paged.render(_result(loads))
    assert "**paged / transformers**" in text and "| 2 | 20 | 2 | 1.00x |" in text and "transformers 0" in text
