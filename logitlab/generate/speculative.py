"""Speculative decoding: a cheap guess of the next k tokens, checked by the target model in one pass.

speculative.py owns the loop. Each round a drafter proposes d_1..d_k after the sequence so far;
the target model runs once over [last token, d_1..d_k] (k + 1 positions, one forward instead of
k + 1) and gives its distributions p_0..p_k; the drafts are accepted from the left while the target
agrees, the first disagreement is replaced by a token of the target's own, and when all k pass the
target's p_k gives one more. Every round therefore yields between 1 and k + 1 tokens for one
target forward.

Agreement (Leviathan et al. 2023; Chen et al. 2023), with q_i the drafter's distribution for d_i:
- greedy (temperature 0): accept d_i while it is the target's argmax; the first one that is not
  is replaced by that argmax. The output is the target's own greedy output.
- sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection draw
  from the residual max(0, p_i - q_i), renormalised. Each emitted token is then distributed exactly
  as p, so the output has the target's distribution, whatever the drafter (tests/test_speculative.py
  checks this with a chi-square test).
p and q are the full sampling distributions (temperature, top-k, top-p, min-p, logit bias), the
same function of the logits as the plain loop's (sampling.process_logits).

Drafters:
- NgramDraft (prompt lookup): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens (n from max_n down to min_n); it needs no second model and costs nothing
  on a CPU, and pays on text that repeats its context (code, edits, quotes). Its q is one-hot.
- ModelDraft: a smaller model sharing the target's tokenizer, run on its own cache; q is its
  distribution under the same settings.

Going back: a cache of full-attention layers forgets the rejected positions by moving its length
(KVCache.rewind). A sliding window or a Gated DeltaNet state is overwritten as it advances, so
for those a copy is taken before the pass (KVCache.snapshot) and, after a rejection, restored and
the accepted tokens fed again (_Runner.truncate).

Repetition, frequency and presence penalties depend on every earlier token, position by
position, and are refused here. Shapes: T positions in a pass, V vocabulary, k drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from logitlab.generate.checks import check_generates, check_prompts
from logitlab.generate.loop import GenerationResult, _as_batch, _StopRules
from logitlab.generate.sampling import (
    SampleConfig,
    bias_vector,
    make_generator,
    next_token,
    process_logits,
    sample,
)
from logitlab.model.cache import KVCache


@dataclass
class SpeculativeResult(GenerationResult):
    """A GenerationResult with the drafting record: drafts proposed and accepted, and target passes
    after the prefill (each yields 1 to k + 1 tokens)."""

    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Decoded tokens per target forward after the prefill (1.0: no gain over the plain loop)."""
        return self.decode_tokens / self.target_passes if self.target_passes else float("nan")


class _Runner:
    """A model with its cache and the tokens the cache holds, which can go back to a shorter
    prefix (rewind, or restore a snapshot and feed the kept tokens again)."""

    def __init__(self, model, budget: int, start: Sequence[int]):
        self.model, self.tokens = model, []
        p = next(model.parameters())
        self.cache = KVCache.for_model(model.config, batch_size=1, max_len=min(len(start) + budget + 1,
                                       model.config.context_length), dtype=p.dtype, device=p.device)
        self.device, self.mark_ = p.device, None

    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run `tokens` after those held -> their logits (T, V) float32."""
        ids = torch.tensor([list(tokens)], device=self.device)
        logits = self.model(ids, cache=self.cache, check_values=False)[0].float()
        self.tokens += list(tokens)
        return logits

    def mark(self) -> None:
        """Remember this point, for a cache that cannot simply rewind."""
        self.mark_ = None if self.cache.can_rewind else (len(self.tokens), self.cache.snapshot())

    def truncate(self, n: int) -> None:
        """Keep the first n tokens held (n no less than at the last mark)."""
        if n >= len(self.tokens):
            return
        if self.cache.can_rewind:
            self.cache.rewind(n)
            self.tokens = self.tokens[:n]
            return
        held, snapshot = self.mark_
        kept = self.tokens[held:n]
        self.cache.restore(snapshot)
        self.tokens = self.tokens[:held]
        if kept:
            self.feed(kept)


# --------------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------------

class NgramDraft:
    """Prompt-lookup drafting: after the latest earlier occurrence of the last n tokens (n =
    max_n .. min_n, the longest match first), propose the k tokens that followed it."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafting needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def start(self, prompt: Sequence[int], budget: int) -> None:
        pass

    def propose(self, seq: list[int], k: int, config, generator) -> tuple[list[int], None]:
        """-> (up to k draft ids, None: the drafter's q is one-hot at each draft)."""
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):        # latest occurrence first
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + k], None
        return [], None

    def accepted(self, seq: list[int]) -> None:
        pass


