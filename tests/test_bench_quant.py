"""bench.quant_decode's own arithmetic and plumbing, without its peers (gpt-fast, llama.cpp):
bytes read per token for a model and for a GGUF file written by logitlab, bandwidth, ratios,
the order the sides take turns in, and the table."""

from __future__ import annotations

import pytest
import torch

from bench import quant_decode as qd

MACHINE = dict(nproc=2, cpu="cpu", torch="t", torch_threads=1, commit="c", load_avg_1m=1.0)


def test_bandwidth_is_bytes_per_token_times_rate():
    assert qd.bandwidth(250_000_000, 4.0) == 1e9
    with pytest.raises(ValueError, match="tok/s"):
        qd.bandwidth(1, float("nan"))


def _tiny():
    from logitlab.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(qd.model_config("tiny")).to(torch.bfloat16).eval()


def test_a_model_reads_every_matrix_and_one_embedding_row():
    model, c = _tiny(), qd.model_config("tiny")
    D, F, V, L, Dh = c.d_model, c.d_ff, c.vocab_size, c.n_layers, c.head_dim
    qkv = (c.n_heads + 2 * c.n_kv_heads) * Dh * D
    per_layer = qkv + c.n_heads * Dh * D + 3 * D * F + 2 * D           # projections, MLP, two norms
    expected = 2 * (L * per_layer + D + V * D + D)                      # + final norm, head, one row
    assert qd.read_bytes_per_token(model, model.tok_emb.weight) == expected


def test_a_quantized_model_reads_its_integers_and_scales():
    from logitlab.quant.apply import quantize_model
    from logitlab.quant.linear import QuantConfig

    model = _tiny()
    dense = qd.read_bytes_per_token(model, model.tok_emb.weight)
    quantize_model(model, QuantConfig("int8"))
    rows = sum(m.out_features for m in model.modules() if hasattr(m, "qweight"))
    weights = sum(m.qweight.numel() for m in model.modules() if hasattr(m, "qweight"))
    # each bf16 weight (2 bytes) became one int8 byte, and each output row gained a bf16 scale
    assert qd.read_bytes_per_token(model, model.tok_emb.weight) == dense - weights + 2 * rows


def test_gguf_bytes_count_blocks_of_32(tmp_path):
    pytest.importorskip("gguf")
    from logitlab.quant.gguf import save_gguf

    model, c = _tiny(), qd.model_config("tiny")
    D, F, V, L, Dh = c.d_model, c.d_ff, c.vocab_size, c.n_layers, c.head_dim
    q8 = lambda n: n // 32 * 34                                          # noqa: E731  32 int8 + an f16 scale
    matrices = L * ((c.n_heads + 2 * c.n_kv_heads) * Dh * D + c.n_heads * Dh * D + 3 * D * F) + V * D
    norms = 4 * (2 * L * D + D)                                          # float32
    path = save_gguf(model, tmp_path / "m.gguf", "Q8_0")
    assert qd.gguf_bytes_per_token(path) == q8(matrices) + norms + q8(D)


def test_memory_bandwidth_is_measured():
    got = qd.measure_memory(gib=0.01, repeats=2)
    assert got["read"] > 1e8 and got["copy"] > 1e8


def test_sides_take_turns_after_an_unrecorded_warm_up():
    calls = []

    def side(name):
        def run(prompt, n):
            calls.append(name)
            return list(prompt[:1]) * n, 10.0 + len(calls)
        return {"run": run}
    engines = {"a": {p: side(f"a {p}") for p in qd.PRECISIONS}, "b": {"int8": side("b int8")}}
    got = qd.run_rounds(engines, [7, 8], 3, repeats=2, report=lambda line: None)
    assert calls[:4] == ["a bf16", "a int8", "b int8", "a int4"] and len(calls) == 12
    assert got["int8"]["b"]["tok_s"] == [17.0, 21.0] and got["int8"]["b"]["tokens"] == [7, 7, 7]
    assert "b" not in got["bf16"]


def test_ratios_and_agreement():
    assert qd.ratios([2.0, 3.0, 4.0], [1.0, 2.0, 2.0]) == {"median": 2.0, "min": 1.5, "max": 2.0}
    assert qd.agreement([1, 2, 3, 4], [1, 2, 5, 4]) == 2 and qd.agreement([1], [1, 2]) == 1


