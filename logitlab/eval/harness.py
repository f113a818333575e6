"""The lm-evaluation-harness model type `logitlab`: the harness's requests answered by scoring.py
and logitlab.generate.

`LogitlabLM(model, tokenizer)` is an `lm_eval` language model (a TemplateLM, so the harness's own
code splits context and continuation into ids exactly as for its `hf` type, and scores compare):
  - loglikelihood: `score_ids` on those ids (batched, the context cut from the left);
  - loglikelihood_rolling: `rolling_windows` of the model's context, from end-of-text;
  - generate_until: `generate` with the request's `until` strings as stop bytes, greedy unless the
    request samples, the text cut at the first stop string.

The harness finds model types by name in its registry, and has no way to discover packages that
add one. `register(loader)` adds `logitlab` (a subclass whose constructor takes `path=` and calls
`loader(path, dtype)` for (model, tokenizer)); the CLI's `logitlab eval harness ...` registers it
with logitlab's loader and then runs the harness's own command line, so `--model logitlab
--model_args path=RUN` works there. From Python, pass an instance: `simple_evaluate(model=LogitlabLM(...))`.

This module imports lm_eval, a test extra; `logitlab.eval` does not import this module.
"""

from __future__ import annotations

from typing import Callable

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from logitlab.eval.scoring import rolling_windows, score_ids
from logitlab.generate.loop import generate
from logitlab.generate.sampling import SampleConfig

MODEL_TYPE = "logitlab"


def _positive_int(value, name: str, default: int) -> int:
    """A model_args value ("16", 16, "auto" or None) -> int >= 1; "auto" and None -> default."""
    if value is None or value == "auto":
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer >= 1 (or 'auto'), got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return number


class LogitlabLM(TemplateLM):
    """A logitlab model and tokenizer as an lm-evaluation-harness LM (single process, one device)."""

    def __init__(self, model, tokenizer, batch_size: int | str = 16, max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int = 1234):
        super().__init__()
        if tokenizer.eot_id is None:
            raise ValueError("the harness starts empty contexts and documents from <|endoftext|>, which this "
                             "tokenizer lacks")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = _positive_int(batch_size, "batch_size", 16)
        context = model.config.context_length
        self._max_length = min(_positive_int(max_length, "max_length", context), context)
        self._max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks", 256)
        self.seed = int(seed)

    # --- what the harness asks of a TemplateLM -------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def prefix_token_id(self) -> int:  # <s> for a SentencePiece-style tokenizer, else <|endoftext|>
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        ids = [tokens] if isinstance(tokens, int) else list(tokens)
        if skip_special_tokens:
            ids = [i for i in ids if not self.tokenizer.is_special(i)]
        return self.tokenizer.decode(ids)

    def _window_model(self):
        """The model with a context of max_length (a smaller max_length cuts windows shorter)."""
        return _Windowed(self.model, self._max_length)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids) -> (logprob, greedy)."""
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        scores = score_ids(self._window_model(), pairs, self.batch_size)
        out = []
        for (strings, _, _), s in zip(requests, scores):
            answer = (s.logprob, s.greedy)
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for r, request in enumerate(requests):
            windows = rolling_windows(self.tok_encode(request.args[0]), self.prefix_token_id, self._max_length)
            pairs += windows
            owner += [r] * len(windows)
        totals = [0.0] * len(requests)
        for r, s in zip(owner, score_ids(self._window_model(), pairs, self.batch_size)):
            totals[r] += s.logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's args: (context, gen_kwargs); requests with equal gen_kwargs run in batches."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for r, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(r)
        for rows in groups.values():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start:start + self.batch_size]
                texts = self._generate([requests[r].args[0] for r in chunk], requests[chunk[0]].args[1])
                for r, text in zip(chunk, texts):
                    out[r] = text
                    self.cache_hook.add_partial("generate_until", requests[r].args, text)
        return out  # type: ignore[return-value]

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tokenizer.decode([self.eot_token_id]))
        max_new = int(kwargs.pop("max_gen_toks"))
        room = self._max_length - max_new
        if room < 1:
            raise ValueError(f"max_gen_toks ({max_new}) must be less than the model's max_length ({self._max_length})")
        prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-room:] for c in contexts]
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        config = SampleConfig(max_new_tokens=max_new, temperature=temperature,
                              top_p=float(kwargs.get("top_p", 1.0) or 1.0), top_k=int(kwargs.get("top_k", 0) or 0),
                              seed=self.seed, stop_bytes=tuple(s.encode() for s in until if s))
        result = generate(self.model, prompts, config, eot_id=self.eot_token_id,
                          token_bytes=self.tokenizer.token_bytes)
        texts = []
        for ids in result.tokens:
            text = self.tok_decode(ids)
            cuts = [text.find(s) for s in until if s and s in text]
            texts.append(text[:min(cuts)] if cuts else text)
        return texts


class _Windowed:
    """A model seen through a shorter context window: score_ids reads config.context_length."""

    def __init__(self, model, context_length: int):
        self._model = model
        self.config = _Config(model.config, context_length)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _Config:
    def __init__(self, config, context_length: int):
        self._config, self.context_length = config, context_length

    def __getattr__(self, name):
        return getattr(self._config, name)


def _available(device: str | None):
    """torch.device(device), or None (stay where the loader put the model) when it is not given or
    names an accelerator this machine lacks: the harness asks for cuda unless told otherwise."""
    if device is None:
        return None
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        return None
    if target.type == "mps" and not torch.backends.mps.is_available():
        return None
    return target


def register(loader: Callable, name: str = MODEL_TYPE) -> type:
    """Register `name` in the harness's model registry: a LogitlabLM whose constructor takes
    path= (and dtype=, batch_size=, max_length=, max_gen_toks=, seed=, and the harness's device=,
    where the model is moved) and gets (model, tokenizer) from
    `loader(path, dtype)`. Registering the same loader again is a no-op. -> the registered class."""
    import lm_eval.models  # noqa: F401  the built-in types first: get_model() imports them only into an empty registry
    from lm_eval.api.registry import model_registry

    existing = model_registry._objs.get(name) if hasattr(model_registry, "_objs") else None
    if isinstance(existing, type) and getattr(existing, "loader", None) is loader:
        return existing

    class FromPath(LogitlabLM):
        def __init__(self, path: str | None = None, dtype: str | None = None, batch_size: int | str = 16,
                     max_length: int | None = None, max_gen_toks: int = 256, seed: int = 1234,
                     device: str | None = None, max_batch_size: int | None = None, **unknown):
            if path is None:
                raise ValueError(f"--model {name} needs --model_args path=RUN_OR_MODEL_DIR")
            if unknown:
                raise ValueError(f"unknown --model_args for {name}: {', '.join(sorted(unknown))} (known: path, "
                                 f"dtype, batch_size, max_length, max_gen_toks, seed)")
            model, tokenizer = loader(str(path), dtype)
            target = _available(device)
            if target is not None:  # --device (the harness's command line passes cuda by default)
                model = model.to(target)
            super().__init__(model, tokenizer, batch_size, max_length, max_gen_toks, seed)

    FromPath.loader = staticmethod(loader)
    FromPath.__name__ = FromPath.__qualname__ = "LogitlabFromPath"
    if existing is not None:
        model_registry._objs.pop(name)  # a different loader replaces the old one
    model_registry.register(name)(FromPath)
    return FromPath
