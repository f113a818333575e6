"""Serving: the batching engine (engine.py: requests in, token events out, one batched decode),
the OpenAI-compatible HTTP app (app.py: /v1/models, /v1/completions, /v1/chat/completions,
streaming over server-sent events, /health) and the explorer page (explorer.py and static/)."""

__all__ = ["app", "engine"]
