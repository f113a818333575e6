"""The batching engine: many requests, one batched decode.

engine.py owns turning requests (prompt ids + SampleConfig) into token events. It never sees text or HTTP; app.py
does. The batch holds one row per request in one KV cache of its rows' prompts and budgets (rounded up to
CACHE_ROUNDING slots, at most the context), rows left-aligned to end at the same slot, each with its own positions
(0.. from its first id) and a key mask hiding the slots before it. One scheduler step (`Engine.step`) either

  - **decodes**: each row's last token goes through the model over the shared cache, (B, 1) ids ->
    (B, V) logits; a request that is waiting then **joins** in the slot of a finished row: it is
    prefilled alone, its keys and values are copied into that row so that they end at the current
    slot, and its first token comes from that prefill. Nobody else recomputes anything; or
  - **rebuilds** the batch, when there is no slot to join (no finished row, a prompt longer than
    the rows so far, a budget past the cache, or a cache with other than full-attention layers),
    when finished rows outnumber the live ones (and are at least COMPACT_AFTER), or when the cache
    is full: every live row's ids so far (prompt plus generated) are left-padded into one (B, S0)
    batch and one prefill gives each row the logits of its next token.
Then each live row picks its token with its own SampleConfig and torch.Generator (logitlab.generate's `pick`,
with its penalties' state), and its request gets an event. A new request therefore joins the running batch at
the next step and never waits for another to finish; a finished one stops being sampled at once and frees its
slot for the next arrival.

`Engine.stats` counts steps, rebuilds, inserts (joins without a rebuild), the rows per step and the tokens a rebuild
computed again. With `speculative=(draft, k)` a request alone is decoded speculatively (solo.py: rounds, drafts
accepted). paged_engine.py is the engine that never rebuilds. Tests drive `step` by hand; `start()` runs it in a
thread that sleeps while there is nothing to do. Shapes: B rows, S0 longest row, S key slots, V vocab.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from logitlab.generate.loop import decode_step, prefill
from logitlab.generate.sampling import SampleConfig, bias_vector, invalid_cause, make_generator, pick
from logitlab.generate.stops import StopMatcher, StopStrings
from logitlab.model.cache import KVCache
from logitlab.serve import solo as solo_mod

# Rows that finished stay in the batch (fed a dummy token) until a rebuild; a rebuild only to drop them
# happens once they are at least this many and as many as the live rows (it prefills every live row).
COMPACT_AFTER = 4
CACHE_ROUNDING = 256   # a rebuilt batch's cache slots: a multiple of this (room for requests that join later)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, log-probability under the model, and the top alternatives
    [(id, logprob), ...] when the request asked for them."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class DoneEvent:
    """The end of a request: finish_reason "stop" (end-of-text, a stop id or stop string) or
    "length" (max_new_tokens or the context), or "error" with the message."""

    finish_reason: str
    error: str | None = None


@dataclass(eq=False)
class Request:
    """A request as the engine keeps it. `emit` is called from the engine's thread with each event."""

    prompt: list[int]
    config: SampleConfig
    emit: Callable[[object], None]
    top_logprobs: int = 0
    id: int = 0
    budget: int = 0                     # tokens it may still generate (fits the context)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    generator: torch.Generator | None = None
    state: dict = field(default_factory=dict)  # pick's bias / seen / counts, (V,) and (1, V)
    sequences: StopMatcher | None = None  # progress through its stop id sequences (stops.py)
    strings: StopMatcher | None = None    # progress through its stop strings, over the bytes generated

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.generated


@dataclass
class _Batch:
    rows: list[Request]
    cache: KVCache
    mask: torch.Tensor          # (B, S) True where a row has a real key
    position: torch.Tensor      # (B, 1) position of each row's next fed token
    dead: int = 0