class ModelDraft:
    """A smaller model sharing the target's tokenizer proposes k tokens, one forward each, from its
    own cache; its distributions q (k, V) come back with them."""

    def __init__(self, model):
        self.model, self.runner = model, None

    def start(self, prompt: Sequence[int], budget: int) -> None:
        self.runner = _Runner(self.model, budget, prompt)

    def propose(self, seq: list[int], k: int, config: SampleConfig, generator) -> tuple[list[int], torch.Tensor]:
        runner = self.runner
        runner.mark()
        logits = runner.feed(seq[len(runner.tokens):])[-1:]                  # (1, V)
        drafts, qs = [], []
        bias = bias_vector(config, self.model.config.vocab_size, logits.device)
        for i in range(k):
            q = process_logits(logits, config, bias=bias)                    # (1, V)
            d = int(q.argmax(-1)) if config.greedy else int(sample(q, generator))
            drafts.append(d)
            qs.append(q[0])
            if i + 1 < k:
                logits = runner.feed([d])
        return drafts, torch.stack(qs)                                       # (k, V)

    def accepted(self, seq: list[int]) -> None:
        """The sequence now stands at `seq` (its last token not yet fed): drop what was not kept."""
        held = self.runner.tokens
        keep = next((i for i, (a, b) in enumerate(zip(held, seq)) if a != b), min(len(held), len(seq)))
        self.runner.truncate(min(keep, len(seq) - 1))                        # the last token stays pending


def make_draft(draft) -> NgramDraft | ModelDraft:
    """"ngram" -> NgramDraft(); a model -> ModelDraft(model); a drafter passes through."""
    if draft == "ngram":
        return NgramDraft()
    if isinstance(draft, (NgramDraft, ModelDraft)):
        return draft
    if hasattr(draft, "config") and hasattr(draft, "parameters"):
        return ModelDraft(draft)
    raise ValueError(f"draft must be 'ngram', a model or a drafter, got {type(draft).__name__}")


# --------------------------------------------------------------------------------------------
# Checking the drafts
# --------------------------------------------------------------------------------------------

def verify(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, config: SampleConfig,
           bias, generator) -> tuple[int, int]:
    """Target logits (k + 1, V) over [last, d_1..d_k] -> (drafts accepted a, the token that follows
    them: the target's replacement for d_{a+1}, or its choice from p_k when all k pass). q (k, V)
    is the drafter's distribution, None for a one-hot drafter (n-gram)."""
    p = process_logits(logits, config, bias=bias)             # (k + 1, V); one-hot at the argmax when greedy
    if config.greedy:
        best = p.argmax(-1).tolist()
        a = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
        return a, best[a]
    for i, d in enumerate(drafts):
        q_i = q[i] if q is not None else torch.zeros_like(p[i]).index_fill_(0, torch.tensor([d], device=p.device), 1.0)
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q_i[d]) <= float(p[i, d]):
            continue                                                         # d_i accepted
        residual = (p[i] - q_i).clamp_min(0)                                 # max(0, p - q)
        residual = residual if float(residual.sum()) > 0 else p[i]
        return i, int(sample((residual / residual.sum())[None], generator))
    return len(drafts), int(sample(p[-1:], generator))


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------

def _check(target, drafter, config: SampleConfig, k: int) -> None:
    check_generates(target.config)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"draft_k must be an integer >= 1, got {k!r}")
    for name, off in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        if getattr(config, name) != off:
            raise ValueError(f"speculative decoding does not take {name} (it depends on every earlier token, "
                             f"position by position): leave it at {off}")
    if isinstance(drafter, ModelDraft):
        check_generates(drafter.model.config)
        if drafter.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({drafter.model.config.vocab_size}) differs from the "
                             f"target's ({target.config.vocab_size}): a draft model must share the tokenizer")


