"""The server on a real socket: uvicorn on a loopback port, driven by the official `openai` client
(completions, chat, streaming, logprobs, errors, an API key right, wrong and missing) and by raw
clients: one that hangs up early, whose request must then leave the batch, slow ones that never
finish their headers (/health still answers), paths that climb out of the root (404), and 50 at
once, each answered as if alone. Skips without openai or uvicorn."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from logitlab.generate import SampleConfig, generate  # noqa: E402
from logitlab.model import ModelConfig, Transformer  # noqa: E402
from logitlab.serve.app import create_app  # noqa: E402
from logitlab.tokenizer.core import Tokenizer  # noqa: E402


def _tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"t", b"h"), (b"th", b"e"), (b" ", b"the"), (b"e", b"r"), (b" ", b"a")]
    for k, (a, b) in enumerate(merges):
        vocab[256 + k] = a + b
    return Tokenizer(vocab, merges, special_tokens={"<|endoftext|>": 256 + len(merges)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEY = "sk-logitlab-test"


def _serve(api_key: str | None = None):
    """(uvicorn server, thread, model, tokenizer, app, port) for a tiny model on a loopback port."""
    tok = _tokenizer()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=128, d_model=32, n_layers=2,
                                    n_heads=4, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)).eval()
    app = create_app(model, tok, name="tiny", api_key=api_key)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "uvicorn did not start"
    return srv, thread, model, tok, app, port


@pytest.fixture(scope="module")
def server():
    srv, thread, model, tok, app, port = _serve()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    yield dict(client=client, model=model, tok=tok, app=app, url=f"http://127.0.0.1:{port}", port=port)
    srv.should_exit = True
    thread.join(timeout=10)


def _greedy(model, tok, prompt: str, n: int) -> str:
    config = SampleConfig(max_new_tokens=n, temperature=0)
    ids = generate(model, tok.encode(prompt), config, eot_id=tok.eot_id).tokens[0]
    return tok.decode([i for i in ids if i != tok.eot_id])


def test_openai_client_completions_streaming_and_logprobs(server):
    client, model, tok = server["client"], server["model"], server["tok"]
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="the other", max_tokens=8, temperature=0, logprobs=3)
    assert done.choices[0].text == _greedy(model, tok, "the other", 8)
    assert len(done.choices[0].logprobs.token_logprobs) == done.usage.completion_tokens
    assert all(len(top) == 3 for top in done.choices[0].logprobs.top_logprobs)
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="the other", max_tokens=8,
                                                                    temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == done.choices[0].text and len(pieces) > 1


def test_openai_client_chat_streaming_and_errors(server):
    client = server["client"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"
    assert len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="a", max_tokens=-3)


def test_a_client_that_hangs_up_frees_its_row(server):
    engine = server["app"].state.served.engine
    before = engine.stats["cancelled"]
    engine.set_paused(True)  # the request waits in the queue while the client hangs up
    try:
        body = dict(model="tiny", prompt="the", max_tokens=100, temperature=0, stream=True)
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", server["url"] + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                deadline = time.monotonic() + 30
                while engine.waiting == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert engine.waiting == 1
        deadline = time.monotonic() + 30
        while not any(q.cancelled for q in engine._inbox) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.set_paused(False)
    deadline = time.monotonic() + 30
    while (engine.running or engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats["cancelled"] == before + 1 and engine.running == 0
    health = httpx.get(server["url"] + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0


def test_the_openai_client_with_the_right_key_a_wrong_key_and_none():
    srv, thread, model, tok, app, port = _serve(api_key=KEY)
    try:
        url = f"http://127.0.0.1:{port}"
        right = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in right.models.list().data] == ["tiny"]
        done = right.completions.create(model="tiny", prompt="the other", max_tokens=5, temperature=0)
        assert done.choices[0].text == _greedy(model, tok, "the other", 5)
        wrong = openai.OpenAI(base_url=url + "/v1", api_key=KEY + "-not", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError, match="provide an API key"):  # the client sends no header
            right.models.list(extra_headers={"Authorization": openai.Omit()})
        bare = httpx.get(url + "/v1/models")
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(url + "/health").json()["status"] == "ok" and httpx.get(url + "/").status_code == 200
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def _raw_get(port: int, path: str) -> int:
    """The status of GET `path` sent exactly as written (no client normalises it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        head = s.recv(4096).decode("latin-1")
    return int(head.split(" ", 2)[1])


def test_paths_that_climb_out_of_the_root_are_404(server):
    for path in ("/../../../etc/passwd", "/static/../app.py", "/%2e%2e/%2e%2e/etc/passwd", "/..%2f..%2fapp.py",
                 "/static/explorer.html", "//etc/passwd"):
        assert _raw_get(server["port"], path) == 404, path
    assert _raw_get(server["port"], "/") == 200


def test_slow_clients_that_never_finish_their_headers_leave_health_answering(server):
    slow = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", server["port"]), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # and never the rest
            slow.append(s)
        for _ in range(3):
            assert httpx.get(server["url"] + "/health", timeout=30).json()["status"] == "ok"
    finally:
        for s in slow:
            s.close()


def test_fifty_concurrent_clients_each_get_their_answer_alone(server):
    client, model, tok = server["client"], server["model"], server["tok"]
    prompts = [f"the {'other ' * (i % 5)}{i}" for i in range(50)]
    answers: dict[int, str] = {}

    def ask(i):
        answers[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=4, temperature=0
                                               ).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(answers) == 50
    assert all(answers[i] == _greedy(model, tok, prompts[i], 4) for i in range(50))