def test_table_reads_ratios_bandwidth_and_skipped_peers():
    row = lambda e, p, tok_s, **kw: dict(precision=p, engine=e, format=p, tok_s=[tok_s], median_tok_s=tok_s,  # noqa: E731
                                         bytes_per_token=int(5e8), bandwidth=5e8 * tok_s, read_share=5e8 * tok_s / 2e10,
                                         agree=3, **kw)
    rows = [row("logitlab", "int8", 20.0), row("llama.cpp", "int8", 25.0,
                                              logitlab_ratio={"median": 0.8, "min": 0.7, "max": 0.9})]
    text = qd.render(dict(command="python3 -m bench.quant_decode --no-doc", machine=MACHINE, cpu_flags=["avx2"],
                          shape="tiny", config=qd.SHAPES["tiny"], params=1e6, group_size=128, new_tokens=8, prompt=4,
                          repeats=1, threads=1, compile=False, clock="cpu", memory=dict(gib=1, read=2e10, copy=3e10),
                          missing={"gpt-fast": "no clone"}, llama_cpp="0.3", rows=rows))
    assert "| int8 | - | **0.80** (0.70-0.90) |" in text
    assert "| int8 | llama.cpp | int8 | 25.0 (25.0-25.0) | 500 | 12.5 | 62% | 3 of 8 |" in text
    assert "gpt-fast skipped: no clone" in text and "20.0 GB/s" in text and "process CPU time" in text


def test_held_out_texts_are_the_validation_documents(tmp_path):
    import json

    import numpy as np

    from bench.quant_quality import held_out_texts

    class Letters:                                   # ids 0..25 are letters, 99 ends a text
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)
    np.array([0, 1, 99, 2, 99, 3, 4, 5], dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "manifest.json").write_text(json.dumps({"dtype": "uint16", "eot_id": 99,
                                                        "splits": {"val": {"file": "val.bin"}}}))
    assert held_out_texts(tmp_path, Letters()) == ["ab", "c", "def"]


def test_prompts_take_windows_of_each_document_in_turn():
    from bench.quant_quality import prompt_set

    docs = [list(range(10)), list(range(100, 104)), list(range(200, 206))]
    assert prompt_set(docs, 4, 3) == [[0, 1, 2], [100, 101, 102], [200, 201, 202], [3, 4, 5]]
    with pytest.raises(ValueError, match="only 6 prompts of 3 tokens, 7 asked"):
        prompt_set(docs, 7, 3)


def test_token_differences_count_positions_and_first_divergence():
    from bench.quant_quality import token_differences

    got = token_differences([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 0, 0], [7, 8, 9]])
    assert got == {"tokens": 3, "of": 9, "continuations": 2, "first_median": 1.5}


def test_kl_windows_start_each_document_at_end_of_text_and_stop_at_the_limit():
    from bench.quant_quality import kl_windows

    docs = [list(range(1, 6)), [7], list(range(10, 20))]
    assert kl_windows(docs, 0, 4, 100) == [[0, 1, 2, 3], [4, 5], [0, 7], [0, 10, 11, 12], [13, 14, 15, 16],
                                           [17, 18, 19]]
    assert kl_windows(docs, 0, 4, 7) == [[0, 1, 2, 3], [4, 5], [0]]


def test_mean_kl_is_zero_for_the_same_distribution_and_exact_for_two_coins():
    import math

    from bench.quant_quality import mean_kl

    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1]]))
    assert mean_kl([p], [p]) == 0.0
    want = (0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)) / 2
    assert mean_kl([p], [q]) == pytest.approx(want, rel=1e-6)


def test_speculative_counts_acceptance_and_equal_output():
    from bench.speculative import row, run_set
    from logitlab.model.config import ModelConfig
    from logitlab.model.transformer import Transformer

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, context_length=64, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    model = Transformer(config).eval()
    ticks = iter(range(1000))
    out = run_set(model, {"n-gram": "ngram"}, [[1, 2, 3, 1, 2, 3, 1, 2]], 8, 2, clock=lambda: next(ticks))
    o = out["n-gram"]
    assert o["mismatches"] == 0 and o["plain_s"] == 1 and o["spec_s"] == 1 and o["decoded"] == 7
    assert 0 <= o["accepted"] <= o["drafted"] and o["passes"] >= 1
    assert row("code", "n-gram", o, 1)[:4] == ["code", "n-gram", "1", "**1.00**"]