class SpeculativeStream:
    """Iterator over the ids speculative decoding generates for one prompt; `.result` (a
    SpeculativeResult) is complete once it is exhausted. See speculative_generate."""

    def __init__(self, target, prompt_ids, config: SampleConfig = SampleConfig(), *, draft="ngram",
                 k: int = 4, eot_id: int | None = None, token_bytes=None, generator=None):
        self.target, self.drafter, self.config, self.k = target, make_draft(draft), config, k
        _check(target, self.drafter, config, k)
        self.prompt = _as_batch(prompt_ids)[0]
        self.budget = check_prompts([self.prompt], target.config, config.max_new_tokens)
        device = next(target.parameters()).device
        self.generator = generator or make_generator(config.seed, device)
        self.rules = _StopRules(config, 1, eot_id, token_bytes)
        self.result = SpeculativeResult(tokens=[[]], stop_reasons=[""])

    def __iter__(self) -> Iterator[int]:
        r, generated = self.result, self.result.tokens[0]
        for new, _ in self.rounds():
            for token in new:
                generated.append(token)
                yield token
                reason = self.rules.check(0, generated)
                if reason is not None or len(generated) == self.budget:
                    r.stop_reasons[0] = reason or ("context_length" if self.budget < self.config.max_new_tokens
                                                   else "max_new_tokens")
                    return

    def rounds(self) -> Iterator[tuple[list[int], torch.Tensor]]:
        """The prefill, then one target pass after another: each yields (the new ids, the target's
        logits (n, V) float32 that each was chosen from), until the budget is spent. Stops are the
        caller's (__iter__ applies the config's; a server applies its own)."""
        r = self.result
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.runner = _Runner(self.target, self.budget, self.prompt)
            self.drafter.start(self.prompt, self.budget)
            self.bias = bias_vector(self.config, self.target.config.vocab_size, self.runner.device)
            logits = self.runner.feed(self.prompt)[-1:]                      # (1, V): the prefill
            new = [int(next_token(logits, self.config, self.generator, step=0, bias=self.bias))]
        r.prefill_seconds = time.perf_counter() - t0
        seq, produced = self.prompt + new, 1
        yield new, logits
        while produced < self.budget:
            t0 = time.perf_counter()
            new, logits = self._round(seq, self.budget - produced)
            seq += new
            produced += len(new)
            r.decode_seconds += time.perf_counter() - t0
            r.decode_tokens += len(new)
            yield new, logits

    def _round(self, seq: list[int], room: int) -> tuple[list[int], torch.Tensor]:
        """One target pass over [last, drafts] -> (the ids it yields, 1 to k + 1 of them, and
        their logits rows). `room`: how many ids may still come."""
        r, runner = self.result, self.runner
        with torch.inference_mode():
            k = min(self.k, room - 1)                                        # the drafts and one more
            drafts, q = self.drafter.propose(seq, k, self.config, self.generator) if k > 0 else ([], None)
            runner.mark()
            logits = runner.feed([seq[-1]] + drafts)                         # (1 + d, V)
            a, following = verify(logits, drafts, q, self.config, self.bias, self.generator)
            runner.truncate(len(seq) + a)                                    # seq and the accepted drafts
            new = drafts[:a] + [following]
            self.drafter.accepted(seq + new)
        r.target_passes += 1
        r.drafted += len(drafts)
        r.accepted += a
        return new, logits[:a + 1]


def speculative_generate(target, prompt_ids, config: SampleConfig = SampleConfig(), *, draft="ngram", k: int = 4,
                         eot_id: int | None = None, token_bytes=None,
                         generator: torch.Generator | None = None) -> SpeculativeResult:
    """Generate for one prompt with speculative decoding (see the module docstring). draft: "ngram"
    (prompt lookup), a draft model sharing the target's tokenizer, or a drafter (NgramDraft,
    ModelDraft); k: drafts per round. Stops as generate does (eot_id, config's stop ids,
    sequences and strings, with token_bytes). Greedy output equals generate's; sampled output has
    its distribution. -> SpeculativeResult (acceptance_rate, tokens_per_pass)."""
    stream = SpeculativeStream(target, prompt_ids, config, draft=draft, k=k, eot_id=eot_id,
                               token_bytes=token_bytes, generator=generator)
    for _ in stream:
        pass
    return stream.result
