"""Direct logit attribution: one logit taken apart into what each part of the model wrote into the
residual stream.

With pre-norm blocks the residual stream that reaches the final norm is a sum (the hook points of
model/hooks.py, all (B, T, D)):

    h = embed (+ pos_embed) + sum_i attn_out_i + sum_i mlp_out_i

The final norm is w * (h - mean(h)) * s + b (LayerNorm) or w * h * s (RMSNorm; 1 + w for the
zero-centred one), with s = 1 / rms(h) (1 / std) the hook point final_norm.scale. Holding s at the
value the full forward computed (freezing the scale, as the literature does: Elhage et al. 2021,
"A Mathematical Framework for Transformer Circuits"; Wang et al. 2022 (IOI)), the norm is linear in
h, and the logit of token a (or the difference a - b) is

    u . norm(h) = sum_c s * (u * w) . centre(c)  +  u . b        u = W_U[a] (- W_U[b]), (D,)

one term per component c. An attention layer's output is o_proj(z) = sum_h W_O[:, h] z_h + b_O, so
it splits per head the same way. The parts sum to the model's logit up to float rounding. The frozen
scale is a choice: s itself depends on every part, so a part's term says what it adds at the
normalisation the model actually applied, not what removing it would do (activation patching,
patching.py, answers that).

Shapes: B batch, T positions, D d_model, V vocab, H heads, Dh head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from logitlab.model.hooks import hook_points, run_with_cache
from logitlab.model.norms import LayerNorm, RMSNorm, ZeroCenteredRMSNorm


@dataclass
class LogitAttribution:
    """The logit (or logit difference) at `position` and its parts, in the order of the forward:
    parts {embed, pos_embed, blocks.i.attn_out, blocks.i.mlp_out, final_norm.bias: value}, which sum
    to `logit`; heads {blocks.i.attn.head{h}, blocks.i.attn.bias: value}, which sum to their layer's
    attn_out part."""

    position: int
    token: int
    other: int | None
    logit: float
    parts: dict[str, float] = field(default_factory=dict)
    heads: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def unembedding_direction(model, token: int, other: int | None = None) -> torch.Tensor:
    """u (D,) float64: the LM head's row of `token`, minus the row of `other` when given (a logit
    difference is linear in the head's input too)."""
    V = model.config.vocab_size
    for t in (token, other):
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V):
            raise ValueError(f"token id {t!r} is outside the vocabulary 0..{V - 1}")
    W_U = model.lm_head.weight                                      # (V_padded, D)
    u = W_U[token].double()
    return u - W_U[other].double() if other is not None else u


def _norm_parts(model) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """The final norm's weight as it multiplies (D,) float64, its bias (or None), whether it centres."""
    norm = model.final_norm
    if isinstance(norm, LayerNorm):
        return norm.weight.double(), norm.bias.double(), True
    if isinstance(norm, ZeroCenteredRMSNorm):
        return 1.0 + norm.weight.double(), None, False
    if isinstance(norm, RMSNorm):
        return norm.weight.double(), None, False
    raise ValueError(f"direct logit attribution knows LayerNorm and RMSNorm, not {type(norm).__name__}")


def attribution_names(model) -> list[str]:
    """The hook points the attribution reads: the embeddings, every attn_out and mlp_out, each
    attention layer's z (per head) and the final norm's scale."""
    if model.blocks[0].post_norm:
        raise ValueError("direct logit attribution needs pre-norm blocks (norm_placement='pre'): with a norm "
                         "after each add the residual stream is not a sum of the layers' outputs")
    keep = ("embed", "pos_embed", "attn_out", "mlp_out", "attn.z", "final_norm.scale")
    return [p.name for p in hook_points(model) if p.name.endswith(keep) and ".linear_attn." not in p.name]


@torch.no_grad()
def direct_logit_attribution(model, ids: Sequence[int] | torch.Tensor, token: int, other: int | None = None,
                             position: int = -1) -> LogitAttribution:
    """The logit of `token` (minus that of `other`) predicted after `position` of one text, split into
    the embeddings', each attention layer's (and head's) and each MLP's direct contributions through
    the final norm with its scale frozen (see the module docstring)."""
    x = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1).to(model.lm_head.weight.device)   # (1, T)
    T = x.shape[1]
    if T == 0 or not -T <= position < T:
        raise ValueError(f"position {position} is outside the {T} tokens of the text")
    pos = position % T
    u = unembedding_direction(model, token, other)
    w, b, centre = _norm_parts(model)
    logits, c = run_with_cache(model, x, attribution_names(model))
    s = c["final_norm.scale"][0, pos, 0].double()                  # the frozen 1 / rms
    uw = u * w                                                     # (D,)

    def term(vec: torch.Tensor) -> float:                          # vec (..., D) -> (...) contributions
        vec = vec.double()
        if centre:
            vec = vec - vec.mean(dim=-1, keepdim=True)
        return s * (vec @ uw)

    parts = {"embed": float(term(c["embed"][0, pos]))}
    if "pos_embed" in c:
        parts["pos_embed"] = float(term(c["pos_embed"][0, pos]))
    heads = {}
    for i, block in enumerate(model.blocks):
        parts[f"blocks.{i}.attn_out"] = float(term(c[f"blocks.{i}.attn_out"][0, pos]))
        if f"blocks.{i}.attn.z" in c:
            heads.update(_head_terms(i, block.attn, c[f"blocks.{i}.attn.z"][0, pos], term))
        parts[f"blocks.{i}.mlp_out"] = float(term(c[f"blocks.{i}.mlp_out"][0, pos]))
    if b is not None:
        parts["final_norm.bias"] = float(u @ b)
    row = logits[0, pos].double()
    logit = float(row[token] - row[other]) if other is not None else float(row[token])
    return LogitAttribution(pos, token, other, logit, parts, heads)


def _head_terms(layer: int, attn, z: torch.Tensor, term) -> dict[str, float]:
    """z (H, Dh) at one position -> {blocks.i.attn.head{h}: term, blocks.i.attn.bias: term}."""
    H, Dh = z.shape
    W_O = attn.o_proj.weight.double().view(-1, H, Dh)               # (D, H, Dh)
    per_head = torch.einsum("dhk,hk->hd", W_O, z.double())         # (H, D): what each head writes
    out = {f"blocks.{layer}.attn.head{h}": float(v) for h, v in enumerate(term(per_head))}
    if attn.o_proj.bias is not None:
        out[f"blocks.{layer}.attn.bias"] = float(term(attn.o_proj.bias))
    return out
