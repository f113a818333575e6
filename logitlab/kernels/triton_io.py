"""How many bytes attention moves between GPU memory (HBM) and the chip, for the three forms
of kernels.triton_attention_steps and triton_flash_fwd: the IO argument of FlashAttention
(Dao et al. 2022, section 3.2), as arithmetic a reader can run for any shape. No Triton here.

Per (batch, head), with e bytes per element, T queries, S keys, Dh head dim, BLOCK_M query rows
per program:
- naive (scores to memory): read Q, K; write the T x S scores; the softmax reads and writes
  them; the P V product reads P and V and writes O:   e * (2 T Dh + 2 S Dh + 4 T S)
- tiled (online softmax): each of the ceil(T / BLOCK_M) query blocks reads its Q rows once and
  streams all of K and V once; O is written once:       e * (2 T Dh + ceil(T / BLOCK_M) * 2 S Dh)
- causal tiled: each query block streams only the keys up to its diagonal, about half.
The T x S term is what makes naive attention memory-bound and quadratic in memory; the tiled
form trades it for re-reading K and V once per query block, which a large BLOCK_M keeps small.
"""

from __future__ import annotations

import math

FORMS = ("naive", "tiled", "tiled_causal")


def attention_hbm_bytes(B: int, H: int, T: int, S: int, Dh: int, elem_bytes: int = 2,
                        block_m: int = 128) -> dict[str, int]:
    """-> {"naive": bytes, "tiled": bytes, "tiled_causal": bytes} read and written by one forward
    pass over all B * H heads (see the module docstring for each count)."""
    for name, value in (("B", B), ("H", H), ("T", T), ("S", S), ("Dh", Dh), ("elem_bytes", elem_bytes),
                        ("block_m", block_m)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    heads, e = B * H, elem_bytes
    blocks = math.ceil(T / block_m)
    naive = e * (2 * T * Dh + 2 * S * Dh + 4 * T * S)
    tiled = e * (2 * T * Dh + blocks * 2 * S * Dh)
    past = S - T                                                   # keys before the first query
    causal_keys = sum(min(S, past + min(T, (i + 1) * block_m)) for i in range(blocks))
    tiled_causal = e * (2 * T * Dh + 2 * causal_keys * Dh)
    return {"naive": heads * naive, "tiled": heads * tiled, "tiled_causal": heads * tiled_causal}


def default_chunk_rows(N: int, V: int, D: int) -> int:
    """Rows per chunk of the fused LM head + cross-entropy (kernels.triton_cross_entropy): a
    chunk's (C, V) logits about the size of all of h (N, D) (Liger-Kernel's rule), a power of two."""
    C = 1 << max(0, math.ceil(N / math.ceil(V / D)) - 1).bit_length()
    return max(1, min(N, C))


def cross_entropy_bytes(N: int, V: int, D: int, elem_bytes: int = 2, chunk_rows: int | None = None) -> dict[str, int]:
    """Extra memory of the LM-head loss over N rows: {"full": the (N, V) float32 logits, their
    log-softmax and their gradient, as an unfused step holds them; "chunked": one (C, V) chunk in
    the input dtype plus the float32 (V, D) weight gradient, as linear_cross_entropy holds them}."""
    C = default_chunk_rows(N, V, D) if chunk_rows is None else chunk_rows
    return {"full": 3 * N * V * 4, "chunked": C * V * elem_bytes + V * D * 4, "chunk_rows": C}
