"""The explorer: a page at / that shows what the model computes for a text, and the JSON behind it.

  - GET / : static/explorer.html, one file, vanilla JS and SVG, no external assets;
  - POST /v1/explore {"text", "top_k"?, "bos"?}: the tokens (id, text, bytes), each token's
    probability and surprisal (inspect.core.token_surprisals, the same report `logitlab inspect
    --json` prints under "surprisal"), per position the top-k next tokens by raw logit, the
    logit-lens grid (layers x positions: top token and probability), the attention weights
    per layer and head, and for a mixture of experts each token's experts per MoE layer ("experts");
  - POST /v1/explore/neighbours {"id", "k"?}: the token's embedding neighbours (inspect.core);
  - POST /v1/explore/attribution {"text", "position"?, "token"?}: direct logit attribution
    (inspect.attribution) of `token` (default: the model's top next token) after `position`;
  - POST /v1/explore/patch {"text", "corrupt", "token", "other"}: activation patching of the
    residual stream per layer and position (inspect.patching), the restored share of the logit
    difference token - other (each a string of one token) from the corrupted text into `text`;
  - POST /v1/explore/next {"text", "position", "temperature", "top_k", "top_p", "min_p", "rows"?}:
    inspect.core.next_token_table at that position (the "next" of `inspect --json`): each
    candidate's logit, softmax probability and the probability the sampler draws from after the
    settings, computed by logitlab.generate.sampling, so the page never re-implements the sampler.
The model runs in a worker thread (starlette's threadpool), beside the engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from logitlab.generate.sampling import SampleConfig
from logitlab.inspect import core as inspect_core
from logitlab.serve.protocol import ApiError, boolean, integer, number, read_json

PAGE = Path(__file__).with_name("static") / "explorer.html"
MAX_TOP_K = 50
MAX_ATTENTION_TOKENS = 128  # longer texts get no attention maps (L x H x T x T numbers)


def _text_ids(body: dict, tokenizer, context: int) -> list[int]:
    text = body.get("text")
    if not isinstance(text, str) or not text:
        raise ApiError(400, "'text' must be a non-empty string", "text")
    ids = tokenizer.encode(text)
    if boolean(body, "bos"):
        if tokenizer.eot_id is None:
            raise ApiError(400, "'bos' needs a tokenizer with <|endoftext|>", "bos")
        ids = [tokenizer.eot_id] + ids
    if len(ids) > context:
        raise ApiError(400, f"the text is {len(ids)} tokens long; the model's context is {context}", "text")
    return ids


def explore(model, tokenizer, ids: list[int], k: int) -> dict:
    """The page's main view: tokens, surprisal per token, top-k next tokens by logit per position."""
    label = lambda i: tokenizer.decode([i])  # noqa: E731
    tokens = [{"position": t, "id": i, "text": label(i), "bytes": list(tokenizer.token_bytes(i))}
              for t, i in enumerate(ids)]
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=next(model.parameters()).device))[0].float()  # (T, V)
    if not bool(torch.isfinite(logits).all()):
        raise ApiError(500, "the model's logits contain NaN or inf")
    probs = torch.softmax(logits, dim=-1)                                                        # (T, V)
    values, order = logits.topk(min(k, logits.shape[-1]), dim=-1)                                # (T, k)
    top = [[{"id": i, "text": label(i), "logit": v, "probability": float(probs[t, i])}
            for v, i in zip(values[t].tolist(), order[t].tolist())] for t in range(len(ids))]
    report = {"ids": ids, "tokens": tokens, "top": top, "lens": _lens(model, ids, label)}
    if len(ids) <= MAX_ATTENTION_TOKENS:
        report["attention"] = _attention(model, ids)
    if len(ids) >= 2:
        report["surprisal"] = dataclasses.asdict(inspect_core.token_surprisals(model, ids, label))
    if model.config.is_moe:
        report["experts"] = _experts(model, ids)
    return report


def _experts(model, ids: list[int]) -> list[dict]:
    """Per MoE layer, each token's experts heaviest first with their weights (4 digits), the
    router's entropy, and each expert's load over the text (inspect.experts.expert_routing)."""
    from logitlab.inspect.experts import expert_routing

    return [{"layer": r.layer, "experts": r.experts, "weights": [[round(w, 4) for w in row] for row in r.weights],
             "entropy": [round(e, 4) for e in r.entropy], "load": r.load, "dropped": r.dropped}
            for r in expert_routing(model, ids)]


def _lens(model, ids: list[int], label) -> list[list[dict]]:
    """The logit-lens grid, layers x positions: each cell the top token and its probability if the
    model stopped after that layer (layer 0: the embeddings; inspect.core.lens_logits)."""
    probs = torch.softmax(inspect_core.lens_logits(model, ids), dim=-1)                 # (L+1, T, V)
    p, order = probs.max(dim=-1)                                                         # (L+1, T)
    return [[{"id": i, "text": label(i), "probability": v} for i, v in zip(row_ids, row_p)]
            for row_ids, row_p in zip(order.tolist(), p.tolist())]


def _attention(model, ids: list[int]) -> list[list[list[list[float]]]]:
    """Attention weights [layer][head][query][key], rounded to 4 digits (eager attention)."""
    with torch.no_grad():
        _, weights = model.forward_with_attention(torch.tensor([ids], device=next(model.parameters()).device))
    return [[[[round(x, 4) for x in row] for row in head] for head in w[0].float().tolist()] for w in weights]


