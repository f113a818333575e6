"""Bits per byte: the loss that does not depend on the tokenizer.

A model's mean loss per token rewards a tokenizer with long tokens: fewer, harder predictions.
Bits per byte divides the same total by the text instead of the tokens:

    bits per byte = (sum over scored tokens of -ln p(token)) / (ln 2 * sum of their UTF-8 bytes)

so two models with different tokenizers compare fairly on the same text. Special tokens
(<|endoftext|> between documents) are not text: they have 0 bytes here and their loss is left out
(masked), so they neither add nats nor bytes.

bpb.py owns:
  - `token_byte_lengths(tokenizer, vocab_size)`: (V,) int64 bytes per id, 0 for special ids;
  - `nats_and_bytes(logits, targets, byte_lengths)`: the two sums over a batch, for a training
    loop's validation, which already has logits (B, T, V) and targets (B, T);
  - `batch_nats_and_bytes(model, inputs, targets, byte_lengths)`: the same from ids;
  - `evaluate_bpb(model, tokenizer, texts)`: over whole documents of any length (rolling windows
    of the context, each document from end-of-text), -> BPBResult.
Shapes: B batch, T positions, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from logitlab.eval.scoring import rolling_windows, score_ids

IGNORE_INDEX = -100  # targets equal to this are not scored (the cross-entropy convention)


def token_byte_lengths(tokenizer, vocab_size: int | None = None) -> torch.Tensor:
    """(V,) int64: the UTF-8 byte length of every id, 0 for special tokens. vocab_size (a model's,
    which may exceed the tokenizer's) pads with 0s; smaller than the tokenizer's is a ValueError."""
    n = tokenizer.vocab_size
    V = n if vocab_size is None else vocab_size
    if V < n:
        raise ValueError(f"vocab_size ({V}) is smaller than the tokenizer's vocabulary ({n} ids)")
    out = torch.zeros(V, dtype=torch.long)
    out[:n] = torch.tensor([0 if tokenizer.is_special(i) else len(tokenizer.token_bytes(i)) for i in range(n)])
    return out


def _check_byte_lengths(byte_lengths: torch.Tensor, V: int) -> None:
    if byte_lengths.ndim != 1 or byte_lengths.shape[0] < V:
        raise ValueError(f"byte_lengths must have shape (V,) with V >= {V} (the logits' vocabulary), got "
                         f"{tuple(byte_lengths.shape)}")


def nats_and_bytes(logits: torch.Tensor, targets: torch.Tensor, byte_lengths: torch.Tensor,
                   ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, V), targets (B, T) -> (summed nats, float64 0-d; summed bytes, int64 0-d) over
    the targets that are not ignore_index and have bytes (special ids have 0 and are masked). Sum
    these over a validation set and divide with `bits_per_byte`; no host sync happens here."""
    B, T, V = logits.shape
    if targets.shape != (B, T):
        raise ValueError(f"targets must have shape (B={B}, T={T}), got {tuple(targets.shape)}")
    _check_byte_lengths(byte_lengths, V)
    lengths = byte_lengths.to(targets.device)
    valid = targets != ignore_index                                             # (B, T)
    safe = targets.masked_fill(~valid, 0)                                       # (B, T)
    nbytes = torch.where(valid, lengths[safe], 0)                               # (B, T)
    nats = F.cross_entropy(logits.reshape(B * T, V).float(), safe.reshape(-1), reduction="none")  # (B*T,)
    keep = nbytes.reshape(-1) > 0
    # where(), not multiplication: a masked position's NaN must not reach the sum
    return torch.where(keep, nats, 0.0).double().sum(), nbytes.sum()


def batch_nats_and_bytes(model, inputs: torch.Tensor, targets: torch.Tensor, byte_lengths: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """nats_and_bytes of the model's logits for inputs (B, T) (no gradient)."""
    with torch.no_grad():
        return nats_and_bytes(model(inputs), targets, byte_lengths, ignore_index)


def bits_per_byte(nats: float | torch.Tensor, nbytes: int | torch.Tensor) -> float:
    """Summed nats over summed bytes, in bits: nats / (ln 2 * bytes). No bytes is a ValueError; NaN
    nats (a model that produced NaN) is a RuntimeError rather than a NaN result."""
    nats, nbytes = float(nats), int(nbytes)
    if nbytes <= 0:
        raise ValueError("bits per byte needs at least one byte of text to score, got 0 bytes")
    if math.isnan(nats):
        raise RuntimeError("the summed loss is NaN: the model's logits contain NaN or inf")
    return nats / (math.log(2) * nbytes)


@dataclass(frozen=True)
class BPBResult:
    """Totals over the documents: nats (-ln p summed over scored tokens), their UTF-8 bytes and
    count, and how many documents were scored."""

    nats: float
    bytes: int
    tokens: int
    documents: int

    @property
    def bits_per_byte(self) -> float:
        return bits_per_byte(self.nats, self.bytes)

    @property
    def nats_per_token(self) -> float:
        return self.nats / self.tokens if self.tokens else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else float("nan")


def evaluate_bpb(model, tokenizer, texts: Iterable[str], batch_size: int = 8) -> BPBResult:
    """Bits per byte of `model` on `texts`, each a document scored on its own from end-of-text, in
    rolling windows of the model's context (so documents of any length count in full). Special-token
    text in a document (<|endoftext|> between documents) becomes its id and is masked."""
    first = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eot_id  # <s>, else <|endoftext|>
    if first is None:
        raise ValueError("evaluate_bpb starts each document from <|endoftext|>, which this tokenizer lacks")
    lengths = token_byte_lengths(tokenizer)
    pairs, docs = [], 0
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"texts must be strings, got {type(text).__name__}")
        ids = tokenizer.encode(text)
        if ids:
            docs += 1
            pairs += rolling_windows(ids, first, model.config.context_length)
    nats, nbytes, ntokens = 0.0, 0, 0
    for (_, continuation), s in zip(pairs, score_ids(model, pairs, batch_size)):
        for token, lp in zip(continuation, s.token_logprobs):
            n = int(lengths[token])
            if n:
                nats, nbytes, ntokens = nats - lp, nbytes + n, ntokens + 1
    if nbytes == 0:
        raise ValueError("the texts hold no bytes to score (empty, or only special tokens)")
    return BPBResult(nats, nbytes, ntokens, docs)
