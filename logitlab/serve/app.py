"""The HTTP server: an ASGI app (starlette) speaking OpenAI's completions and chat API over the
batching engine, with server-sent events for streaming, a health check and the explorer page.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, and the
explorer's GET / and POST /v1/explore (explorer.py). With an API key (RequireKey) every route
but /health and the explorer page needs `Authorization: Bearer KEY`. Every request is checked
before anything is queued (protocol.py): a bad field, an unknown model, a prompt longer than the
context, malformed or too deeply nested JSON, or a body over max_body_bytes is a 4xx with
OpenAI's error object naming the field. Each prompt becomes one engine request; its events cross
from the engine's thread into the event loop through an asyncio queue. A client that goes away (a
closed stream, or a dropped connection while waiting) cancels its requests, which frees their rows.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from logitlab.serve import explorer
from logitlab.serve.engine import DoneEvent, Engine, TokenEvent
from logitlab.serve.paged_engine import PagedEngine
from logitlab.serve.protocol import (
    MAX_TOP_LOGPROBS,
    ApiError,
    TextStream,
    boolean,
    chat_prompt,
    completion_prompts,
    integer,
    read_json,
    sampling,
    token_text,
)

MAX_N = 8


@dataclass
class Served:
    """What the routes share: the engine, the tokenizer, the model's name and limits."""

    engine: Engine
    tokenizer: object
    name: str
    max_body_bytes: int = 1 << 20
    end_ids: tuple[int, ...] = ()
    defaults: dict = field(default_factory=dict)   # the model's sampling defaults (generation_config.json)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def context(self) -> int:
        return self.engine.context


@dataclass
class _Job:
    """One prompt's generation as the route follows it."""

    prompt: list[int]
    text: TextStream
    request: object = None
    tokens: list[TokenEvent] = field(default_factory=list)
    done: DoneEvent | None = None


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _body(request: Request, served: Served) -> dict:
    return await read_json(request, served.max_body_bytes)


def _check_model(body: dict, served: Served) -> None:
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(400, "'model' is required (a string; GET /v1/models lists them)", "model")
    if name != served.name:
        raise ApiError(404, f"the model {name!r} does not exist; this server has {served.name!r}", "model",
                       "model_not_found")


def _check_prompt(ids: list[int], served: Served, param: str) -> None:
    if len(ids) >= served.context:
        raise ApiError(400, f"the prompt is {len(ids)} tokens long; the model's context is {served.context} "
                       f"tokens, which leaves no room to generate", param, "context_length_exceeded")
    V = served.engine.model.config.vocab_size
    if any(not 0 <= i < V for i in ids):
        raise ApiError(400, f"the prompt holds a token id outside the vocabulary (0..{V - 1})", param)


def _submit(served: Served, jobs: list[_Job], config, top: int) -> asyncio.Queue:
    """Queue every job; events arrive on the returned queue as (job index, event). The served
    end ids (a Hugging Face model's eos ids) end a generation too."""
    extra = tuple(i for i in served.end_ids if i not in config.stop_ids and i != served.engine.eot_id)
    config = replace(config, stop_ids=config.stop_ids + extra) if extra else config
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    for i, job in enumerate(jobs):
        def emit(event, i=i):
            loop.call_soon_threadsafe(queue.put_nowait, (i, event))

        job.request = served.engine.submit(job.prompt, config, emit, top_logprobs=top)
    return queue


def _cancel(served: Served, jobs: list[_Job]) -> None:
    for job in jobs:
        if job.request is not None and job.done is None:
            served.engine.cancel(job.request)


async def _collect(request: Request, served: Served, jobs: list[_Job], queue: asyncio.Queue) -> bool:
    """Wait for every job to finish -> False when the client went away first (jobs cancelled)."""
    try:
        while any(job.done is None for job in jobs):
            try:
                i, event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    _cancel(served, jobs)
                    return False
                continue
            _record(jobs[i], event)
    except asyncio.CancelledError:
        _cancel(served, jobs)
        raise
    return True


def _record(job: _Job, event) -> str:
    """Keep an event on its job -> the text it adds."""
    if isinstance(event, TokenEvent):
        job.tokens.append(event)
        return job.text.feed(event.token)
    job.done = event
    return job.text.finish()


def _finish_reason(job: _Job) -> str:
    reason = job.done.finish_reason if job.done else "length"
    return "stop" if reason == "stop" or job.text.done else reason


