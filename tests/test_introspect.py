"""Tests for introspect.py: surprisal and perplexity (the worked example and a model pass),
next-token tables, the logit lens against the model's own logits, embedding neighbours."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from logitlab.generate.loop import SampleConfig
from logitlab.generate.sampling import process_logits
from logitlab.inspect.core import (
    embedding_neighbours,
    lens_logits,
    logit_lens,
    next_token_table,
    summarize,
    token_surprisals,
)
from logitlab.model.transformer import ModelConfig, Transformer


@pytest.fixture(scope="module", params=["gpt2-like", "llama-like"])
def model(request):
    torch.manual_seed(0)
    extra = {} if request.param == "gpt2-like" else dict(
        n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False)
    cfg = ModelConfig(vocab_size=61, context_length=32, d_model=32, n_layers=3, n_heads=4, init_std=0.2,
                      vocab_pad_multiple=64, **extra)
    return Transformer(cfg).eval()


TEXT = [3, 14, 15, 9, 26, 5, 35, 8]


def test_summarize_worked_example():
    total, mean, ppl = summarize([0.04, 0.01, 0.20, 0.30, 0.10])
    assert round(total, 2) == 12.94 and round(mean, 3) == 2.588 and round(ppl, 1) == 13.3
    with pytest.raises(ValueError, match="probabilities"):
        summarize([0.5, 0.0])


def test_token_surprisals_match_a_direct_computation(model):
    report = token_surprisals(model, TEXT, token_text=lambda i: f"<{i}>")
    assert report.tokens[0].probability is None and report.scored == len(TEXT) - 1
    with torch.no_grad():
        probs = model(torch.tensor([TEXT]))[0].softmax(-1)
    for t in range(1, len(TEXT)):
        row = report.tokens[t]
        p = probs[t - 1, TEXT[t]].item()
        assert row.id == TEXT[t] and row.text == f"<{TEXT[t]}>"
        assert abs(row.probability - p) < 1e-5
        assert abs(row.surprisal_nats + math.log(p)) < 1e-4
        assert abs(row.surprisal_bits - row.surprisal_nats / math.log(2)) < 1e-9
    total, mean, ppl = summarize([r.probability for r in report.tokens[1:]])
    assert abs(report.total_nats - total) < 1e-4 and abs(report.perplexity - ppl) < 1e-3
    assert abs(report.mean_bits * math.log(2) - report.mean_nats) < 1e-9


def test_next_token_table_before_and_after(model):
    table = next_token_table(model, TEXT, position=4, config=SampleConfig(top_k=3, temperature=0.5), k=5)
    assert table.position == 4 and len(table.before) == 5 and len(table.after) == 3 and table.kept == 3
    with torch.no_grad():
        p = model(torch.tensor([TEXT[:5]]))[0, -1].softmax(-1)
    top = torch.topk(p, 5)
    assert [c.id for c in table.before] == top.indices.tolist()
    assert torch.allclose(torch.tensor([c.probability for c in table.before]), top.values, atol=1e-5)
    # sharper after temperature 0.5 and renormalised over three tokens
    assert [c.id for c in table.after] == top.indices[:3].tolist()
    assert table.after[0].probability > table.before[0].probability
    assert abs(sum(c.probability for c in table.after) - 1) < 1e-5
    # every row: the raw logit, softmax(logits) and the sampler's distribution
    with torch.no_grad():
        logits = model(torch.tensor([TEXT[:5]]))[0, -1]
    sampler = process_logits(logits[None], SampleConfig(top_k=3, temperature=0.5))[0]
    for c in table.before + table.after:
        assert abs(c.logit - logits[c.id].item()) < 1e-4 and abs(c.model_probability - p[c.id].item()) < 1e-5
        assert abs(c.sampler_probability - sampler[c.id].item()) < 1e-5
    assert all(c.probability == c.model_probability for c in table.before)
    assert all(c.probability == c.sampler_probability for c in table.after)
    assert table.before[4].sampler_probability == 0  # cut by top-k 3
    with pytest.raises(ValueError, match="position 8"):
        next_token_table(model, TEXT, position=8)


def test_logit_lens_last_layer_equals_model_logits(model):
    lens = lens_logits(model, TEXT)  # (L+1, T, V)
    L, V = model.config.n_layers, model.config.vocab_size
    assert lens.shape == (L + 1, len(TEXT), V)
    with torch.no_grad():
        logits = model(torch.tensor([TEXT]))[0]
        assert torch.allclose(lens[-1], logits, atol=1e-5)
        # intermediate entries: block outputs through final norm + head, computed by hand
        h = model.tok_emb(torch.tensor([TEXT]))
        if model.pos_emb is not None:
            h = h + model.pos_emb(torch.arange(len(TEXT)))
        assert torch.allclose(lens[0], model.lm_head(model.final_norm(h))[0, :, :V], atol=1e-5)
    entries = logit_lens(model, TEXT, position=2, k=2)
    assert [e.layer for e in entries] == list(range(L + 1))
    p_last = logits[2].softmax(-1)
    assert entries[-1].top[0].id == int(p_last.argmax())
    assert abs(entries[-1].target_probability - p_last[TEXT[3]].item()) < 1e-5
    assert logit_lens(model, TEXT)[-1].target_probability is None


def test_embedding_neighbours_by_cosine(model):
    model = copy.deepcopy(model)  # the rows are edited below
    V = model.config.vocab_size
    with torch.no_grad():
        w = model.tok_emb.weight
        w[7] = 2.5 * w[3]          # same direction as token 3, other length: cosine 1
        w[11] = -w[3]              # opposite direction: cosine -1
    near = embedding_neighbours(model, 3, k=V - 1, token_text=str)
    assert near[0].id == 7 and abs(near[0].cosine - 1) < 1e-5 and near[0].text == "7"
    assert near[-1].id == 11 and abs(near[-1].cosine + 1) < 1e-5
    assert 3 not in [n.id for n in near] and max(n.id for n in near) < V  # no padded rows
    cos = torch.nn.functional.cosine_similarity(w[:V], w[5][None], dim=-1)
    cos[5] = -2
    assert [n.id for n in embedding_neighbours(model, 5, k=4)] == torch.topk(cos, 4).indices.tolist()
    with pytest.raises(ValueError, match="token id 61"):
        embedding_neighbours(model, 61)


def test_cli_inspect_json(tmp_path, capsys):
    import json

    from logitlab.cli.main import main
    from logitlab.io import checkpoint
    from tests.test_generate import small_tokenizer

    tok = small_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2,
                                    n_heads=4))
    d = tmp_path / "m"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    assert main(["inspect", str(d), "The cat sat", "--lens", "--neighbours", " cat",
                 "--top-k", "3", "--rows", "5", "--json", "--bos"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = [tok.eot_id] + tok.encode("The cat sat")
    assert out["ids"] == ids
    assert [r["id"] for r in out["surprisal"]["tokens"]] == ids and out["surprisal"]["scored"] == len(ids) - 1
    assert len(out["next"]["before"]) == 5 and len(out["next"]["after"]) == 3
    assert len(out["lens"]) == 3 and out["neighbours"]["id"] == tok.encode(" cat")[0]
    assert main(["inspect", str(d), "The cat", "--neighbours", "two tokens"]) == 2
    assert main(["inspect", str(d), "The cat", "--lens"]) == 0
    assert "logit lens" in capsys.readouterr().out


def test_k_must_be_a_positive_integer(model):
    for call in (lambda: next_token_table(model, TEXT, k=0), lambda: logit_lens(model, TEXT, k=-1),
                 lambda: embedding_neighbours(model, 3, k=-1)):
        with pytest.raises(ValueError, match=r"k \(how many candidates to list\) must be an integer >= 1"):
            call()


def test_non_finite_logits_are_refused_naming_the_position(model):
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.final_norm.weight[0] = float("nan")  # every position's logits are NaN
    for call, position in ((lambda: token_surprisals(bad, TEXT), 0), (lambda: lens_logits(bad, TEXT), 0),
                           (lambda: logit_lens(bad, TEXT), 0), (lambda: next_token_table(bad, TEXT, 4), 4)):
        with pytest.raises(RuntimeError, match=f"the model's logits at position {position} contain NaN or inf"):
            call()


def _checkpoint(tmp_path):
    from logitlab.io import checkpoint
    from tests.test_generate import small_tokenizer

    tok = small_tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2,
                                    n_heads=4))
    d = tmp_path / "m"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    return d, tok


@pytest.mark.parametrize("flags", [["--rows", "-1"], ["--rows", "0"], ["--rows", "two"], ["--top-k", "-1"],
                                   ["--temperature", "nan"], ["--temperature", "-1"], ["--top-p", "0"],
                                   ["--min-p", "1"]])
def test_cli_inspect_refuses_bad_numbers_naming_the_flag(flags, capsys):
    from logitlab.cli.main import main

    with pytest.raises(SystemExit) as exit:  # argparse: usage and the error, before loading anything
        main(["inspect", "not-loaded", "text"] + flags)
    assert exit.value.code == 2
    assert f"argument {flags[0]}: must be " in capsys.readouterr().err


def test_cli_inspect_ordinary(tmp_path, capsys):
    import json

    from logitlab.cli.main import main

    d, tok = _checkpoint(tmp_path)
    text = "The<|endoftext|>cat"
    for flags, ids in (([], tok.encode(text)), (["--ordinary"], tok.encode_ordinary(text))):
        assert main(["inspect", str(d), text, "--json"] + flags) == 0
        assert json.loads(capsys.readouterr().out)["ids"] == ids
    assert tok.eot_id in tok.encode(text) and tok.eot_id not in tok.encode_ordinary(text)


def test_cli_inspect_columns_first_token_line_and_titles(tmp_path, capsys, monkeypatch):
    import json

    from logitlab.cli.main import main

    d, tok = _checkpoint(tmp_path)
    assert main(["inspect", str(d), "The cat sat", "--top-k", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["next"]["before"][0]
    assert {"logit", "model_probability", "sampler_probability"} <= set(row)
    monkeypatch.setenv("COLUMNS", "60")  # narrow: titles are lines of their own, never wrapped into a table
    assert main(["inspect", str(d), "The cat sat", "--top-k", "2", "--lens"]) == 0
    out = capsys.readouterr().out
    for column in ("logit", "model: softmax(logits)", "sampler: what is drawn from"):
        assert column in out
    assert "next token after position 7, ranked by the model (sampler: temperature=1.0 top-k=2" in \
        " ".join(out.split())
    assert "token 0 is not scored" in out and "--bos" in out
    assert main(["inspect", str(d), "The cat", "--bos"]) == 0
    assert "added by --bos" in capsys.readouterr().out


def test_cli_inspect_text_escapes(tmp_path, capsys):
    import json

    from logitlab.cli.main import main

    d, tok = _checkpoint(tmp_path)
    assert main(["inspect", str(d), r"a\nb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == tok.encode("a\nb")
