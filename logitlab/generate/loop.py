"""The prefill/decode loop: ids in, ids out.

loop.py owns the loop that runs a model with a KV cache: prefill the prompt once, then
decode one token at a time using only the last position's logits. It never sees text: stop
strings arrive as bytes together with a token -> bytes table, and turning ids into text
is the tokenizer's job (the CLI joins the two).

The pure logits -> probabilities -> id functions and SampleConfig live in sampling.py; this
module runs the model. Both are re-exported by the package (`from logitlab.generate import ...`).

Shapes: B batch, T positions in this call, S key/value length, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from logitlab.generate.checks import check_generates, check_prompts
from logitlab.generate.sampling import (
    MODEL_CAUSE,
    SampleConfig,
    SamplingError,
    bias_vector,
    invalid_cause,
    make_generator,
    next_token,
    pick,
)
from logitlab.generate.stops import StopStrings
from logitlab.model.cache import KVCache

# --- stopping --------------------------------------------------------------------------------

STOP_REASONS = ("eot", "stop_id", "stop_sequence", "max_new_tokens", "context_length")


class _StopRules:
    """Per-row stop checks on each new id: end-of-text, stop ids, id sequences, byte strings.

    Id sequences and byte strings are matched against what each row generated (never the
    prompt), by one StopMatcher per row (stops.py): linear in what is fed, so a stop string split
    across tokens is found and a long one costs no more per token than a short one."""

    def __init__(self, config: SampleConfig, rows: int, eot_id: int | None,
                 token_bytes: Callable[[int], bytes] | Sequence[bytes] | None):
        self.eot_id, self.config = eot_id, config
        self.stop_ids = set(config.stop_ids)
        if config.stop_bytes and token_bytes is None:
            raise ValueError("stop_bytes needs a token -> bytes table (token_bytes=...)")
        self.token_bytes = token_bytes if callable(token_bytes) else (
            token_bytes.__getitem__ if token_bytes is not None else None)
        sequences, strings = StopStrings(config.stop_sequences), StopStrings(config.stop_bytes)
        self.sequences = [sequences.matcher() for _ in range(rows)] if sequences else None
        self.strings = [strings.matcher() for _ in range(rows)] if strings else None

    def check(self, row: int, generated: list[int]) -> str | None:
        """The reason row `row` stops at its new id generated[-1], or None (called once per id)."""
        token = generated[-1]
        if token == self.eot_id:
            return "eot"
        if token in self.stop_ids:
            return "stop_id"
        if self.sequences is not None and self.sequences[row].feed((token,)) is not None:
            return "stop_sequence"
        if self.strings is not None and self.strings[row].feed(self.token_bytes(token)) is not None:
            return "stop_sequence"
        return None


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------

@dataclass
class GenerationResult:
    """Generated ids per prompt (the prompt excluded, a stopping token included), why each row
    stopped, and timings: prefill (the prompt pass and the first token) and decode."""

    tokens: list[list[int]]
    stop_reasons: list[str]
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps, summed over rows

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def prefill(model, ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
            attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt ids (B, T) once, filling the cache; -> last position's logits (B, V) fp32.

    Only the last position goes through the final norm and the LM head (the other T - 1 rows
    of the (T, V) logits would be thrown away): forward_features, then unembed on (B, 1, D)."""
    h = model.forward_features(ids, cache=cache, positions=positions, attn_mask=attn_mask)  # (B, T, D)
    return model.unembed(h[:, -1:])[:, -1].float()                                        # (B, V)


def decode_step(model, token: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, greedy: bool = False) -> torch.Tensor:
    """One new token per row (B, 1) through the cached model -> logits (B, V) fp32, or with
    greedy=True the next ids (B,), their argmax (so a compiled step picks them inside its graph),
    and -1 for a row whose largest logit is NaN or inf, as it is when any is NaN (the loop raises
    SamplingError for it).

    The caller checked the ids, so the model's own range check (a host sync) is skipped for this
    call (check_values=False); the model is not changed."""
    logits = model(token, cache=cache, positions=positions, attn_mask=attn_mask, check_values=False)[:, -1]  # (B, V)
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if not greedy:
        return logits                                                                      # (B, V)
    top, ids = logits.max(dim=-1)  # one pass, as argmax; top is NaN if any logit is NaN
    return ids.masked_fill(~torch.isfinite(top), -1)                                       # (B,)