def _usage(jobs: list[_Job]) -> dict:
    prompt = sum(len(j.prompt) for j in jobs)
    done = sum(len(j.tokens) for j in jobs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _server_error(jobs: list[_Job]) -> ApiError | None:
    failed = [j.done.error for j in jobs if j.done is not None and j.done.finish_reason == "error"]
    return ApiError(500, failed[0]) if failed else None


# -------------------- the routes

async def health(request: Request) -> JSONResponse:
    served: Served = request.app.state.served
    return JSONResponse({"status": "ok", "model": served.name, "running": served.engine.running,
                         "waiting": served.engine.waiting})


async def models(request: Request) -> JSONResponse:
    served: Served = request.app.state.served
    return JSONResponse({"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                                     "owned_by": "logitlab"}]})


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(served: Served, jobs: list[_Job], queue: asyncio.Queue, chunk, final, usage: bool):
    """Server-sent events: chunk(index, job, piece, event) per token, final(index, job) per job, then
    the usage chunk when asked, then [DONE]. Closing the stream cancels what is still running."""
    try:
        while any(job.done is None for job in jobs):
            i, event = await queue.get()
            piece = _record(jobs[i], event)
            if isinstance(event, TokenEvent) or piece:
                yield _sse(chunk(i, jobs[i], piece, event))
            if jobs[i].done is not None:
                error = _server_error([jobs[i]])
                if error is not None:
                    yield _sse(error.body())
                    continue
                yield _sse(final(i, jobs[i]))
        if usage:
            yield _sse({**final(0, jobs[0]), "choices": [], "usage": _usage(jobs)})
        yield _sse("[DONE]")
    finally:
        _cancel(served, jobs)


def _completion_logprobs(tokenizer, events: list[TokenEvent], offset: int) -> dict:
    tokens = [token_text(tokenizer, e.token) for e in events]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{token_text(tokenizer, i): lp for i, lp in e.top} for e in events],
            "text_offset": offsets}


async def completions(request: Request):
    served: Served = request.app.state.served
    try:
        body = await _body(request, served)
        _check_model(body, served)
        config, stops = sampling(body, served.engine.model.config.vocab_size, 16, defaults=served.defaults)
        logprobs = integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        n = integer(body, "n", 1, 1, MAX_N)
        if boolean(body, "echo"):
            raise ApiError(400, "'echo' is not supported", "echo")
        stream = boolean(body, "stream")
        prompts = completion_prompts(body, served.tokenizer)
        for p in prompts:
            _check_prompt(p, served, "prompt")
    except ApiError as exc:
        return _error(exc)
    hidden = set(served.end_ids) | set(config.stop_ids)
    jobs = [_Job(p, TextStream(served.tokenizer, stops, hidden)) for p in prompts for _ in range(n)]
    queue = _submit(served, jobs, config, logprobs or 0)
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "object": "text_completion", "created": created, "model": served.name}

    def choice(i, job, text, events, reason):
        lp = None if logprobs is None else _completion_logprobs(served.tokenizer, events, 0)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    if stream:
        chunk = lambda i, job, piece, ev: {**head, "choices": [choice(  # noqa: E731
            i, job, piece, [ev] if isinstance(ev, TokenEvent) else [], None)]}
        final = lambda i, job: {**head, "choices": [choice(i, job, "", [], _finish_reason(job))]}  # noqa: E731
        return _streamed(served, jobs, queue, chunk, final, body)
    return await _answered(request, served, jobs, queue, lambda: {
        **head, "choices": [choice(i, j, j.text.text, j.tokens, _finish_reason(j)) for i, j in enumerate(jobs)],
        "usage": _usage(jobs)})


def _streamed(served, jobs, queue, chunk, final, body) -> StreamingResponse:
    """The server-sent events of a streamed answer (chunk and final build each event's body)."""
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_stream(served, jobs, queue, chunk, final, usage), media_type="text/event-stream")


async def _answered(request, served, jobs, queue, answer):
    """The JSON answer answer() builds once every job has ended, or the error that ended one
    (499 when the client went away first)."""
    if not await _collect(request, served, jobs, queue):
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    error = _server_error(jobs)
    if error is not None:
        return _error(error)
    return JSONResponse(answer())


def _chat_logprobs(tokenizer, events: list[TokenEvent]) -> dict:
    def entry(token, lp):
        raw = tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(raw)}

    return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top]}
                        for e in events]}


