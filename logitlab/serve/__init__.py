"""Serving: the batching engines (paged_engine.py, the default: a paged KV cache with prefix caching
and chunked prefill; engine.py: one contiguous cache; both requests in, token events out),
the OpenAI-compatible HTTP app (app.py: /v1/models, /v1/completions, /v1/chat/completions,
streaming over server-sent events, /health) and the explorer page (explorer.py and static/)."""

__all__ = ["app", "engine", "paged_engine"]
