"""Serving: the batching engine driven step by step (requests that join a running batch and leave
it, each equal to its solo generation), the OpenAI-compatible routes through starlette's TestClient
(completions, chat, streaming, logprobs, stop strings, every 4xx), and two concurrent HTTP
requests decoded in one batch. Tiny random models, a hand-made tokenizer."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from logitlab.generate import SampleConfig, generate, process_logits  # noqa: E402
from logitlab.model import ModelConfig, Transformer  # noqa: E402
from logitlab.serve.app import create_app  # noqa: E402
from logitlab.serve.engine import DoneEvent, Engine, TokenEvent  # noqa: E402
from logitlab.serve.protocol import TextStream  # noqa: E402
from logitlab.tokenizer.core import Tokenizer  # noqa: E402

EOT = "<|endoftext|>"


def tiny_tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"t", b"h"), (b"th", b"e"), (b" ", b"the"), (b"e", b"r"), (b" ", b"a")]
    for k, (a, b) in enumerate(merges):
        vocab[256 + k] = a + b
    return Tokenizer(vocab, merges, special_tokens={EOT: 256 + len(merges)})


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    return Transformer(cfg).eval()


class Collect:
    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    @property
    def tokens(self):
        return [e.token for e in self.events if isinstance(e, TokenEvent)]

    @property
    def done(self):
        return self.events[-1] if self.events and isinstance(self.events[-1], DoneEvent) else None


def _solo(model, prompt, config, eot=None):
    return generate(model, prompt, config, eot_id=eot).tokens[0]


# -------------------- the engine, step by step

def test_a_request_joins_a_running_batch_and_each_equals_its_solo_generation(model):
    e = Engine(model)
    greedy = SampleConfig(max_new_tokens=20, temperature=0)
    a, b, c = Collect(), Collect(), Collect()
    e.submit([1, 2, 3], greedy, a)
    for _ in range(3):
        e.step()
    assert len(a.tokens) == 3 and e.stats["max_rows"] == 1
    e.submit([5, 6, 7, 8, 9, 10, 11], SampleConfig(max_new_tokens=6, temperature=0), b)
    sampled = SampleConfig(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=7)
    e.submit([40, 41], sampled, c)
    e.step()  # both join at the next step: one prefill of the three rows
    assert len(a.tokens) == 4 and len(b.tokens) == 1 and len(c.tokens) == 1
    while e.step():
        pass
    assert a.tokens == _solo(model, [1, 2, 3], greedy)
    assert b.tokens == _solo(model, [5, 6, 7, 8, 9, 10, 11], SampleConfig(max_new_tokens=6, temperature=0))
    assert c.tokens == _solo(model, [40, 41], sampled)  # a seeded sample too: its own generator
    assert (a.done, b.done, c.done) == (DoneEvent("length"),) * 3
    assert e.stats["max_rows"] == 3 and e.stats["shared_steps"] >= 6
    assert e.running == 0 and e.waiting == 0 and not e.step()


def test_finished_rows_leave_and_the_context_limits_the_budget(model):
    e = Engine(model, eot_id=None)
    long_prompt = [4] * 60
    short, edge = Collect(), Collect()
    e.submit([1, 2], SampleConfig(max_new_tokens=2, temperature=0), short)
    e.submit(long_prompt, SampleConfig(max_new_tokens=30, temperature=0), edge)
    while e.step():
        pass
    assert len(short.tokens) == 2 and len(edge.tokens) == 4  # 60 + 4 = the context of 64
    assert edge.tokens == _solo(model, long_prompt, SampleConfig(max_new_tokens=4, temperature=0))
    assert edge.done == DoneEvent("length")
    with pytest.raises(ValueError, match="leaves no room"):
        e.submit([1] * 64, SampleConfig(), Collect())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.submit([9999], SampleConfig(), Collect())
    with pytest.raises(ValueError, match="no tokens"):
        e.submit([], SampleConfig(), Collect())


def test_stop_ids_stop_strings_and_log_probabilities(model, tok):
    solo = _solo(model, [1, 2, 3], SampleConfig(max_new_tokens=12, temperature=0))
    e = Engine(model, eot_id=solo[4], token_bytes=tok.token_bytes)
    stopped, bystring = Collect(), Collect()
    e.submit([1, 2, 3], SampleConfig(max_new_tokens=12, temperature=0), stopped, top_logprobs=3)
    stop = tok.token_bytes(solo[2])[-1:]
    e.submit([1, 2, 3], SampleConfig(max_new_tokens=12, temperature=0, stop_bytes=(stop,)), bystring)
    while e.step():
        pass
    assert stopped.tokens == solo[:solo.index(solo[4]) + 1] and stopped.done == DoneEvent("stop")
    first_hit = next(k for k, t in enumerate(solo) if stop in tok.token_bytes(t))
    assert bystring.tokens == solo[:first_hit + 1] and bystring.done == DoneEvent("stop")
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([[1, 2, 3]]))[0, -1].float(), -1)
    first = stopped.events[0]
    assert first.logprob == pytest.approx(float(lp[first.token]), abs=1e-5)
    assert [i for i, _ in first.top] == lp.topk(3).indices.tolist()


def test_cancelled_requests_free_their_rows_and_a_nan_model_is_an_error_event(tok):
    torch.manual_seed(0)
    bad = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1, n_heads=2))
    e = Engine(bad)
    a, b = Collect(), Collect()
    ra = e.submit([1, 2], SampleConfig(max_new_tokens=20, temperature=0), a)
    e.submit([1, 2], SampleConfig(max_new_tokens=3, temperature=0), b)
    e.step()
    e.cancel(ra)
    e.step()
    assert a.done == DoneEvent("cancelled") and e.running == 1
    with torch.no_grad():
        bad.final_norm.weight.fill_(float("nan"))
    while e.step():
        pass
    assert b.done.finish_reason == "error" and "NaN" in b.done.error


def test_text_stream_holds_back_a_possible_stop_and_splits_no_character(tok):
    ids = tok.encode("the café ends here")
    stream = TextStream(tok, stops=["ends"], hidden=[tok.eot_id])
    pieces = [stream.feed(i) for i in ids + [tok.eot_id]] + [stream.finish()]
    assert "".join(pieces) == "the café " and stream.done
    assert all("\ufffd" not in p for p in pieces)
    free = TextStream(tok, stops=["zzz"])
    assert "".join([free.feed(i) for i in tok.encode("the z")] + [free.finish()]) == "the z"


# -------------------- HTTP

@pytest.fixture()
def client(model, tok):
    app = create_app(model, tok, name="tiny", max_batch=8, max_body_bytes=4096)
    with TestClient(app) as c:
        yield c


def _greedy_text(model, tok, prompt: str, n: int) -> tuple[str, list[int]]:
    ids = _solo(model, tok.encode(prompt), SampleConfig(max_new_tokens=n, temperature=0), tok.eot_id)
    return tok.decode([i for i in ids if i != tok.eot_id]), ids


def test_health_models_and_a_completion_equal_to_generate(client, model, tok):
    assert client.get("/health").json()["status"] == "ok"
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["tiny"]
    r = client.post("/v1/completions", json=dict(model="tiny", prompt="the other", max_tokens=8, temperature=0,
                                                  logprobs=2))
    assert r.status_code == 200, r.text
    body = r.json()
    text, ids = _greedy_text(model, tok, "the other", 8)
    choice = body["choices"][0]
    assert choice["text"] == text and body["usage"]["completion_tokens"] == len(ids)
    assert body["usage"]["prompt_tokens"] == len(tok.encode("the other"))
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) and all(len(t) == 2 for t in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert choice["finish_reason"] in ("length", "stop")


def _sse(response) -> list:
    events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_completion_and_chat_give_the_same_text_as_without(client):
    req = dict(model="tiny", prompt="the", max_tokens=10, temperature=0)
    whole = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    chunks = _sse(client.post("/v1/completions", json={**req, "stream": True,
                                                       "stream_options": {"include_usage": True}}))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("length", "stop")
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=2)
    reply = client.post("/v1/chat/completions", json=chat).json()
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and reply["object"] == "chat.completion"
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in content)
    chunks = _sse(client.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]


def test_stop_strings_cut_the_text(client, model, tok):
    text, _ = _greedy_text(model, tok, "the", 12)
    stop = text[3:5]
    assert stop
    r = client.post("/v1/completions", json=dict(model="tiny", prompt="the", max_tokens=12, temperature=0,
                                                 stop=[stop])).json()
    assert r["choices"][0]["text"] == text[:text.find(stop)] and r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, status, param", [
    (dict(model="other", prompt="a"), 404, "model"),
    (dict(prompt="a"), 400, "model"),
    (dict(model="tiny", prompt="a", max_tokens=-1), 400, "max_tokens"),
    (dict(model="tiny", prompt="a", temperature="hot"), 400, "temperature"),
    (dict(model="tiny", prompt="a", top_p=0), 400, "top_p"),
    (dict(model="tiny", prompt="a", logit_bias={"x": 1}), 400, "logit_bias"),
    (dict(model="tiny", prompt="a", logprobs=99), 400, "logprobs"),
    (dict(model="tiny", prompt="the " * 70), 400, "prompt"),
    (dict(model="tiny", prompt=[1, 99999]), 400, "prompt"),
    (dict(model="tiny", prompt=3), 400, "prompt"),
    (dict(model="tiny", prompt="a", stop=[1]), 400, "stop"),
    (dict(model="tiny", prompt="a", stream="yes"), 400, "stream"),
])
def test_bad_completion_requests_name_the_field(client, body, status, param):
    r = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_bad_bodies_and_chat_messages(client):
    for raw in (b"{not json", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', b"[1, 2]", b"\xff"):
        r = client.post("/v1/completions", content=raw)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a", "temperature": 1e400}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"  # overflows to inf
    r = client.post("/v1/completions", content=json.dumps(dict(model="tiny", prompt="a" * 5000)))
    assert r.status_code == 413
    for messages in ([], [{"role": "user"}], "hi", [{"content": "x"}]):
        r = client.post("/v1/chat/completions", json=dict(model="tiny", messages=messages))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", json=dict(model="tiny", messages=[{"role": "user", "content": "a"}],
                                                      max_completion_tokens=0))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert client.get("/health").json()["status"] == "ok"  # nothing brought it down


def test_two_concurrent_requests_are_decoded_in_one_batch(client, model, tok):
    engine = client.app.state.served.engine
    engine.set_paused(True)
    prompts = {"the other": 9, "a rather long prompt here": 5}
    results = {}

    def ask(prompt, n):
        r = client.post("/v1/completions", json=dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0))
        results[prompt] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=item) for item in prompts.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while engine.waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.waiting == 2
    before = dict(engine.stats)
    engine.set_paused(False)
    for t in threads:
        t.join(timeout=60)
    for prompt, n in prompts.items():
        assert results[prompt] == _greedy_text(model, tok, prompt, n)[0]
    # the paged engine (the app's default): both prompts read in one step, nobody prefilled again
    assert engine.stats["prefill_chunks"] - before["prefill_chunks"] == 2 and engine.stats["tokens_recomputed"] == 0
    assert engine.stats["max_rows"] == 2 and engine.stats["shared_steps"] - before["shared_steps"] >= 5


def test_explorer_page_and_its_json(client, model, tok):
    page = client.get("/")
    assert page.status_code == 200 and "<svg" in page.text
    assert "src=\"http" not in page.text and "href=\"http" not in page.text  # no external assets
    r = client.post("/v1/explore", json=dict(text="the other", top_k=5)).json()
    ids = tok.encode("the other")
    assert r["ids"] == ids and len(r["top"]) == len(ids) and len(r["top"][0]) == 5
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    assert [c["id"] for c in r["top"][-1]] == logits[-1].topk(5).indices.tolist()
    assert r["surprisal"]["tokens"][1]["probability"] == pytest.approx(
        float(torch.softmax(logits[0], -1)[ids[1]]), rel=1e-4)
    hot = client.post("/v1/explore/next", json=dict(text="the other", position=-1, temperature=2.0, top_k=3)).json()
    assert hot["kept"] == 3 and hot["settings"]["temperature"] == 2.0
    want = process_logits(logits[-1:].float(), SampleConfig(temperature=2.0, top_k=3))[0]
    shown = hot["after"]
    assert [c["sampler_probability"] for c in shown] == pytest.approx(want[[c["id"] for c in shown]].tolist())
    assert math.isclose(sum(c["sampler_probability"] for c in hot["after"]), 1.0, rel_tol=1e-5)
    flat = client.post("/v1/explore/next", json=dict(text="the other", temperature=3.0)).json()
    sharp = client.post("/v1/explore/next", json=dict(text="the other", temperature=0.3)).json()
    assert flat["after"][0]["sampler_probability"] < sharp["after"][0]["sampler_probability"]
    bad = client.post("/v1/explore/next", json=dict(text="the", position=7))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "position"


def test_explorer_attribution_and_patching_json(client, model, tok):
    from logitlab.inspect.attribution import direct_logit_attribution
    from logitlab.inspect.patching import activation_patching, logit_difference

    ids = tok.encode("the other")
    r = client.post("/v1/explore/attribution", json=dict(text="the other", position=1, token=5)).json()
    want = direct_logit_attribution(model, ids, 5, None, 1)
    assert r["parts"] == pytest.approx(want.parts, abs=1e-6) and r["logit"] == pytest.approx(want.logit, abs=1e-6)
    top = client.post("/v1/explore/attribution", json=dict(text="the other")).json()
    with torch.no_grad():
        assert top["token"] == int(model(torch.tensor([ids]))[0, -1].argmax())
    text = next(t for t in ("the ather", "the xther", "the othes", "xhe other") if len(tok.encode(t)) == len(ids))
    corrupt = tok.encode(text)
    p = client.post("/v1/explore/patch", json=dict(text="the other", corrupt=text, token="a", other="b")).json()
    expected = activation_patching(model, ids, corrupt, logit_difference(*tok.encode("a"), *tok.encode("b")))
    assert torch.tensor(p["scores"]).double().sub(expected.scores).abs().max() < 1e-3
    bad = client.post("/v1/explore/patch", json=dict(text="the other", corrupt=text, token="ab", other="b"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token"
    short = client.post("/v1/explore/patch", json=dict(text="the other", corrupt="the", token="a", other="b"))
    assert short.status_code == 400 and "same number of tokens" in short.json()["error"]["message"]


def test_cli_serve_builds_the_app_from_a_model_directory(tmp_path, capsys, model, tok):
    from logitlab.cli.main import build_parser, main
    from logitlab.cli.serve import build_app
    from logitlab.io import checkpoint

    d = tmp_path / "my-model"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    app = build_app(build_parser().parse_args(["serve", str(d), "--port", "0", "--max-batch", "3"]))
    served = app.state.served
    assert served.name == "my-model" and served.engine.max_batch == 3 and served.end_ids == (tok.eot_id,)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json=dict(model="my-model", prompt="the", max_tokens=4, temperature=0))
        assert r.json()["choices"][0]["text"] == _greedy_text(model, tok, "the", 4)[0]
    assert main(["serve", str(d), "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_a_request_takes_a_finished_rows_slot_without_a_rebuild(model):
    e = Engine(model)
    long_cfg, short_cfg = SampleConfig(max_new_tokens=24, temperature=0), SampleConfig(max_new_tokens=2, temperature=0)
    a, b, c, d = Collect(), Collect(), Collect(), Collect()
    e.submit([1, 2, 3, 4, 5, 6], long_cfg, a)
    e.submit([7, 8], short_cfg, b)
    for _ in range(4):
        e.step()                                    # b finished after two tokens: its slot is free
    assert b.done == DoneEvent("length") and e.stats["rebuilds"] == 1
    e.submit([9, 10, 11], SampleConfig(max_new_tokens=8, temperature=0.7, seed=3), c)
    e.step()
    assert e.stats["inserts"] == 1 and e.stats["rebuilds"] == 1 and len(c.tokens) == 1
    e.submit(list(range(20, 40)), long_cfg, d)       # longer than the rows so far: a rebuild
    while e.step():
        pass
    assert e.stats["rebuilds"] == 2
    assert a.tokens == _solo(model, [1, 2, 3, 4, 5, 6], long_cfg)
    assert c.tokens == _solo(model, [9, 10, 11], SampleConfig(max_new_tokens=8, temperature=0.7, seed=3))
    assert d.tokens == _solo(model, list(range(20, 40)), long_cfg)


def test_explorer_lens_attention_and_neighbours(client, model, tok):
    from logitlab.inspect import core as inspect_core

    ids = tok.encode("the other")
    r = client.post("/v1/explore", json=dict(text="the other")).json()
    lens = inspect_core.lens_logits(model, ids)                                  # (L+1, T, V)
    assert len(r["lens"]) == model.config.n_layers + 1 and len(r["lens"][0]) == len(ids)
    assert [c["id"] for c in r["lens"][-1]] == lens[-1].argmax(-1).tolist()
    attention = r["attention"]
    assert len(attention) == model.config.n_layers and len(attention[0]) == model.config.n_heads
    for row in attention[0][0]:
        assert sum(row) == pytest.approx(1.0, abs=1e-3)
    assert attention[0][0][0][1:] == [0.0] * (len(ids) - 1)                      # causal
    n = client.post("/v1/explore/neighbours", json=dict(id=ids[0], k=4)).json()
    want = inspect_core.embedding_neighbours(model, ids[0], 4)
    assert [x["id"] for x in n["nearest"]] == [w.id for w in want]
    assert client.post("/v1/explore/neighbours", json=dict(id=10**6)).status_code == 400
    assert client.post("/v1/explore", json=dict(text="")).json()["error"]["param"] == "text"
