"""The server under abuse, through starlette's TestClient: a body nested 200,000 deep, a top_p that
float32 rounds to zero, stop strings past their byte bound, chat templates that fail or run past
their bounds (an error for that request only), the API key on every route but /health and the
explorer page, and `logitlab serve`'s --api-key, LOGITLAB_API_KEY and its warning. json_depth
against a parser's depth on random JSON (hypothesis)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
pytest.importorskip("httpx")
pytest.importorskip("jinja2")

from starlette.testclient import TestClient  # noqa: E402

from logitlab.generate import SampleConfig, generate  # noqa: E402
from logitlab.model import ModelConfig, Transformer  # noqa: E402
from logitlab.serve.app import create_app  # noqa: E402
from logitlab.serve.protocol import MAX_JSON_DEPTH, MAX_STOP_BYTES, json_depth  # noqa: E402
from logitlab.tokenizer.core import Tokenizer  # noqa: E402

KEY = "sk-test-0123456789"


def tiny_tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    specials = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    return Tokenizer(vocab, [], special_tokens=specials)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2, n_heads=4,
                      norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    return Transformer(cfg).eval()


@pytest.fixture()
def client(model, tok):
    with TestClient(create_app(model, tok, name="tiny")) as c:
        yield c


def _greedy(model, tok, prompt: str, n: int) -> str:
    ids = generate(model, tok.encode(prompt), SampleConfig(max_new_tokens=n, temperature=0), eot_id=tok.eot_id)
    return tok.decode([i for i in ids.tokens[0] if i != tok.eot_id])


# -------------------- bodies, sampling, stop strings

def test_a_body_nested_200000_deep_is_a_400_before_parsing(client):
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/explore"):
        r = client.post(path, content=deep)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == (f"the request body nests arrays and objects 200001 deep; "
                                                f"at most {MAX_JSON_DEPTH}")
    within = b'{"model": "tiny", "prompt": ' + b"[" * 40 + b"]" * 40 + b', "x": "[[[[{{"}'
    r = client.post("/v1/completions", content=within)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # parsed: the prompt is refused
    assert client.get("/health").json()["status"] == "ok"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ax\n', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\a', max_size=3), inner,
                                                                max_size=3),
    max_leaves=20)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=100, deadline=None)
@given(json_values, st.sampled_from([None, 2]), st.booleans())
def test_json_depth_equals_the_parsed_depth(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode()
    assert json_depth(text) == _depth(value)


def test_json_depth_of_malformed_text_does_not_backtrack():
    assert json_depth(b'"\\"\\"' * 200_000) == 0                       # one unterminated string
    assert json_depth(b'["abc\\') == 1 and json_depth(b"[[[") == 3 and json_depth(b"]]]") == 0


def test_a_top_p_that_float32_rounds_to_zero_is_served_as_the_top_token(client, model, tok):
    r = client.post("/v1/completions", json=dict(model="tiny", prompt="the", max_tokens=6, top_p=1e-300, seed=1))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _greedy(model, tok, "the", 6)


def test_stop_strings_are_bounded_in_bytes_and_a_long_one_still_cuts(client, model, tok):
    for stop in (["a" * (MAX_STOP_BYTES + 1)], ["é" * (MAX_STOP_BYTES // 4), "é" * (MAX_STOP_BYTES // 4 + 1)]):
        r = client.post("/v1/completions", json=dict(model="tiny", prompt="the", max_tokens=4, stop=stop))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert str(MAX_STOP_BYTES) in r.json()["error"]["message"]
    text = _greedy(model, tok, "the", 12)
    long_stop = text[2:5] + "\x00" * (MAX_STOP_BYTES - 16)       # never generated: the text runs to its end
    r = client.post("/v1/completions", json=dict(model="tiny", prompt="the", max_tokens=12, temperature=0,
                                                 stop=[long_stop, text[2:5]]))
    assert r.json()["choices"][0]["text"] == text[:text.find(text[2:5])]
    r = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a", "stop": "\\ud800"}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


# -------------------- chat templates

@pytest.mark.parametrize("template, status, words", [
    ("{{ raise_exception('conversation roles must alternate') }}", 400, "refused the conversation: conversation "
                                                                        "roles must alternate"),
    ("{{ 'x' * 3000000 }}", 500, "max_output_chars"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", 500, "max_call_depth"),
    ("{% include 'tokenizer_config.json' %}", 500, "{% include %} (line 1) is not allowed"),
    ("{{ messages[0].content + 1 }}", 500, "failed: TypeError"),
])
def test_a_failing_chat_template_is_an_error_for_that_request_only(model, template, status, words):
    tok = tiny_tokenizer()
    tok.chat_template = template
    with TestClient(create_app(model, tok, name="tiny")) as c:
        r = c.post("/v1/chat/completions", json=dict(model="tiny", messages=[{"role": "user", "content": "hi"}]))
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert "chat template (the tokenizer's chat_template)" in error["message"] and words in error["message"]
        assert error["type"] == ("invalid_request_error" if status == 400 else "server_error")
        assert error["param"] == ("messages" if status == 400 else None)
        assert c.get("/health").json()["status"] == "ok"
        done = c.post("/v1/completions", json=dict(model="tiny", prompt="the", max_tokens=3, temperature=0))
        assert done.status_code == 200 and done.json()["choices"][0]["text"] == _greedy(model, tok, "the", 3)


# -------------------- the API key

def test_the_api_key_guards_every_route_but_health_and_the_page(model, tok):
    with TestClient(create_app(model, tok, name="tiny", api_key=KEY)) as c:
        assert c.get("/health").status_code == 200 and c.get("/").status_code == 200
        right = {"Authorization": f"Bearer {KEY}"}
        for method, path, body in (("GET", "/v1/models", None),
                                   ("POST", "/v1/completions", dict(model="tiny", prompt="a", max_tokens=1)),
                                   ("POST", "/v1/chat/completions",
                                    dict(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=1)),
                                   ("POST", "/v1/explore", dict(text="the")),
                                   ("POST", "/v1/explore/next", dict(text="the")),
                                   ("POST", "/v1/explore/neighbours", dict(id=5))):
            none = c.request(method, path, json=body)
            assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
            error = none.json()["error"]
            assert none.json() == {"error": {"message": error["message"], "type": "invalid_request_error",
                                             "param": None, "code": None}}
            assert "Authorization: Bearer" in none.json()["error"]["message"]
            for wrong in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer ", f"Basic {KEY}", KEY):
                r = c.request(method, path, json=body, headers={"Authorization": wrong})
                assert r.status_code == 401, (path, wrong)
            assert c.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}x"}).json()[
                "error"]["code"] == "invalid_api_key"
            assert c.request(method, path, json=body, headers=right).status_code == 200, path
        assert c.get("/v1/nothing-here").status_code == 401                     # no route is open by mistake
        assert c.get("/v1/nothing-here", headers=right).status_code == 404
        assert c.get("/v1/models", headers={"Authorization": f"bearer  {KEY} "}).status_code == 200
    with pytest.raises(ValueError, match="api_key must not be empty"):
        create_app(model, tok, api_key=" ")


def test_cli_serve_takes_the_key_from_the_flag_or_the_environment_and_warns_without_one(
        tmp_path, capsys, monkeypatch, model, tok):
    import uvicorn

    from logitlab.cli import serve as cli_serve
    from logitlab.cli.main import build_parser, main
    from logitlab.cli.serve import build_app
    from logitlab.io import checkpoint

    d = tmp_path / "m"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    monkeypatch.delenv("LOGITLAB_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-this-server")             # never read
    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.append((app, kw)))

    def codes(args):
        """(status without a key, with `Bearer {KEY}`, with `Bearer from-env`) of GET /v1/models"""
        with TestClient(build_app(build_parser().parse_args(["serve", str(d), *args]))) as c:
            return tuple(c.get("/v1/models", headers={"Authorization": f"Bearer {k}"} if k else {}).status_code
                         for k in (None, KEY, "from-env"))

    assert codes(["--api-key", KEY]) == (401, 200, 401)
    monkeypatch.setenv("LOGITLAB_API_KEY", "from-env")
    assert codes([]) == (401, 401, 200)
    assert main(["serve", str(d), "--api-key", ""]) == 2 and "--api-key is empty" in capsys.readouterr().err
    monkeypatch.delenv("LOGITLAB_API_KEY")
    monkeypatch.setattr(cli_serve, "build_app", lambda args: SimpleNamespace(state=SimpleNamespace(
        served=SimpleNamespace(name="m"), notes=[])))                                  # the model is not needed below
    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", KEY, False), ("::1", None, False)):
        assert main(["serve", str(d), "--host", host, *(["--api-key", key] if key else [])]) == 0
        err = capsys.readouterr().err
        assert ("there is no API key" in err) == warned, (host, key, err)
        assert ("API key required" in err) == (key is not None)
    assert len(ran) == 3 and ran[0][1]["host"] == "0.0.0.0"
    assert [cli_serve._loopback(h) for h in ("127.0.0.1", "127.5.0.1", "localhost", "::1", "192.168.1.7",
                                             "example.org")] == [True, True, True, True, False, False]