def _device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


@dataclass
class _Batch:
    """The tensors of one cached loop over B prompts (inference tensors, made and used only inside
    torch.inference_mode): left-padded ids (B, S0), per-row positions (B, S0), the KV cache, the
    key mask (B, S_max) or None when no row is padded, and the sampler's state (bias, seen ids,
    generated counts) with `ones` (B, 1), what each step adds to the counts."""

    ids: torch.Tensor
    positions: torch.Tensor
    cache: KVCache
    mask: torch.Tensor | None
    state: dict
    ones: torch.Tensor | None = None


def _build_batch(model, prompts: Sequence[Sequence[int]], config: SampleConfig, budget: int,
                 streaming=None) -> _Batch:
    """Left padding + attn_mask (B, S) + per-row positions; call inside torch.inference_mode."""
    mc = model.config
    device, dtype = _device_dtype(model)
    B, lengths = len(prompts), [len(p) for p in prompts]
    S0 = max(lengths)
    pad = [S0 - n for n in lengths]
    ids = torch.zeros(B, S0, dtype=torch.long)  # (B, S0), left padded with id 0
    for b, p in enumerate(prompts):
        ids[b, pad[b]:] = torch.tensor(list(p), dtype=torch.long)
    ids = ids.to(device)
    offsets = torch.tensor(pad, device=device)[:, None]  # (B, 1)
    positions = (torch.arange(S0, device=device)[None, :] - offsets).clamp_(min=0)  # (B, S0)
    cache = KVCache.for_model(mc, batch_size=B, max_len=min(S0 + budget, mc.context_length), dtype=dtype,
                              device=device, stream=streaming)
    mask = None
    if any(pad):  # (B, S_max) True = real key slot; only needed when rows are padded
        mask = torch.arange(S0 + budget, device=device)[None, :] >= offsets
    batch = _Batch(ids, positions, cache, mask, dict(bias=bias_vector(config, mc.vocab_size, device),
                                                     seen=None, counts=None))
    if config.repetition_penalty != 1.0:
        seen = torch.zeros(B, mc.vocab_size, dtype=torch.bool, device=device)
        seen.scatter_(1, ids, True)
        seen[:, 0] = torch.tensor([any(t == 0 for t in p) for p in prompts], device=device)
        batch.state["seen"] = seen
    if config.frequency_penalty or config.presence_penalty:
        batch.state["counts"] = torch.zeros(B, mc.vocab_size, dtype=torch.float32, device=device)
        batch.ones = torch.ones(B, 1, device=device)  # (B, 1) added at each step's ids
    return batch


