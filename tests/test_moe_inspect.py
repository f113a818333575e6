"""A mixture of experts seen from outside: inspect.expert_routing and `logitlab inspect --experts`,
and a model directory that saves and loads its experts, router and correction bias."""

from __future__ import annotations

import json
import math

import pytest
import torch

from logitlab.inspect.experts import expert_routing
from logitlab.model import ModelConfig, Transformer

BASE = dict(context_length=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, norm="rmsnorm", mlp="swiglu",
            positions="rope", bias=False, n_experts=6, n_experts_per_token=2, moe_d_ff=16, d_ff=24)


def _model(vocab_size=61, **changes):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=vocab_size, **{**BASE, **changes})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5)
    return model


def test_routing_per_layer_is_the_routers_choice_heaviest_first():
    model = _model(mlp_types=("moe", "dense", "moe"))
    ids = [3, 14, 15, 9, 26, 5, 35]
    routing = expert_routing(model, ids)
    assert [r.layer for r in routing] == [0, 2]
    records = []
    with torch.no_grad():
        model(torch.tensor([ids]), records=records)
    for r, rec in zip(routing, records):
        assert len(r.experts) == len(ids) and all(len(set(e)) == 2 for e in r.experts)
        for t in range(len(ids)):
            assert set(r.experts[t]) == set(rec["experts"][t].tolist())
            assert r.weights[t] == sorted(r.weights[t], reverse=True)
            assert sum(r.weights[t]) == pytest.approx(1.0, abs=1e-6)           # renormalised top-k
        assert sum(r.load) == len(ids) * 2 and len(r.load) == 6
        assert all(0 <= h <= math.log(6) + 1e-6 for h in r.entropy) and r.dropped == 0.0
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        expert_routing(Transformer(ModelConfig(vocab_size=61, context_length=16, d_model=16, n_layers=1,
                                               n_heads=2)), ids)


def test_capacity_drops_show_in_the_routing():
    routing = expert_routing(_model(capacity_factor=0.5), list(range(1, 17)))
    assert all(0 < r.dropped < 1 for r in routing)


def test_model_directory_keeps_experts_router_and_correction_bias(tmp_path):
    from logitlab.io import checkpoint

    model = _model(router="sigmoid_topk", router_bias=True, expert_bias=True, shared_expert_d_ff=8,
                   shared_expert_gate=True)
    with torch.no_grad():
        model.blocks[1].mlp.router.correction_bias.normal_()
    checkpoint.save_model(model, tmp_path / "m")
    again = checkpoint.load_model(tmp_path / "m")
    assert again.config == model.config
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)


def test_inspect_command_shows_experts_and_load(tmp_path, capsys):
    from logitlab.cli.main import main
    from logitlab.io import checkpoint
    from tests.test_generate import small_tokenizer

    tok = small_tokenizer()
    model = _model(vocab_size=tok.vocab_size)
    checkpoint.save_model(model, tmp_path / "m")
    tok.save(tmp_path / "m" / checkpoint.TOKENIZER_FILE)
    assert main(["inspect", "--checkpoint", str(tmp_path / "m"), "The cat sat", "--experts", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    T = len(tok.encode("The cat sat"))
    assert [r["layer"] for r in out["experts"]] == [0, 1, 2] and len(out["experts"][0]["experts"]) == T
    assert main(["inspect", "--checkpoint", str(tmp_path / "m"), "The cat sat", "--experts"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "MoE layer 2: each token's experts, heaviest first" in text
    assert f"layer 0 load over the text ({2 * T} assignments, {2 * T / 6:.1f} per expert if balanced)" in text


def test_the_explorer_json_carries_each_tokens_experts_per_moe_layer():
    """POST /v1/explore on an MoE model: per MoE layer each token's experts and weights and each
    expert's load, as inspect.expert_routing gives them; a dense model's report has no "experts"."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from logitlab.serve.app import create_app
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens={"<|endoftext|>": 256})
    model = _model(vocab_size=tok.vocab_size, mlp_types=("moe", "dense", "moe"))
    text = "the cat sat"
    with TestClient(create_app(model, tok, name="moe")) as client:
        r = client.post("/v1/explore", json={"text": text})
    assert r.status_code == 200, r.text
    shown = r.json()["experts"]
    want = expert_routing(model, tok.encode(text))
    assert [e["layer"] for e in shown] == [w.layer for w in want] == [0, 2]
    for e, w in zip(shown, want):
        assert e["experts"] == w.experts and e["load"] == w.load and sum(e["load"]) == 2 * len(tok.encode(text))
        assert sum(e["weights"], []) == pytest.approx(sum(w.weights, []), abs=1e-4)
    dense_config = {**BASE, "n_experts": 0, "n_experts_per_token": None, "moe_d_ff": None}
    dense = Transformer(ModelConfig(vocab_size=tok.vocab_size, **dense_config)).eval()
    with TestClient(create_app(dense, tok, name="dense")) as client:
        assert "experts" not in client.post("/v1/explore", json={"text": text}).json()