def _served(request: Request):
    return request.app.state.served


async def _json(request: Request) -> dict:
    return await read_json(request, _served(request).max_body_bytes)


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(PAGE.read_text(encoding="utf-8"))


async def explore_route(request: Request) -> JSONResponse:
    served = _served(request)
    try:
        body = await _json(request)
        ids = _text_ids(body, served.tokenizer, served.context)
        k = integer(body, "top_k", 10, 1, MAX_TOP_K)
        report = await run_in_threadpool(explore, served.engine.model, served.tokenizer, ids, k)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    return JSONResponse(report)


async def next_route(request: Request) -> JSONResponse:
    served = _served(request)
    try:
        body = await _json(request)
        ids = _text_ids(body, served.tokenizer, served.context)
        position = integer(body, "position", -1, -len(ids), len(ids) - 1)
        config = SampleConfig(temperature=number(body, "temperature", 1.0, 0, 100),
                              top_k=integer(body, "top_k", 0, 0), top_p=number(body, "top_p", 1.0, 1e-6, 1),
                              min_p=number(body, "min_p", 0.0, 0, 0.999))
        rows = integer(body, "rows", 20, 1, MAX_TOP_K)
        label = lambda i: served.tokenizer.decode([i])  # noqa: E731
        table = await run_in_threadpool(inspect_core.next_token_table, served.engine.model, ids, position, config,
                                        rows, label)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except (ValueError, RuntimeError) as exc:
        return JSONResponse(ApiError(400, str(exc)).body(), status_code=400)
    return JSONResponse(dataclasses.asdict(table))


async def neighbours_route(request: Request) -> JSONResponse:
    """{"id", "k"?} -> the embedding rows most cosine-similar to the token's (inspect.core)."""
    served = _served(request)
    try:
        body = await _json(request)
        token = integer(body, "id", None, 0, served.engine.model.config.vocab_size - 1)
        if token is None:
            raise ApiError(400, "'id' (a token id) is required", "id")
        k = integer(body, "k", 10, 1, MAX_TOP_K)
        label = lambda i: served.tokenizer.decode([i])  # noqa: E731
        found = await run_in_threadpool(inspect_core.embedding_neighbours, served.engine.model, token, k, label)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    return JSONResponse({"id": token, "text": served.tokenizer.decode([token]),
                         "nearest": [dataclasses.asdict(n) for n in found]})


def attribution(model, ids: list[int], position: int, token: int | None) -> dict:
    """The attribution view: parts and heads of the logit of `token` (or the top next token)."""
    from logitlab.inspect.attribution import direct_logit_attribution

    if token is None:
        with torch.no_grad():
            token = int(model(torch.tensor([ids], device=next(model.parameters()).device))[0, position].argmax())
    return dataclasses.asdict(direct_logit_attribution(model, ids, token, None, position))


def _one_token(body: dict, field: str, tokenizer) -> int:
    text = body.get(field)
    ids = tokenizer.encode(text) if isinstance(text, str) and text else []
    if len(ids) != 1:
        raise ApiError(400, f"'{field}' must be a string of exactly one token, got {len(ids)} tokens", field)
    return ids[0]


def patch(model, clean: list[int], corrupt: list[int], token: int, other: int) -> dict:
    """The patching view: resid_pre per layer (rows) and position (columns)."""
    from logitlab.inspect.patching import activation_patching, logit_difference

    r = activation_patching(model, clean, corrupt, logit_difference(token, other))
    return {"names": r.names, "scores": [[round(v, 4) for v in row] for row in r.scores.tolist()],
            "clean": r.clean, "corrupt": r.corrupt}


async def attribution_route(request: Request) -> JSONResponse:
    served = _served(request)
    try:
        body = await _json(request)
        ids = _text_ids(body, served.tokenizer, served.context)
        position = integer(body, "position", -1, -len(ids), len(ids) - 1)
        token = integer(body, "token", None, 0, served.engine.model.config.vocab_size - 1)
        report = await run_in_threadpool(attribution, served.engine.model, ids, position, token)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except ValueError as exc:
        return JSONResponse(ApiError(400, str(exc)).body(), status_code=400)
    report["text"] = served.tokenizer.decode([report["token"]])
    return JSONResponse(report)


async def patch_route(request: Request) -> JSONResponse:
    served = _served(request)
    try:
        body = await _json(request)
        clean = _text_ids(body, served.tokenizer, served.context)
        if len(clean) > MAX_ATTENTION_TOKENS:
            raise ApiError(400, f"patching takes texts of up to {MAX_ATTENTION_TOKENS} tokens", "text")
        corrupt = _text_ids({"text": body.get("corrupt")}, served.tokenizer, served.context)
        token, other = _one_token(body, "token", served.tokenizer), _one_token(body, "other", served.tokenizer)
        report = await run_in_threadpool(patch, served.engine.model, clean, corrupt, token, other)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except ValueError as exc:
        return JSONResponse(ApiError(400, str(exc)).body(), status_code=400)
    return JSONResponse(report)


def routes() -> list[Route]:
    return [Route("/", page), Route("/v1/explore", explore_route, methods=["POST"]),
            Route("/v1/explore/attribution", attribution_route, methods=["POST"]),
            Route("/v1/explore/patch", patch_route, methods=["POST"]),
            Route("/v1/explore/next", next_route, methods=["POST"]),
            Route("/v1/explore/neighbours", neighbours_route, methods=["POST"])]