def _decode(fn: Callable, model, token: torch.Tensor, position: torch.Tensor, batch: _Batch,
            config: SampleConfig, generator, in_step: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step after the first token: the penalties' state takes the last ids, the
    model runs on them -> (next ids (B,), the step's logits (B, V) or None when the step picked
    the ids itself). Call inside torch.inference_mode."""
    seen, counts = batch.state["seen"], batch.state["counts"]
    if seen is not None:
        seen.scatter_(1, token[:, None], True)
    if counts is not None:
        counts.scatter_add_(1, token[:, None], batch.ones)
    if in_step:
        return fn(model, token[:, None], batch.cache, position, batch.mask, greedy=True), None  # (B,)
    logits = fn(model, token[:, None], batch.cache, position, batch.mask)                       # (B, V)
    return pick(logits, config, generator, **batch.state), logits


def _record(new: list[int], active: list[bool], generated: list[list[int]], rules: _StopRules,
            result: GenerationResult) -> list[int | None]:
    """Append each active row's new id, apply the stop rules -> the ids to yield (None: finished)."""
    out: list[int | None] = []
    for b in range(len(new)):
        if not active[b]:
            out.append(None)
            continue
        generated[b].append(new[b])
        out.append(new[b])
        reason = rules.check(b, generated[b])
        if reason is not None:
            active[b] = False
            result.stop_reasons[b] = reason
    result.tokens = generated
    return out


def _steps(model, prompts: Sequence[Sequence[int]], config: SampleConfig, *, eot_id: int | None,
           token_bytes, generator: torch.Generator | None, result: GenerationResult,
           step: Callable = decode_step, trust_guards: bool = False,
           streaming=None) -> Iterator[list[int | None]]:
    """The cached loop for B prompts (streaming: see generate): yields each step's ids per row
    (None for finished rows) and fills `result` as it goes.

    trust_guards: decode steps after the second go through step.trusted when the step has one
    (a compiled step), for a caller that runs no other code between steps (generate, not a Stream)."""
    budget = check_prompts(prompts, model.config, config.max_new_tokens, streaming)
    generator = generator or make_generator(config.seed, _device_dtype(model)[0])
    rules = _StopRules(config, len(prompts), eot_id, token_bytes)
    # inference_mode rather than no_grad: no view or version-counter bookkeeping per op. Every
    # tensor made in the loop (cache, positions, counts) is only read and written inside these blocks.
    with torch.inference_mode():
        batch = _build_batch(model, prompts, config, budget, streaming)
        # Greedy with nothing to add to the logits: the step returns the argmax itself (inside
        # a compiled graph, cheaper than an eager argmax over (B, V) fp32 logits).
        in_step = config.greedy and all(v is None for v in batch.state.values())
        # Every decode call of this loop passes the same model, cache, position and mask tensors
        # and token shape; only cache.length (+1) and the values change. The first two steps
        # check every guard (the first may compile, and specialise on a cache length of 1, which
        # dynamo does for sizes 0 and 1); later ones skip those the second one checked.
        trusted = getattr(step, "trusted", None) if trust_guards else None
        t0 = time.perf_counter()
        S0 = batch.ids.shape[1]
        logits = prefill(model, batch.ids, batch.cache, batch.positions,
                         None if batch.mask is None else batch.mask[:, :S0])
        token = pick(logits, config, generator, **batch.state)  # (B,), -1 where no token can be chosen
        # (B, 1) position of the token fed next; StreamingLLM: the cache's next slot (re-indexed)
        position = batch.positions[:, -1:] + 1 if streaming is None else None
    generated: list[list[int]] = [[] for _ in prompts]
    active = [True] * len(prompts)
    for i in range(budget):
        if i == 0:
            new = token.tolist()  # the one host synchronisation per step
            result.prefill_seconds = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            with torch.inference_mode():
                fn = trusted if trusted is not None and i > 2 else step
                token, logits = _decode(fn, model, token, position, batch, config, generator, in_step)
                if position is not None:
                    position += 1
            new = token.tolist()
            result.decode_seconds += time.perf_counter() - t0
            result.decode_tokens += sum(active)
        if min(new) < 0:  # the step's logits, or None where the step picked the ids itself
            token = _unpicked(new, active, i, logits, config, batch.state, token)
        yield _record(new, active, generated, rules, result)
        if not any(active):
            break
    for b in range(len(prompts)):
        if active[b]:
            result.stop_reasons[b] = "context_length" if budget < config.max_new_tokens else "max_new_tokens"


def _unpicked(new: list[int], active: list[bool], step: int, logits: torch.Tensor | None,
              config: SampleConfig, state: dict, token: torch.Tensor) -> torch.Tensor:
    """A step gave -1 (no distribution) for some rows: raise SamplingError for the first active
    one. A finished row still runs through the model; its -1 becomes 0 so the next step has an id."""
    with torch.inference_mode():  # the loop's tensors are inference tensors
        for b, t in enumerate(new):
            if t < 0 and active[b]:
                cause = (invalid_cause(logits, b, config, **state) if logits is not None
                         else f"the model's logits contain NaN or inf ({MODEL_CAUSE})")
                raise SamplingError(cause, b, step)
        return token.clamp_min(0)


def _as_batch(prompt_ids) -> list[list[int]]:
    """One prompt (a sequence of ids) or a batch (a sequence of them, or a (B, T) tensor) -> lists."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    if len(prompt_ids) and not hasattr(prompt_ids[0], "__len__"):
        return [list(map(int, prompt_ids))]
    return [list(map(int, p)) for p in prompt_ids]


class Stream:
    """Iterator over the ids generated for one prompt; `.result` (a GenerationResult) is
    complete once the iterator is exhausted."""

    def __init__(self, model, prompt_ids: Sequence[int], config: SampleConfig, step: Callable = decode_step, **kw):
        check_generates(model.config)                             # now, not at the first next()
        self.result = GenerationResult(tokens=[[]], stop_reasons=[""])
        self._steps = _steps(model, _as_batch(prompt_ids)[:1], config, result=self.result, step=step, **kw)

    def __iter__(self) -> Iterator[int]:
        for out in self._steps:
            if out[0] is not None:
                yield out[0]


def stream(model, prompt_ids: Sequence[int], config: SampleConfig = SampleConfig(), *,
           eot_id: int | None = None, token_bytes=None, generator: torch.Generator | None = None,
           step: Callable = decode_step) -> Stream:
    """Generate for one prompt, yielding each id as soon as it is chosen. `step`: as generate's."""
    return Stream(model, prompt_ids, config, step, eot_id=eot_id, token_bytes=token_bytes,
                  generator=generator)


def generate(model, prompt_ids, config: SampleConfig = SampleConfig(), *, eot_id: int | None = None,
             token_bytes=None, generator: torch.Generator | None = None,
             use_cache: bool = True, step: Callable = decode_step,
             streaming: tuple[int, int] | None = None) -> GenerationResult:
    """Generate for one prompt (list of ids) or a batch (list of lists, any lengths).

    `eot_id` ends a row; `token_bytes` (id -> bytes, callable or sequence) is needed only for
    config.stop_bytes. use_cache=False runs the reference path (a full forward per step), one
    prompt at a time.

    step: the decode step, a callable with decode_step's signature (the default: decode_step,
    eager). A faster one is built outside generation and passed in, e.g. the compiled step,
    `step=kernels.decode.compiled_decode_step(model, step=decode_step)`; a step with a `trusted`
    method (a compiled step) is called through it from the third decode step on.

    streaming=(sink, window): StreamingLLM (Xiao et al. 2023) for models whose attention layers
    are full attention: the cache keeps the first `sink` positions and the last `window`, positions
    re-indexed inside it, so max_new_tokens may pass the context length with bounded memory."""
    prompts = _as_batch(prompt_ids)
    if streaming is not None and not use_cache:
        raise ValueError("streaming generation needs the cache (use_cache=True)")
    if not use_cache:
        results = [generate_reference(model, p, config, eot_id=eot_id, token_bytes=token_bytes,
                                      generator=generator) for p in prompts]
        return GenerationResult([r.tokens[0] for r in results], [r.stop_reasons[0] for r in results],
                                sum(r.prefill_seconds for r in results),
                                sum(r.decode_seconds for r in results),
                                sum(r.decode_tokens for r in results))
    result = GenerationResult(tokens=[[] for _ in prompts], stop_reasons=[""] * len(prompts))
    for _ in _steps(model, prompts, config, eot_id=eot_id, token_bytes=token_bytes,
                    generator=generator, result=result, step=step, trust_guards=True, streaming=streaming):
        pass
    return result


def generate_reference(model, prompt_ids: Sequence[int], config: SampleConfig = SampleConfig(), *,
                       eot_id: int | None = None, token_bytes=None,
                       generator: torch.Generator | None = None) -> GenerationResult:
    """The slow, obviously correct path: no cache, the whole sequence through the model at every
    step, the last position's logits through the same next_token. One prompt."""
    prompt = _as_batch(prompt_ids)[0]
    mc = model.config
    budget = check_prompts([prompt], mc, config.max_new_tokens)
    device, _ = _device_dtype(model)
    generator = generator or make_generator(config.seed, device)
    rules = _StopRules(config, 1, eot_id, token_bytes)
    bias = bias_vector(config, mc.vocab_size, device)
    result = GenerationResult(tokens=[[]], stop_reasons=["max_new_tokens"])
    seq, generated = list(prompt), result.tokens[0]
    for step in range(budget):
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = model(torch.tensor([seq], device=device))[:, -1].float()  # (1, V)
            seen = torch.zeros(1, mc.vocab_size, dtype=torch.bool, device=device)
            seen[0, seq] = True  # every token of the context, prompt included
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long, device=device),
                                    minlength=mc.vocab_size).float()[None]  # generated tokens only
            token = int(next_token(logits, config, generator, step=step, bias=bias, seen=seen, counts=counts))
        elapsed = time.perf_counter() - t0
        if step == 0:
            result.prefill_seconds = elapsed
        else:
            result.decode_seconds += elapsed
            result.decode_tokens += 1
        seq.append(token)
        generated.append(token)
        reason = rules.check(0, generated)
        if reason is not None:
            result.stop_reasons[0] = reason
            return result
    if budget < config.max_new_tokens:
        result.stop_reasons[0] = "context_length"
    return result
