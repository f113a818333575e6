"""Subcommand `serve` (registered by main.py): an OpenAI-compatible HTTP server and the explorer
page for one model, on uvicorn. The app itself is logitlab.serve.app's; this module loads the
model (as `eval` does: run, checkpoint, logitlab or Hugging Face directory) and runs the server."""

from __future__ import annotations

import os
from pathlib import Path

from logitlab.cli.common import add_examples

API_KEY_ENV = "LOGITLAB_API_KEY"


def register(subparsers) -> None:
    from logitlab.cli.models import add_inference_flags, add_model_argument

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server and the explorer page",
                              description="Serve MODEL over HTTP: /v1/completions and /v1/chat/completions "
                              "(streaming with server-sent events), /v1/models, /health, and the explorer at /. "
                              "Concurrent requests share one batched decode. Point any OpenAI client at "
                              "http://HOST:PORT/v1.")
    add_model_argument(p)
    add_examples(p, "serve runs/a                          # http://127.0.0.1:8000/v1 and the explorer at /",
                 "serve Qwen/Qwen3-0.6B --port 8080 --dtype bf16",
                 "serve runs/a --quantize int8 --dtype bf16 --draft ngram   # a request alone: speculative")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for "
                   "every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--name", default=None, help="the model's name in the API (default: the directory's name)")
    p.add_argument("--max-batch", type=int, default=16, help="most requests decoded together (default 16)")
    p.add_argument("--engine", choices=("paged", "contiguous"), default=None,
                   help="paged (the default): a paged KV cache with prefix caching and chunked prefill; contiguous: "
                   "the earlier engine, one shared cache rebuilt when a request cannot join (the default with --draft, "
                   "whose speculative decoding of a request alone it alone has)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block (paged; default 16)")
    p.add_argument("--cache-blocks", type=int, default=None,
                   help="KV blocks in the pool, the cache's memory budget (paged; default room for --max-batch full "
                   "contexts); unreferenced prefix blocks are evicted least recently used first")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not share prompt blocks between requests (paged): a client can then not tell from "
                   "its time to first token whether another client sent the same prefix")
    p.add_argument("--chunk-tokens", type=int, default=128,
                   help="prompt positions prefilled per step between decode steps (paged; default 128)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and the explorer page "
                   f"(default: the environment variable {API_KEY_ENV}, if set; else no key)")
    add_inference_flags(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=_serve)


def build_app(args):
    """The ASGI app for the parsed arguments (the model loaded), without starting a server."""
    from logitlab.cli.eval import load_path
    from logitlab.cli.models import load_draft, prepare_model
    from logitlab.serve.app import create_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    key = api_key(args)
    m = load_path(args.model, args.dtype, args.revision)
    notes = prepare_model(args, m.model)
    draft = load_draft(args, m.model)
    name = args.name or (args.model if m.provenance.get("revision") else Path(args.model).resolve().name)
    from logitlab.io.generation_config import sample_defaults

    engine = _engine(args, m, draft)
    app = create_app(m.model, m.tokenizer, name=name, max_batch=args.max_batch,
                     max_body_bytes=args.max_body_bytes, end_ids=m.end_ids, api_key=key,
                     sample_defaults=sample_defaults(m.generation), engine=engine)
    app.state.notes = notes + ([f"a request alone is decoded speculatively (--draft {args.draft}, k {args.draft_k})"]
                               if draft is not None else [])
    return app


def _engine(args, m, draft):
    """The batching engine --engine names: paged (default), or contiguous (default with --draft)."""
    from logitlab.serve.engine import Engine
    from logitlab.serve.paged_engine import PagedEngine

    kind = args.engine or ("contiguous" if draft is not None else "paged")
    common = dict(eot_id=m.tokenizer.eot_id, token_bytes=m.tokenizer.token_bytes, max_batch=args.max_batch)
    if kind == "contiguous":
        return Engine(m.model, speculative=None if draft is None else (draft, args.draft_k), **common)
    if draft is not None:
        raise ValueError("--draft needs --engine contiguous: the paged engine does not decode speculatively")
    for flag in ("block_size", "cache_blocks", "chunk_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return PagedEngine(m.model, block_size=args.block_size, cache_blocks=args.cache_blocks,
                       chunk_tokens=args.chunk_tokens, prefix_caching=not args.no_prefix_cache, **common)


def api_key(args) -> str | None:
    """--api-key, else $LOGITLAB_API_KEY (unset or empty: no key). OPENAI_API_KEY is not read: it
    often holds a real OpenAI key, which a local server should neither use nor hand to its clients."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ValueError("--api-key is empty")
        return args.api_key.strip()
    return os.environ.get(API_KEY_ENV, "").strip() or None


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _serve(args) -> int:
    import uvicorn

    from logitlab.cli.common import error_console

    app = build_app(args)
    name, console = app.state.served.name, error_console()
    for note in app.state.notes:
        console.print(note, markup=False, soft_wrap=True)
    keyed = api_key(args) is not None
    console.print(f"serving {name!r} on http://{args.host}:{args.port} (OpenAI API under /v1, explorer at /"
                  f"{'; API key required' if keyed else ''})", markup=False, soft_wrap=True)
    if not keyed and not _loopback(args.host):
        console.print(f"warning: {args.host} is not a loopback address and there is no API key: anyone who can "
                      f"reach port {args.port} can use the model. Set --api-key or {API_KEY_ENV}.", markup=False,
                      soft_wrap=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
