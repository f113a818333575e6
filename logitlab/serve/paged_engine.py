"""The paged engine: continuous batching over a paged KV cache, with prefix caching and chunked prefill.

paged_engine.py owns the scheduling; the blocks, their sharing and the attention over them are
model/paged.py's and model/paged_blocks.py's. It has engine.py's public side (submit, cancel,
start, close, set_paused, running, waiting, stats) and its events, and differs in what a step does:

  1. **admit** waiting requests (first come, first served, up to max_batch rows) while the pool
     has the blocks their prompt and budget may need (reserved, so a running request never runs
     out). Each new sequence first shares the longest run of cached full blocks of its prompt
     (prefix caching: a system prompt every request starts with is computed once, then found by
     its chained hash). A request whose next uncached block is being computed right now by an
     earlier request waits one step for it rather than computing it too;
  2. **decode** every row that has its first token: one forward of (B, 1) ids over the blocks,
     each row at its own position, each picking its token with its own SampleConfig and generator
     (the plain greedy rows together, in one argmax over the batch: _choose_rows);
  3. **prefill** up to `chunk_tokens` prompt positions of the rows still reading their prompt, in
     chunks (a long prompt takes several steps, and the running rows get a token in each of them),
     batched with right padding (the same length per forward for Gated DeltaNet rows). A row whose
     prompt is done gets its first token from this forward.
A row that finishes gives its blocks back at once (its full blocks stay cached for later prompts,
LRU). Nobody is ever prefilled twice: `stats["tokens_recomputed"]` stays 0 except for the last
prompt position of a prompt that is entirely cached (it is fed again for its logits).

Shapes: B rows in a forward, T new positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitlab.model.paged import PagedCache, PagedSequence, run
from logitlab.model.paged_blocks import block_hashes
from logitlab.serve.engine import DoneEvent, Engine, Request, TokenEvent


def _plain_greedy(r: Request) -> bool:
    """Greedy, and nothing of its own between the logits and the argmax or in its event."""
    c = r.config
    return (c.greedy and r.state.get("bias") is None and c.repetition_penalty == 1.0 and not c.frequency_penalty
            and not c.presence_penalty and not r.top_logprobs)


@dataclass(eq=False)
class _Row:
    request: Request
    seq: PagedSequence
    reserve: int                 # blocks it may still allocate (reserved at admission)
    hashes: list                 # the chained hashes of its prompt's full blocks

    @property
    def reading(self) -> bool:
        """Still feeding its prompt (no token yet)."""
        return not self.request.generated


class PagedEngine(Engine):
    """Batches requests to one model over a PagedCache (see the module docstring).

    block_size positions per block; cache_blocks blocks in the pool (the memory budget, at least one
    whole context; default room for max_batch whole contexts); chunk_tokens prompt positions prefilled per step;
    prefix_caching shares full prompt blocks (forced off for Gated DeltaNet models); gather
    "index" or "reference" (model/paged.py)."""

    def __init__(self, model, *, eot_id: int | None = None, token_bytes=None, max_batch: int = 16,
                 block_size: int = 16, cache_blocks: int | None = None, chunk_tokens: int = 128,
                 prefix_caching: bool = True, gather: str = "index"):
        super().__init__(model, eot_id=eot_id, token_bytes=token_bytes, max_batch=max_batch)
        for name, value in (("block_size", block_size), ("chunk_tokens", chunk_tokens),
                            ("cache_blocks", 1 if cache_blocks is None else cache_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        full = -(-self.context // block_size) + 1          # one whole context, and a block to copy on write
        if cache_blocks is not None and cache_blocks < full:
            raise ValueError(f"cache_blocks ({cache_blocks}) must hold one request of the whole context: at least "
                             f"{full} blocks of {block_size} positions")
        n_blocks = cache_blocks or max_batch * full
        self.cache = PagedCache(model, n_blocks, block_size, max_seqs=max_batch,
                                prefix_caching=prefix_caching, gather=gather)
        self.chunk_tokens = chunk_tokens
        self._rows: list[_Row] = []
        self.stats.update(decodes=0, prefill_chunks=0, prefill_tokens=0, prefix_hit_tokens=0)
        self._gauges()

    def _gauges(self) -> None:
        """stats' view of the cache now: blocks in use (referenced), cached (unreferenced, kept for
        prefix hits), total; prefix hits in blocks; evictions; copy-on-write copies."""
        blocks = self.cache.blocks
        self.stats.update(blocks_in_use=blocks.in_use, blocks_cached=len(blocks.lru), blocks_total=blocks.n_blocks,
                          block_size=blocks.block_size, prefix_hits=blocks.hits, evictions=blocks.evictions,
                          cow_copies=self.cache.copies)

    @property
    def running(self) -> int:
        return len(self._rows)

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit, decode, prefill (see the module docstring) -> whether it did anything (a token or
        a prompt chunk)."""
        self._admit()
        self._drop_finished()
        if not self._rows:
            return False
        with torch.inference_mode():
            chunks = self.stats["prefill_chunks"]
            produced = self._decode_rows() + self._prefill_rows()
        self._drop_finished()
        self._gauges()
        c = self.stats
        c["steps"] += 1
        c["max_rows"] = max(c["max_rows"], produced)
        c["shared_steps"] += produced > 1
        return produced > 0 or c["prefill_chunks"] > chunks

    def _admit(self) -> None:
        with self._lock:
            waiting = list(self._inbox)
        admitted = []
        busy = {h for row in self._rows if row.reading for h in row.hashes[len(row.seq.hashes):]}
        for r in waiting:
            if self._drop_cancelled(r):
                admitted.append(r)
                continue
            if len(self._rows) >= self.max_batch:
                break
            hashes = block_hashes(r.prompt, self.cache.block_size) if self.cache.prefix_caching else []
            cached = next((i for i, h in enumerate(hashes) if h not in self.cache.blocks.by_hash), len(hashes))
            if cached < len(hashes) and hashes[cached] in busy:
                continue                                # its prefix is being computed: share it next step
            seq = self.cache.start(r.prompt)
            need = self.cache.blocks_for(len(r.prompt) + r.budget) - len(seq.table) + 1   # +1: a copy on write
            if need > self.cache.blocks.available - sum(row.reserve for row in self._rows):
                self.cache.finish(seq)
                break                                   # first come, first served: wait for blocks
            self.stats["prefix_hit_tokens"] += seq.reused
            if len(seq.table) * self.cache.block_size > seq.reused:   # all of it cached: its last id is fed again
                self.stats["tokens_recomputed"] += len(r.prompt) - seq.reused
            self._rows.append(_Row(r, seq, need, hashes))
            busy.update(hashes[cached:])
            admitted.append(r)
        with self._lock:
            for r in admitted:
                self._inbox.remove(r)

    def _drop_finished(self) -> None:
        """Rows that finished or were cancelled give their blocks back."""
        keep = []
        for row in self._rows:
            if self._drop_cancelled(row.request) or row.request.finished:
                self.cache.finish(row.seq)
            else:
                keep.append(row)
        self._rows = keep

    def _forward(self, rows: list[_Row], feeds: list[list[int]]) -> torch.Tensor:
        """One forward of these rows feeding these ids -> (B, V) logits at each row's last id."""
        for row, ids in zip(rows, feeds):
            before = len(row.seq.table)
            self.cache.prepare(row.seq, len(ids))
            row.reserve -= len(row.seq.table) - before
        return run(self.model, self.cache.view([row.seq for row in rows], feeds))

    def _decode_rows(self) -> int:
        rows = [row for row in self._rows if not row.reading and not row.request.finished]
        if not rows:
            return 0
        logits = self._forward(rows, [[row.request.ids[-1]] for row in rows])              # (B, V)
        self.stats["decodes"] += 1
        return self._choose_rows([row.request for row in rows], logits)

    def _prefill_rows(self) -> int:
        """Up to chunk_tokens prompt positions of the reading rows, in as few forwards as padding allows."""
        left, chunks = self.chunk_tokens, []
        for row in self._rows:
            if row.reading and left > 0:
                start = row.seq.length
                take = min(len(row.request.prompt) - start, left)
                chunks.append((row, row.request.prompt[start:start + take]))
                left -= take
        produced = 0
        for group in self._groups(chunks):
            logits = self._forward([row for row, _ in group], [ids for _, ids in group])     # (B, V)
            self.stats["prefill_chunks"] += len(group)
            self.stats["prefill_tokens"] += sum(len(ids) for _, ids in group)
            done = [b for b, (row, _) in enumerate(group) if row.seq.length == len(row.request.prompt)]
            if done:                                                                       # prompts now in
                produced += self._choose_rows([group[b][0].request for b in done], logits[done])
        return produced

    def _choose_rows(self, requests: list[Request], logits: torch.Tensor) -> int:
        """Each request's next token from its row of logits (B, V) -> how many got one. The greedy
        requests with nothing of their own to apply (no logit bias, penalties or top alternatives)
        share one max and one log-softmax over their rows: the tokens and log-probabilities that
        Engine._choose_one gives row by row (a row-wise max and log-softmax do not depend on the
        other rows), in a handful of tensor operations per step instead of a dozen per row. Every
        other request, and a row with no finite maximum (its error event), goes through _choose_one."""
        plain = [b for b, r in enumerate(requests) if _plain_greedy(r)]
        chosen = {}
        if plain:
            x = logits if len(plain) == len(requests) else logits[plain]                  # (Bp, V) float32
            top, ids = x.max(dim=-1)                                                       # (Bp,) as pick's
            logprob = torch.log_softmax(x, dim=-1).gather(1, ids[:, None])[:, 0]           # (Bp,)
            ok = torch.isfinite(top).tolist()
            chosen = {b: (t, lp) for b, t, lp, good in zip(plain, ids.tolist(), logprob.tolist(), ok) if good}
        produced = 0
        for b, r in enumerate(requests):
            if b not in chosen:
                produced += self._choose_one(r, logits[b:b + 1])
                continue
            token, lp = chosen[b]
            r.generated.append(token)
            r.emit(TokenEvent(token, lp))
            reason = self._stop_reason(r, token)
            if reason is not None:
                self._finish(r, DoneEvent(reason))
            produced += 1
        return produced

    def _groups(self, chunks: list) -> list[list]:
        """Chunks batched into forwards: equal lengths only with Gated DeltaNet state (no padding);
        else padding at most as many positions as real ones, and cached + new within the context."""
        groups: list[list] = []
        for row, ids in sorted(chunks, key=lambda c: len(c[1])):
            if groups:
                g = groups[-1]
                T = max(len(ids), max(len(i) for _, i in g))
                L = max(row.seq.length, max(r.seq.length for r, _ in g))
                real = len(ids) + sum(len(i) for _, i in g)
                same = len(ids) == len(g[0][1]) or not self.cache.has_state
                if same and (len(g) + 1) * T <= 2 * real and L + T <= self.context:
                    g.append((row, ids))
                    continue
            groups.append([(row, ids)])
        return groups

    def _fail_all(self, message: str) -> None:
        with self._lock:
            waiting = list(self._inbox)
            self._inbox.clear()
        for r in [row.request for row in self._rows] + waiting:
            if not r.finished:
                self._finish(r, DoneEvent("error", message))
        for row in self._rows:
            self.cache.finish(row.seq)
        self._rows = []
