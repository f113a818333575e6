"""A run trained with the speedrun recipe (value embeddings, ReLU², QK-norm, soft-capped logits) through
the commands that load it: `serve` answers completions and chat with `generate`'s greedy tokens and
the model's own log-probabilities, on both engines; the lm-eval adapter's log-likelihoods are the
model's own; `export` refuses it in one line, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_cli_train import TEXT, _train_args

from logitlab import cli

PROMPT = "def function_1(x):\n"
TOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Two steps of the recipe on a two-layer model (value embeddings on layer 1, none on layer 0)."""
    root = tmp_path_factory.mktemp("speedrun")
    (root / "code.txt").write_text(TEXT)
    out = root / "run"
    assert cli.main(_train_args(root, "--recipe", "speedrun", "--steps", "2", "--n-layers", "2",
                                "--context-length", "64", "--out-dir", str(out))) == 0
    return out


@pytest.fixture(scope="module")
def loaded(run):
    from logitlab.io.checkpoint import load_for_inference

    model, tok = load_for_inference(run)
    assert model.config.value_embedding_layers == (1,) and model.config.logit_softcap == 15.0
    return model, tok


def _logprobs(model, ids: list[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= start, from one full forward in float64 (no cache, no engine)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)       # (T, V)
    return [float(lp[t - 1, ids[t]]) for t in range(start, len(ids))]


def test_the_checks_below_can_fail_the_value_embeddings_move_the_log_probs(loaded):
    """A server or adapter that dropped the value embeddings would be off by far more than TOL."""
    model, tok = loaded
    ids = tok.encode(PROMPT + "    return x * 1 + 1\n")
    with_ve = _logprobs(model, ids, 1)
    table = model.value_embeds["1"].embed.weight
    saved = table.detach().clone()
    with torch.no_grad():
        table.zero_()
    try:
        without = _logprobs(model, ids, 1)
    finally:
        with torch.no_grad():
            table.copy_(saved)
    assert max(abs(a - b) for a, b in zip(with_ve, without)) > 100 * TOL


def _generate_cli(run, prompt: str, n: int, capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["generate", str(run), prompt, "--max-new-tokens", str(n), "--temperature", "0", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("engine", ["paged", "contiguous"])
def test_serve_answers_with_generates_greedy_tokens_and_the_models_log_probs(run, loaded, engine, capsys):
    from starlette.testclient import TestClient

    from logitlab.cli.main import build_parser
    from logitlab.cli.serve import build_app
    from logitlab.generate import SampleConfig, generate
    from logitlab.serve.protocol import chat_prompt

    model, tok = loaded
    want = _generate_cli(run, PROMPT, 8, capsys)
    messages = [{"role": "user", "content": "hi"}]
    chat_ids, stops, _ = chat_prompt(tok, messages)             # no chat template: ChatML as plain text
    chat_new = generate(model, chat_ids, SampleConfig(max_new_tokens=4, temperature=0), eot_id=tok.eot_id).tokens[0]
    app = build_app(build_parser().parse_args(["serve", str(run), "--port", "0", "--engine", engine]))
    with TestClient(app) as client:
        done = client.post("/v1/completions", json=dict(model="run", prompt=PROMPT, max_tokens=8, temperature=0,
                                                         logprobs=1)).json()["choices"][0]
        chat = client.post("/v1/chat/completions", json=dict(model="run", messages=messages, max_tokens=4,
                                                              temperature=0, logprobs=True)).json()["choices"][0]
    assert done["text"] == want["text"] and len(done["logprobs"]["token_logprobs"]) == len(want["ids"])
    expected = _logprobs(model, want["prompt_ids"] + want["ids"], len(want["prompt_ids"]))
    assert done["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=TOL)
    assert stops == ["<|im_end|>"] and chat["message"]["content"] == tok.decode(chat_new)
    assert [c["logprob"] for c in chat["logprobs"]["content"]] == pytest.approx(
        _logprobs(model, chat_ids + chat_new, len(chat_ids)), abs=TOL)


def test_the_lm_eval_adapter_scores_with_the_models_own_log_probs(run, loaded):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from logitlab.cli.eval import register_harness_model

    model, tok = loaded
    lm = register_harness_model().create_from_arg_string(f"path={run},batch_size=2", {"device": "cpu"})
    pairs = [("def function_1(x):", "\n    return x"), ("import", " os"), ("def f", "(x):")]
    got = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
                            for i, pair in enumerate(pairs)])
    for (context, continuation), (logprob, _) in zip(pairs, got):
        ctx, whole = tok.encode(context), tok.encode(context + continuation)
        assert whole[:len(ctx)] == ctx                                           # no merge across the cut
        assert logprob == pytest.approx(sum(_logprobs(model, whole, len(ctx))), abs=TOL)
    doc = PROMPT + "    return x * 1 + 1\n"
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(doc,), idx=0)
    rolling = lm.loglikelihood_rolling([request])[0]
    assert rolling == pytest.approx(sum(_logprobs(model, [tok.eot_id] + tok.encode(doc), 1)), abs=TOL)


def test_export_refuses_the_recipes_model_in_one_line_before_writing_anything(run, loaded, tmp_path, capsys):
    from logitlab.io.hf import export_hf, save_pretrained

    out = tmp_path / "new" / "hf"
    capsys.readouterr()
    assert cli.main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot export")
    for part in (str(run), "value embeddings (value_embeddings='alternate')", "ReLU² MLPs (mlp='relu2')",
                 "soft-capped logits (logit_softcap=15.0)", "`logitlab train --recipe none`",
                 "`logitlab demo --recipe none`", f"keep using {run} as it is"):
        assert part in err, part
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match=f"cannot export {run} to Hugging Face: its model has value embeddings"):
        export_hf(run, out)
    model, tok = loaded
    with pytest.raises(ValueError, match="cannot export this model .* logitlab.save_model"):
        save_pretrained(model, out, tok)
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == []
