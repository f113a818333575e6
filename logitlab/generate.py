"""From logits to the next token, and the prefill/decode loop: ids in, ids out.

generate.py owns `SampleConfig` (frozen), the pure functions that turn a row of logits into
probabilities and a token id, and the loop that runs a model with a KV cache: prefill the
prompt once, then decode one token at a time using only the last position's logits. It never
sees text: stop strings arrive as bytes together with a token -> bytes table, and turning ids
into text is the tokenizer's job (the CLI joins the two).

Processing order, applied to float32 logits (B, V) by `process_logits`:
  1. logit bias (added) and banned ids (set to -inf);
  2. repetition penalty over every token already in the context, prompt included, as in CTRL
     (Keskar et al. 2019) and Hugging Face: a positive logit is divided by the penalty, a negative
     one multiplied by it;
  3. frequency and presence penalties over the generated tokens (OpenAI's definition):
     logit -= frequency * count + presence * (count > 0);
  4. temperature: logits / T; T = 0 means greedy (the argmax of steps 1-3, no randomness);
  5. top-k: keep the k largest logits;
  6. softmax (max subtracted first, so it never overflows);
  7. top-p (nucleus, Holtzman et al. 2019): keep the smallest set of most probable tokens whose
     mass reaches P, renormalise;
  8. min-p: drop tokens whose probability is below min_p times the largest one, renormalise.
Sampling then draws from those probabilities with a torch.Generator passed in.

Shapes: B batch, T positions in this call, S key/value length, V vocab.
"""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch

from logitlab.kv_cache import KVCache


def _f(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class SampleConfig:
    """How to choose each next token and when to stop. Every field has a no-op default."""

    max_new_tokens: int = _f(64, "most tokens to generate per prompt")
    temperature: float = _f(1.0, "divide logits by T before softmax; 0 = greedy (argmax)")
    top_k: int = _f(0, "keep only the k most likely tokens (0 = off)")
    top_p: float = _f(1.0, "keep the smallest set of top tokens whose mass reaches P (1 = off)")
    min_p: float = _f(0.0, "drop tokens less likely than min_p x the top token (0 = off)")
    repetition_penalty: float = _f(1.0, "CTRL-style penalty for tokens already in the context (1 = off)")
    frequency_penalty: float = _f(0.0, "subtract this x the count of each generated token")
    presence_penalty: float = _f(0.0, "subtract this once from every token generated so far")
    seed: int | None = _f(None, "seed for the sampler's torch.Generator (None = random)")
    stop_ids: tuple[int, ...] = _f((), "token ids that end generation (besides end-of-text)")
    banned_ids: tuple[int, ...] = _f((), "token ids that are never generated")
    logit_bias: tuple[tuple[int, float], ...] = _f((), "(id, bias) pairs added to the logits")
    stop_sequences: tuple[tuple[int, ...], ...] = _f((), "token-id sequences that end generation")
    stop_bytes: tuple[bytes, ...] = _f((), "byte strings that end generation (needs a token->bytes table)")

    def __post_init__(self) -> None:
        def fix(name, value):
            object.__setattr__(self, name, value)

        if isinstance(self.logit_bias, Mapping):
            fix("logit_bias", tuple(sorted((int(k), float(v)) for k, v in self.logit_bias.items())))
        fix("stop_ids", tuple(int(i) for i in self.stop_ids))
        fix("banned_ids", tuple(int(i) for i in self.banned_ids))
        fix("logit_bias", tuple((int(i), float(b)) for i, b in self.logit_bias))
        fix("stop_sequences", tuple(tuple(int(i) for i in s) for s in self.stop_sequences))
        fix("stop_bytes", tuple(s.encode() if isinstance(s, str) else bytes(s) for s in self.stop_bytes))
        checks = (
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "an integer >= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("stop_ids", all(i >= 0 for i in self.stop_ids), "non-negative token ids"),
            ("banned_ids", all(i >= 0 for i in self.banned_ids), "non-negative token ids"),
            ("stop_sequences", all(self.stop_sequences), "non-empty"),
            ("stop_bytes", all(self.stop_bytes), "non-empty"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# --------------------------------------------------------------------------------------------
# Pure functions of logits
# --------------------------------------------------------------------------------------------

def softmax(logits: torch.Tensor) -> torch.Tensor:
    """Numerically stable softmax over the last dim, in float32: exp(x - max) / sum."""
    x = logits.float()
    x = x - x.amax(dim=-1, keepdim=True)
    e = x.exp()
    return e / e.sum(dim=-1, keepdim=True)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T for T > 0 (T = 0 is greedy and handled by the caller)."""
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, set the rest to -inf (k = 0 or k >= V: no-op).
    Ties at the k-th value are all kept."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most probable tokens whose mass reaches p.

    A token is kept when the mass of the tokens ranked above it is still below p."""
    if p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # (B, V)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the row's largest, renormalise."""
    if min_p <= 0.0:
        return probs
    kept = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL / Hugging Face rule on tokens with seen (B, V) True: positive logits / penalty,
    negative logits * penalty (both move the token towards less likely for penalty > 1)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_count_penalties(logits: torch.Tensor, counts: torch.Tensor, frequency: float,
                          presence: float) -> torch.Tensor:
    """logits - frequency * count - presence * (count > 0), counts (B, V) of generated tokens."""
    if frequency == 0.0 and presence == 0.0:
        return logits
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def bias_vector(config: SampleConfig, vocab_size: int, device=None) -> torch.Tensor | None:
    """The dense (V,) float32 additive bias for logit_bias and banned ids (-inf), or None."""
    if not config.logit_bias and not config.banned_ids:
        return None
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    for token, value in config.logit_bias:
        _check_id(token, vocab_size, "logit_bias")
        bias[token] += value
    for token in config.banned_ids:
        _check_id(token, vocab_size, "banned_ids")
        bias[token] = float("-inf")
    if torch.isinf(bias).all():
        raise ValueError("banned_ids ban every token of the vocabulary")
    return bias


def _check_id(token: int, vocab_size: int, name: str) -> None:
    if not 0 <= token < vocab_size:
        raise ValueError(f"{name}: token id {token} is outside the vocabulary 0..{vocab_size - 1}")


def adjust_logits(logits: torch.Tensor, config: SampleConfig, *, bias: torch.Tensor | None = None,
                  seen: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-3 of the order above on (B, V) logits, upcast to float32."""
    x = logits.float()
    if bias is not None:
        x = x + bias
    if seen is not None:
        x = apply_repetition_penalty(x, seen, config.repetition_penalty)
    if counts is not None:
        x = apply_count_penalties(x, counts, config.frequency_penalty, config.presence_penalty)
    return x


def process_logits(logits: torch.Tensor, config: SampleConfig, *, bias: torch.Tensor | None = None,
                   seen: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, V) -> the probabilities (B, V) float32 that sampling draws from (all 8 steps).

    At temperature 0 the result is one-hot at the greedy choice."""
    x = adjust_logits(logits, config, bias=bias, seen=seen, counts=counts)
    if config.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    x = top_k_filter(apply_temperature(x, config.temperature), config.top_k)
    return min_p_filter(top_p_filter(softmax(x), config.top_p), config.min_p)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one id per row from probs (B, V) -> (B,) int64.

    Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i (the
    smallest of independent Exp(p_i) waiting times); unlike torch.multinomial it needs no
    host synchronisation. E is clamped away from 0 (a draw of exactly 0 would turn p / E into
    inf, or NaN for p = 0, which argmax would pick), so zero-probability tokens can never win."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / e.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def next_token(logits: torch.Tensor, config: SampleConfig, generator: torch.Generator | None = None,
               **state) -> torch.Tensor:
    """Logits (B, V) -> next ids (B,): greedy argmax at T = 0, otherwise a draw from
    process_logits. `state` is bias / seen / counts as in adjust_logits."""
    if config.greedy:
        return adjust_logits(logits, config, **state).argmax(dim=-1)
    return sample(process_logits(logits, config, **state), generator)


def make_generator(seed: int | None, device=None) -> torch.Generator:
    g = torch.Generator(device=device or "cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


# --------------------------------------------------------------------------------------------
# Stopping
# --------------------------------------------------------------------------------------------

STOP_REASONS = ("eot", "stop_id", "stop_sequence", "max_new_tokens", "context_length")


class _StopRules:
    """Per-row stop checks on each new id: end-of-text, stop ids, id sequences, byte strings.

    Byte strings are matched against the generated bytes only (never the prompt), keeping a tail
    of len(longest stop) - 1 bytes per row so a match split across tokens is still found."""

    def __init__(self, config: SampleConfig, rows: int, eot_id: int | None,
                 token_bytes: Callable[[int], bytes] | Sequence[bytes] | None):
        self.eot_id, self.config = eot_id, config
        self.stop_ids = set(config.stop_ids)
        if config.stop_bytes and token_bytes is None:
            raise ValueError("stop_bytes needs a token -> bytes table (token_bytes=...)")
        self.token_bytes = token_bytes if callable(token_bytes) else (
            token_bytes.__getitem__ if token_bytes is not None else None)
        self.keep = max((len(s) for s in config.stop_bytes), default=1) - 1
        self.tails = [b""] * rows

    def check(self, row: int, generated: list[int]) -> str | None:
        token = generated[-1]
        if token == self.eot_id:
            return "eot"
        if token in self.stop_ids:
            return "stop_id"
        for seq in self.config.stop_sequences:
            if len(generated) >= len(seq) and tuple(generated[-len(seq):]) == seq:
                return "stop_sequence"
        if self.config.stop_bytes:
            tail = self.tails[row] + self.token_bytes(token)
            self.tails[row] = tail[-self.keep:] if self.keep else b""
            if any(s in tail for s in self.config.stop_bytes):
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
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per row (B, 1) through the cached model -> logits (B, V) fp32.

    The caller checked the ids, so the model's own range check (a host sync) is switched off."""
    checking, model.validate_inputs = model.validate_inputs, False
    try:
        return model(token, cache=cache, positions=positions, attn_mask=attn_mask)[:, -1].float()
    finally:
        model.validate_inputs = checking


_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (weights key, step)


def _compile_options(model) -> dict:
    """Inductor options for the decode step of `model`, chosen by its device and dtype.

    On a CPU a decode step is ~40 small kernels around the matrix-vector products, so
    cpp_wrapper (the compiled graph calls its kernels from C++ rather than Python) saves
    per-kernel overhead. With bf16/fp16 weights, freezing turns the weights into constants and
    max_autotune lets inductor pick, per matrix shape, its own C++ GEMM template over prepacked
    weights (aten's bf16 matrix-vector product reads its weights more slowly per byte than the
    fp32 one here); in fp32 aten's mm is as fast, so fp32 compiles without them (faster). Frozen
    weights are why compiled steps are kept per model and rebuilt when a parameter changes
    (`compiled_decode_step`). Guards on the model's modules are skipped (a decode step checks
    ~10 per parameter): the per-model key stands in for them."""
    device, dtype = _device_dtype(model)
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if device.type == "cpu":
        options["cpp_wrapper"] = True
        if dtype in (torch.bfloat16, torch.float16):
            options.update(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return options


def _weights_key(model) -> tuple:
    """Changes when any parameter is replaced, moved, cast or written in place, or the attention
    implementation is switched."""
    return (getattr(model, "attn_impl", None),
            *((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters()))


def compiled_decode_step(model=None, backend: str = "inductor") -> Callable:
    """decode_step through torch.compile, as one graph (fullgraph: a graph break is an error)
    with dynamic shapes (the cache length grows every step, so one graph serves every step).

    With a model, the compiled step is built for that model (see _compile_options) and kept
    until its weights change; the first call compiles (tens of seconds on a CPU), later calls
    reuse it. backend="aot_eager" traces the same graph without inductor (fast; for tests).
    Without a model: one generic compiled step (default options) shared by every model."""
    if model is None:
        return _generic_compiled_step(backend)
    key = (_weights_key(model), backend)
    held = _COMPILED.get(model)
    if held is not None and held[0] == key:
        return held[1]
    options = _compile_options(model) if backend == "inductor" else {
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}

    def step(model, token, cache, positions=None, attn_mask=None):
        return decode_step(model, token, cache, positions, attn_mask)

    fn = torch.compile(step, dynamic=True, fullgraph=True, backend=backend, options=options,
                       isolate_recompiles=True)   # this model's graphs only, never another's
    _COMPILED[model] = (key, fn)
    return fn


def _step_fn(model, compile: bool | str) -> Callable:
    """compile: False (eager decode_step), True (inductor) or a torch.compile backend name."""
    if not compile:
        return decode_step
    return compiled_decode_step(model, compile if isinstance(compile, str) else "inductor")


@functools.lru_cache(maxsize=None)
def _generic_compiled_step(backend: str) -> Callable:
    return torch.compile(decode_step, dynamic=True, fullgraph=True, backend=backend)


def _check_prompts(prompts: Sequence[Sequence[int]], model_config, max_new_tokens: int) -> int:
    """Validate prompts; return how many new tokens fit in the context."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token id")
    V, ctx = model_config.vocab_size, model_config.context_length
    for p in prompts:
        for token in p:
            _check_id(int(token), V, "prompt")
    longest = max(len(p) for p in prompts)
    if longest >= ctx:
        raise ValueError(f"prompt of {longest} tokens leaves no room in the context of {ctx} tokens")
    return min(max_new_tokens, ctx - longest)


def _device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


def _steps(model, prompts: Sequence[Sequence[int]], config: SampleConfig, *, eot_id: int | None,
           token_bytes, generator: torch.Generator | None, result: GenerationResult,
           decode_fn: Callable = decode_step) -> Iterator[list[int | None]]:
    """The cached loop for B prompts: yields each step's ids per row (None for finished rows)
    and fills `result` as it goes. Left padding + attn_mask (B, S) + per-row positions."""
    mc = model.config
    budget = _check_prompts(prompts, mc, config.max_new_tokens)
    device, dtype = _device_dtype(model)
    B, lengths = len(prompts), [len(p) for p in prompts]
    S0 = max(lengths)
    pad = [S0 - n for n in lengths]
    generator = generator or make_generator(config.seed, device)
    rules = _StopRules(config, B, eot_id, token_bytes)
    with torch.no_grad():
        ids = torch.zeros(B, S0, dtype=torch.long)  # (B, S0), left padded with id 0
        for b, p in enumerate(prompts):
            ids[b, pad[b]:] = torch.tensor(list(p), dtype=torch.long)
        ids = ids.to(device)
        offsets = torch.tensor(pad, device=device)[:, None]  # (B, 1)
        positions = (torch.arange(S0, device=device)[None, :] - offsets).clamp_(min=0)  # (B, S0)
        cache = KVCache.for_model(mc, batch_size=B, max_len=S0 + budget, dtype=dtype, device=device)
        mask = None
        if any(pad):  # (B, S_max) True = real key slot; only needed when rows are padded
            mask = torch.arange(S0 + budget, device=device)[None, :] >= offsets
        bias = bias_vector(config, mc.vocab_size, device)
        seen = counts = None
        if config.repetition_penalty != 1.0:
            seen = torch.zeros(B, mc.vocab_size, dtype=torch.bool, device=device)
            seen.scatter_(1, ids, True)
            seen[:, 0] = torch.tensor([any(t == 0 for t in p) for p in prompts], device=device)
        if config.frequency_penalty or config.presence_penalty:
            counts = torch.zeros(B, mc.vocab_size, dtype=torch.float32, device=device)
            ones = torch.ones(B, 1, device=device)  # (B, 1) added at each step's ids
        state = dict(bias=bias, seen=seen, counts=counts)

        t0 = time.perf_counter()
        logits = prefill(model, ids, cache, positions, None if mask is None else mask[:, :S0])
        token = next_token(logits, config, generator, **state)  # (B,)
        position = positions[:, -1:] + 1  # (B, 1) position of the token fed next
    generated: list[list[int]] = [[] for _ in range(B)]
    active = [True] * B
    for step in range(budget):
        if step == 0:
            new = token.tolist()  # the one host synchronisation per step
            result.prefill_seconds = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            with torch.no_grad():
                if seen is not None:
                    seen.scatter_(1, token[:, None], True)
                if counts is not None:
                    counts.scatter_add_(1, token[:, None], ones)
                logits = decode_fn(model, token[:, None], cache, position, mask)
                token = next_token(logits, config, generator, **state)
                position += 1
            new = token.tolist()
            result.decode_seconds += time.perf_counter() - t0
            result.decode_tokens += sum(active)
        out: list[int | None] = []
        for b in range(B):
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
        yield out
        if not any(active):
            break
    for b in range(B):
        if active[b]:
            hit_context = budget < config.max_new_tokens
            result.stop_reasons[b] = "context_length" if hit_context else "max_new_tokens"


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

    def __init__(self, model, prompt_ids: Sequence[int], config: SampleConfig, compile: bool | str = False, **kw):
        self.result = GenerationResult(tokens=[[]], stop_reasons=[""])
        step = _step_fn(model, compile)
        self._steps = _steps(model, _as_batch(prompt_ids)[:1], config, result=self.result, decode_fn=step,
                             **kw)

    def __iter__(self) -> Iterator[int]:
        for out in self._steps:
            if out[0] is not None:
                yield out[0]


def stream(model, prompt_ids: Sequence[int], config: SampleConfig = SampleConfig(), *,
           eot_id: int | None = None, token_bytes=None, generator: torch.Generator | None = None,
           compile: bool | str = False) -> Stream:
    """Generate for one prompt, yielding each id as soon as it is chosen."""
    return Stream(model, prompt_ids, config, compile, eot_id=eot_id, token_bytes=token_bytes,
                  generator=generator)


def generate(model, prompt_ids, config: SampleConfig = SampleConfig(), *, eot_id: int | None = None,
             token_bytes=None, generator: torch.Generator | None = None,
             use_cache: bool = True, compile: bool | str = False) -> GenerationResult:
    """Generate for one prompt (list of ids) or a batch (list of lists, any lengths).

    `eot_id` ends a row; `token_bytes` (id -> bytes, callable or sequence) is needed only for
    config.stop_bytes. use_cache=False runs the reference path (a full forward per step), one
    prompt at a time. compile=True runs the decode step through torch.compile (inductor; see
    compiled_decode_step), a string names another backend ("aot_eager")."""
    prompts = _as_batch(prompt_ids)
    if not use_cache:
        results = [generate_reference(model, p, config, eot_id=eot_id, token_bytes=token_bytes,
                                      generator=generator) for p in prompts]
        return GenerationResult([r.tokens[0] for r in results], [r.stop_reasons[0] for r in results],
                                sum(r.prefill_seconds for r in results),
                                sum(r.decode_seconds for r in results),
                                sum(r.decode_tokens for r in results))
    result = GenerationResult(tokens=[[] for _ in prompts], stop_reasons=[""] * len(prompts))
    step = _step_fn(model, compile)
    for _ in _steps(model, prompts, config, eot_id=eot_id, token_bytes=token_bytes,
                    generator=generator, result=result, decode_fn=step):
        pass
    return result


def generate_reference(model, prompt_ids: Sequence[int], config: SampleConfig = SampleConfig(), *,
                       eot_id: int | None = None, token_bytes=None,
                       generator: torch.Generator | None = None) -> GenerationResult:
    """The slow, obviously correct path: no cache, the whole sequence through the model at every
    step, the last position's logits through the same next_token. One prompt."""
    prompt = _as_batch(prompt_ids)[0]
    mc = model.config
    budget = _check_prompts([prompt], mc, config.max_new_tokens)
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
            token = int(next_token(logits, config, generator, bias=bias, seen=seen, counts=counts))
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