async def chat_completions(request: Request):
    served: Served = request.app.state.served
    try:
        body = await _body(request, served)
        _check_model(body, served)
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        # in a worker thread: a template that runs to its time bound leaves the event loop free
        ids, template_stops, stop_ids = await run_in_threadpool(chat_prompt, served.tokenizer, body.get("messages"))
        _check_prompt(ids, served, "messages")
        config, stops = sampling(body, served.engine.model.config.vocab_size, served.context, field,
                                 defaults=served.defaults)
        want_logprobs = boolean(body, "logprobs")
        top = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if want_logprobs else 0
        n = integer(body, "n", 1, 1, MAX_N)
        stream = boolean(body, "stream")
    except ApiError as exc:
        return _error(exc)
    config = replace(config, stop_ids=config.stop_ids + tuple(stop_ids),
                     stop_bytes=config.stop_bytes + tuple(s.encode() for s in template_stops))
    hidden = set(served.end_ids) | set(config.stop_ids)
    jobs = [_Job(ids, TextStream(served.tokenizer, stops + template_stops, hidden)) for _ in range(n)]
    queue = _submit(served, jobs, config, top)
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def lp(events):
        return _chat_logprobs(served.tokenizer, events) if want_logprobs else None

    if stream:
        head = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": served.name}
        started: set[int] = set()

        def chunk(i, job, piece, ev):
            delta = {"content": piece} if i in started else {"role": "assistant", "content": piece}
            started.add(i)
            return {**head, "choices": [{"index": i, "delta": delta, "finish_reason": None,
                                         "logprobs": lp([ev] if isinstance(ev, TokenEvent) else [])}]}

        final = lambda i, job: {**head, "choices": [{"index": i, "delta": {}, "logprobs": None,  # noqa: E731
                                                     "finish_reason": _finish_reason(job)}]}
        return _streamed(served, jobs, queue, chunk, final, body)
    return await _answered(request, served, jobs, queue, lambda: {
        "id": ident, "object": "chat.completion", "created": created, "model": served.name,
        "choices": [{"index": i, "message": {"role": "assistant", "content": j.text.text}, "logprobs": lp(j.tokens),
                     "finish_reason": _finish_reason(j)} for i, j in enumerate(jobs)],
        "usage": _usage(jobs)})


class RequireKey:
    """ASGI middleware: every path but the open ones (/health and the explorer page /) needs
    `Authorization: Bearer KEY`; anything else is a 401 with OpenAI's error object. The keys are
    compared as SHA-256 digests with hmac.compare_digest, in a time that depends on neither key."""

    OPEN = frozenset({"/health", "/"})

    def __init__(self, app, api_key: str):
        self.app, self.digest = app, hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            error = self._refusal(dict(scope["headers"]).get(b"authorization"))
            if error is not None:
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, header: bytes | None) -> ApiError | None:
        scheme, _, given = (header or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            return ApiError(401, "You didn't provide an API key: send it in an Authorization header, "
                            "'Authorization: Bearer YOUR_KEY'.")
        if not hmac.compare_digest(hashlib.sha256(given.strip()).digest(), self.digest):
            return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None


def create_app(model, tokenizer, *, name: str = "logitlab", max_batch: int = 16, max_body_bytes: int = 1 << 20,
               end_ids: tuple[int, ...] | None = None, engine: Engine | None = None,
               api_key: str | None = None, sample_defaults: dict | None = None) -> Starlette:
    """The ASGI app for `model` (in eval mode) and `tokenizer`, served as `name`. end_ids end a
    generation besides the tokenizer's <|endoftext|>. The engine (a PagedEngine unless `engine` is
    given) starts its thread with the app (lifespan) and stops with it; pass `engine` to share or
    drive one yourself, or to serve with the contiguous Engine. With `api_key`,
    every route but /health and the explorer page needs `Authorization: Bearer API_KEY`.
    sample_defaults (SampleConfig fields: the model's generation_config.json) fill in what a request
    leaves out, before OpenAI's defaults; max_new_tokens among them is not used (max_tokens is)."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must not be empty (None serves without a key)")
    eot = tokenizer.eot_id
    ends = tuple(end_ids if end_ids is not None else ((eot,) if eot is not None else ()))
    engine = engine or PagedEngine(model, eot_id=eot, token_bytes=tokenizer.token_bytes, max_batch=max_batch)
    defaults = {k: v for k, v in (sample_defaults or {}).items() if k != "max_new_tokens"}
    served = Served(engine, tokenizer, name, max_body_bytes, ends, defaults)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.close()

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]), *explorer.routes()]
    middleware = [Middleware(RequireKey, api_key=api_key.strip())] if api_key is not None else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.served = served
    return app