class Engine:
    """Batches requests to one model. eot_id and stop_ids end a row (finish "stop"); token_bytes
    (id -> bytes) is needed for configs with stop_bytes. max_batch caps the rows of one batch."""

    def __init__(self, model, *, eot_id: int | None = None, token_bytes=None, max_batch: int = 16,
                 speculative: tuple | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.model, self.eot_id, self.token_bytes, self.max_batch = model, eot_id, token_bytes, max_batch
        self.context = model.config.context_length
        self.stats = dict(steps=0, rebuilds=0, inserts=0, decodes=0, max_rows=0, shared_steps=0, cancelled=0,
                          speculative_rounds=0, drafted=0, accepted=0, tokens_recomputed=0)
        # (draft, k): a request alone in the engine is decoded speculatively (speculative.py); see _solo_step
        self.speculative = speculative
        self._solo = None                                   # (request, its SpeculativeStream, its rounds)
        self._inbox: deque[Request] = deque()
        self._batch: _Batch | None = None
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.paused = False

    # --- the public side (any thread) ----------------------------------------------------------

    def submit(self, prompt: list[int], config: SampleConfig, emit: Callable[[object], None],
               top_logprobs: int = 0) -> Request:
        """Queue a request; ValueError for a prompt that is empty, out of the vocabulary or leaves no room in
        the context, or stop strings without token_bytes. max_new_tokens beyond the context is cut (finish "length")."""
        V = self.model.config.vocab_size
        prompt = [int(i) for i in prompt]
        if not prompt:
            raise ValueError("the prompt encodes to no tokens")
        bad = [i for i in prompt if not 0 <= i < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        if len(prompt) >= self.context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {self.context}, which "
                             f"leaves no room to generate")
        if config.stop_bytes and self.token_bytes is None:
            raise ValueError("stop strings need the engine's token_bytes")
        device = next(self.model.parameters()).device
        sequences, strings = StopStrings(config.stop_sequences), StopStrings(config.stop_bytes)
        request = Request(prompt, config, emit, top_logprobs, next(self._ids),
                          min(config.max_new_tokens, self.context - len(prompt)),
                          generator=make_generator(config.seed, device),
                          state=dict(bias=bias_vector(config, V, device), seen=None, counts=None),
                          sequences=sequences.matcher() if sequences else None,
                          strings=strings.matcher() if strings else None)
        with self._lock:
            self._inbox.append(request)
            self._lock.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Stop generating for `request` (a client went away); its row leaves at the next rebuild."""
        request.cancelled = True
        with self._lock:
            self._lock.notify_all()

    def start(self) -> None:
        """Run `step` in a daemon thread until `close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="logitlab-engine", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def set_paused(self, paused: bool) -> None:
        """While paused the thread takes no step (requests queue up); for tests and draining."""
        with self._lock:
            self.paused = paused
            self._lock.notify_all()

    waiting = property(lambda self: len(self._inbox))

    @property
    def running(self) -> int:
        b, solo = self._batch, self._solo
        return (0 if b is None else sum(not (r.finished or r.cancelled) for r in b.rows)) + (solo is not None)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and (self.paused or (not self._inbox and not self.running)):
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001  nothing may kill the thread: fail the rows instead
                self._fail_all(f"{type(exc).__name__}: {exc}")

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler step (see the module docstring) -> whether any row produced a token."""
        with self._lock:
            joining = []
            room = self.max_batch - self.running
            while self._inbox and len(joining) < room:
                joining.append(self._inbox.popleft())
        joining = [r for r in joining if not self._drop_cancelled(r)]
        if self._solo_step(joining):
            return True
        b = self._batch
        for r in [] if b is None else b.rows:
            self._drop_cancelled(r)
        live = [] if b is None else [r for r in b.rows if not (r.finished or r.cancelled)]
        if not live and not joining:
            self._batch = None
            return False
        with torch.inference_mode():
            plan = self._plan(b, live, joining)
            if plan is None:  # the live rows' ids so far (all but the newest token) are computed again
                self.stats["tokens_recomputed"] += sum(len(r.ids) - 1 for r in live)
                logits = self._rebuild(live + joining)
            else:
                logits = self._decode(b)                                               # (B, V)
                for slot, r in plan:
                    logits[slot] = self._insert(b, slot, r)[0]
            produced = self._choose(logits)
        self.stats["steps"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], produced)
        self.stats["shared_steps"] += produced > 1  # steps in which more than one request got a token
        return produced > 0

    # --- one request alone: speculative decoding -----------------------------------------------

    def _solo_step(self, joining: list[Request]) -> bool:
        """With `speculative` set, a request alone in the engine runs one speculative round per step
        (solo.py); when another arrives it rejoins the batch. -> whether this step was such a round."""
        solo = self._solo
        if solo is not None and (joining or self._inbox or solo[0].finished or solo[0].cancelled):
            self._solo = None
            if not self._drop_cancelled(solo[0]) and not solo[0].finished:
                joining.insert(0, solo[0])                  # back to the batch with everyone else
            return False
        if solo is None:
            alone = joining + [r for r in (self._batch.rows if self._batch else []) if not (r.finished or r.cancelled)]
            if self.speculative is None or self._inbox or len(alone) != 1 or not solo_mod.suits(alone[0].config):
                return False
            self._solo, self._batch = solo_mod.start(self.model, alone[0], *self.speculative), None
            solo = self._solo
        with torch.inference_mode():
            reason = solo_mod.round(self, *solo)
        if reason is not None:
            self._solo = None
            self._finish(solo[0], DoneEvent(reason))
        return True

    def _drop_cancelled(self, request: Request) -> bool:
        """A cancelled request that has not been told so yet gets its last event -> whether cancelled."""
        if request.cancelled and not request.finished:
            self.stats["cancelled"] += 1
            self._finish(request, DoneEvent("cancelled"))
        return request.cancelled

    def _plan(self, b: _Batch | None, live: list[Request], joining: list[Request]) -> list | None:
        """How this step goes: None for a rebuild, else [(slot, request), ...] to insert after
        the decode (empty: a plain decode). A request is inserted into a finished row's slot when
        the cache holds only full-attention layers, its ids fit before the current slot and its
        budget fits after it; otherwise everyone is rebuilt."""
        if b is None or not live or b.cache.length >= b.cache.max_len:
            return None
        dead = [slot for slot, r in enumerate(b.rows) if r.finished or r.cancelled]
        if len(dead) >= max(COMPACT_AFTER, len(live)):
            return None
        if not joining:
            return []
        cache = b.cache
        plain = not getattr(cache, "rotates_keys", False) and all(
            t == "full_attention" for t in getattr(cache, "layer_types", ("full_attention",)))
        here = cache.length + 1                             # the slot after this step's decode
        fits = [len(r.ids) <= here and here + r.budget - 1 <= cache.max_len for r in joining]
        if not plain or len(joining) > len(dead) or not all(fits):
            return None
        return list(zip(dead, joining))

    def _insert(self, b: _Batch, slot: int, r: Request) -> torch.Tensor:
        """Prefill r alone and copy its keys and values into row `slot` of the batch's cache, ending
        at the current slot L: slots [L - n, L) hold its n ids (at positions 0..n-1, as alone), the
        mask hides the rest of the row -> (1, V) logits of its first token."""
        device = b.position.device
        n, L = len(r.ids), b.cache.length
        alone = KVCache.for_model(self.model, batch_size=1, max_len=n)
        logits = prefill(self.model, torch.tensor([r.ids], device=device), alone)          # (1, V)
        for big, small in zip(b.cache.layers, alone.layers):   # keys and values, or MLA's latent rows
            for big_t, t in zip(big.tensors(), small.tensors()):                           # (B, Hkv|1, S, Dh|R+Dr)
                big_t[slot, :, L - n:L] = t[0, :, :n]
        b.mask[slot] = torch.arange(b.mask.shape[1], device=device) >= L - n               # (S,)
        b.position[slot, 0] = n
        b.rows[slot] = r
        self.stats["inserts"] += 1
        return logits

    def _rebuild(self, rows: list[Request]) -> torch.Tensor:
        """Left-pad every row's ids into one batch, prefill it -> (B, V) logits of each next token."""
        device = next(self.model.parameters()).device
        lengths = [len(r.ids) for r in rows]
        S0 = max(lengths)
        need = S0 + max(max(1, r.budget - len(r.generated)) for r in rows)   # the rows' own budgets, rounded up
        S = min(self.context, -(-need // CACHE_ROUNDING) * CACHE_ROUNDING)
        ids = torch.zeros(len(rows), S0, dtype=torch.long)                                  # (B, S0)
        for b, r in enumerate(rows):
            ids[b, S0 - lengths[b]:] = torch.tensor(r.ids)
        offsets = torch.tensor([S0 - n for n in lengths], device=device)[:, None]        # (B, 1)
        positions = (torch.arange(S0, device=device)[None, :] - offsets).clamp_(min=0)   # (B, S0)
        mask = torch.arange(S, device=device)[None, :] >= offsets                        # (B, S)
        cache = KVCache.for_model(self.model, batch_size=len(rows), max_len=S)
        logits = prefill(self.model, ids.to(device), cache, positions, mask[:, :S0])        # (B, V)
        self._batch = _Batch(rows, cache, mask, positions[:, -1:] + 1)
        self.stats["rebuilds"] += 1
        return logits

    def _decode(self, b: _Batch) -> torch.Tensor:
        device = b.position.device
        last = torch.tensor([r.ids[-1] if not (r.finished or r.cancelled) else 0 for r in b.rows],
                            device=device)[:, None]                                    # (B, 1)
        logits = decode_step(self.model, last, b.cache, b.position, b.mask)             # (B, V)
        b.position = b.position + 1
        self.stats["decodes"] += 1
        return logits

    def _choose(self, logits: torch.Tensor) -> int:
        """Each live row's token from its row of logits (B, V) -> how many rows got a token."""
        produced = 0
        for b, r in enumerate(self._batch.rows):
            if not (r.finished or r.cancelled):
                produced += self._choose_one(r, logits[b:b + 1])
        return produced

    def _choose_one(self, r: Request, row: torch.Tensor) -> bool:
        """r's next token from its (1, V) logits, its event and its stop checks -> whether it got one."""
        self._penalty_state(r, row.shape[-1], row.device)
        token = int(pick(row, r.config, r.generator, **r.state)[0])
        if token < 0:
            self._finish(r, DoneEvent("error", "cannot choose the next token: "
                                      + invalid_cause(row, 0, r.config, **r.state)))
            return False
        r.generated.append(token)
        r.emit(self._event(row[0], token, r.top_logprobs))
        reason = self._stop_reason(r, token)
        if reason is not None:
            self._finish(r, DoneEvent(reason))
        return True

    @staticmethod
    def _event(logits: torch.Tensor, token: int, k: int) -> TokenEvent:
        lp = torch.log_softmax(logits.float(), dim=-1)                                 # (V,)
        top = ()
        if k:
            values, ids = lp.topk(min(k, lp.shape[-1]))
            top = tuple(zip(ids.tolist(), values.tolist()))
        return TokenEvent(token, float(lp[token]), top)

    def _penalty_state(self, r: Request, V: int, device) -> None:
        """The (1, V) seen / counts tensors of pick's penalties, over this row's ids so far."""
        if r.config.repetition_penalty != 1.0:
            seen = torch.zeros(1, V, dtype=torch.bool, device=device)
            seen[0, torch.tensor(r.ids, device=device)] = True
            r.state["seen"] = seen
        if r.config.frequency_penalty or r.config.presence_penalty:
            counts = torch.zeros(1, V, dtype=torch.float32, device=device)
            if r.generated:
                counts[0].index_add_(0, torch.tensor(r.generated, device=device),
                                     torch.ones(len(r.generated), device=device))
            r.state["counts"] = counts

    def _stop_reason(self, r: Request, token: int) -> str | None:
        c = r.config
        if token == self.eot_id or token in c.stop_ids:
            return "stop"
        if r.sequences is not None and r.sequences.feed((token,)) is not None:
            return "stop"
        if r.strings is not None and r.strings.feed(self.token_bytes(token)) is not None:
            return "stop"
        if len(r.generated) >= r.budget:
            return "length"
        return None

    def _finish(self, r: Request, event: DoneEvent) -> None:
        r.finished = True
        r.emit(event)

    def _fail_all(self, message: str) -> None:
        rows = [] if self._batch is None else self._batch.rows
        with self._lock:
            rows = rows + list(self._inbox)
            self._inbox.clear()
        for r in rows:
            if not r.finished:
                self._finish(r, DoneEvent("error", message))
        self._batch = None
