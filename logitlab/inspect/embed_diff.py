"""What fine-tuning changed in the embedding: per-token row changes between two models.

embed_diff.py owns comparing the embedding tables (and the LM heads, when they are untied) of a
base model and a fine-tuned one, row by row: the L2 norm of the change and the cosine between
the old and new rows. Read together with the tokens, this is how SFT's priorities show in its
special tokens (new chat markers move most: they start from an initialisation and must be
learned) and its content in the ordinary BPE tokens that the SFT data uses often.

Rows are compared over the fine-tuned model's visible vocabulary. A row the base model has in
its table (a padded slot that a new special token took) is compared with what it held; a row
beyond the base table (a resize) is compared with zero and has no cosine. Rendering (tables,
plots) is the CLI's.

Shapes: V visible rows of the fine-tuned model, D d_model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def row_changes(base: torch.Tensor, tuned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """base (Vb, D), tuned (V, D) -> (L2 change (V,), cosine (V,), NaN where there is no base row)."""
    V, D = tuned.shape
    n = min(V, base.shape[0])
    old = torch.zeros(V, D, dtype=torch.float64)
    old[:n] = base[:n].double()
    new = tuned.double()
    l2 = (new - old).norm(dim=1)                                   # (V,)
    cos = torch.full((V,), float("nan"), dtype=torch.float64)
    cos[:n] = torch.nn.functional.cosine_similarity(new[:n], old[:n], dim=1, eps=1e-12)
    return l2, cos


def token_counts(id_lists: Iterable[Iterable[int]], vocab_size: int) -> torch.Tensor:
    """How often each id occurs in some tokenized data -> (V,) int64 (ids outside 0..V-1 skipped)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in id_lists:
        t = torch.as_tensor(list(ids), dtype=torch.long)
        t = t[(t >= 0) & (t < vocab_size)]
        counts += torch.bincount(t, minlength=vocab_size)
    return counts


BY = ("l2", "relative", "angle")


def _score(l2, cos, relative, by: str) -> torch.Tensor:
    """The ranking key: L2 change, change relative to the old row's norm, or 1 - cosine."""
    if by == "l2":
        return l2
    if by == "relative":
        return torch.nan_to_num(relative, nan=float("inf"))
    return torch.nan_to_num(1.0 - cos, nan=2.0)


def _rows(l2, cos, relative, tokenizer, special_ids: set[int], counts, top: int, by: str, min_count: int = 0):
    """The `top` rows that moved most by `by`, special tokens and ordinary ones apart, largest first
    (ordinary rows seen fewer than min_count times in `counts` left out)."""
    order = torch.argsort(_score(l2, cos, relative, by), descending=True, stable=True).tolist()
    special, ordinary = [], []
    for i in order:
        row = {"id": i, "l2": float(l2[i]), "cos": None if torch.isnan(cos[i]) else float(cos[i]),
               "relative": None if torch.isnan(relative[i]) else float(relative[i]),
               "count": int(counts[i]) if counts is not None else None}
        if tokenizer is not None and i < tokenizer.vocab_size:
            row["token"] = tokenizer.token_bytes(i).decode("utf-8", errors="backslashreplace")
        target = special if i in special_ids else ordinary
        if target is ordinary and counts is not None and int(counts[i]) < min_count:
            continue
        if len(target) < top:
            target.append(row)
        if len(special) >= min(top, len(special_ids)) and len(ordinary) >= top:
            break
    return special, ordinary


@torch.no_grad()
def embedding_diff(base_model, tuned_model, tokenizer=None, counts: torch.Tensor | None = None,
                   top: int = 20, by: str = "l2", min_count: int = 0) -> dict:
    """Compare the two models' embedding rows (and LM-head rows when the tuned model's head is untied).

    tokenizer (the tuned model's): names the tokens and says which are special; counts (V,): token
    frequencies in the SFT data (token_counts) to put beside each row. by: rank rows by "l2" (the
    change), "relative" (the change over the old row's norm) or "angle" (1 - cosine). min_count:
    list only ordinary tokens the SFT data uses at least this often (with counts). ->
    {"vocab_size", "l2", "cos" (V,) tensors, "special_ids", "special_share" (the share of the
    summed L2 change carried by special tokens), "top_special", "top_ordinary" (lists of rows
    {id, token, l2, cos, relative, count}), "head": the same for the LM head or None when tied,
    "correlation": Spearman's rho between change and log count (None without counts)}."""
    V = tuned_model.config.vocab_size
    if base_model.config.d_model != tuned_model.config.d_model:
        raise ValueError(f"the models differ in d_model ({base_model.config.d_model} vs "
                         f"{tuned_model.config.d_model}): their embeddings cannot be compared")
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    if counts is not None and counts.shape[0] < V:
        raise ValueError(f"counts has {counts.shape[0]} entries, the tuned model {V} ids")
    special_ids = set(tokenizer.special_tokens.values()) if tokenizer is not None else set()

    def table(base_w, tuned_w) -> dict:
        l2, cos = row_changes(base_w.detach().cpu(), tuned_w.detach().cpu()[:V])
        old_norm = torch.zeros(V, dtype=torch.float64)
        n = min(V, base_w.shape[0])
        old_norm[:n] = base_w.detach().cpu()[:n].double().norm(dim=1)
        relative = torch.where(old_norm > 0, l2 / old_norm, torch.full_like(l2, float("nan")))
        total = float(l2.sum())
        share = float(l2[sorted(i for i in special_ids if i < V)].sum()) / total if total > 0 else 0.0
        special, ordinary = _rows(l2, cos, relative, tokenizer, special_ids, counts, top, by, min_count)
        return {"l2": l2, "cos": cos, "special_share": share, "top_special": special, "top_ordinary": ordinary,
                "total_l2": total}

    out = {"vocab_size": V, "special_ids": sorted(special_ids), **table(base_model.tok_emb.weight,
                                                                          tuned_model.tok_emb.weight)}
    tied = tuned_model.config.tie_embeddings
    out["head"] = None if tied else table(base_model.lm_head.weight, tuned_model.lm_head.weight)
    out["correlation"] = None if counts is None else spearman(out["l2"], torch.log1p(counts[:V].double()))
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's rank correlation of two (N,) tensors (average ranks for ties); None if either is constant."""
    def ranks(x):
        order = torch.argsort(x, stable=True)
        r = torch.empty_like(x, dtype=torch.float64)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        values, inverse = torch.unique(x, return_inverse=True)
        sums = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, r)
        sizes = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
        return (sums / sizes)[inverse]
    ra, rb = ranks(a.double()), ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    return None if denom == 0 else float((ra * rb).sum()) / denom
