"""bench/serve_paged.py on a tiny model: both engines give every request the same tokens, the
report names its ratios."""

from __future__ import annotations

import torch

from bench import serve_paged
from logitlab.model import ModelConfig, Transformer


def test_one_load_both_engines_same_tokens_and_the_report_renders(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=257, context_length=256, d_model=32, n_layers=2, n_heads=4)).eval()
    requests = serve_paged._workload(6, system=20, seed=3)
    runs = {kind: serve_paged._load(serve_paged._engine(kind, model, 3), requests, 3) for kind in serve_paged.ENGINES}
    assert runs["paged"]["outputs"] == runs["contiguous"]["outputs"]
    assert runs["paged"]["tokens"] == sum(n for _, n in requests)        # no end-of-text id: every budget spent
    assert runs["paged"]["tokens_recomputed"] == 0 and runs["paged"]["prefix_hit_tokens"] >= 5 * 16
    monkeypatch.setattr(serve_paged, "SYSTEMS", (20,))
    monkeypatch.setattr(serve_paged, "_workload", lambda n, system, seed: requests[:n])
    loads = serve_paged._loads(model, quick=True)
    result = dict(command="python3 -m bench.serve_paged --quick", machine=dict(nproc=2, torch_threads=1),
                  model=dict(d_model=32, n_layers=2), loads=loads,
                  prefix=dict(cached_ms=1, uncached_ms=9, contiguous_ms=8, ratio=9, ratio_min=8, ratio_max=10,
                              repeats=1),
                  gathers=dict(rows=2, index_ms=1, reference_ms=2, ratio=2))
    text = serve_paged.render(result)
    assert "**paged / contiguous**" in text and "0 request(s) got other tokens" in text and "9.0x" in text
