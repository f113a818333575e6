"""FlashAttention forward in Triton: tensor descriptors over (B, H, T, Dh), autotuned block
sizes, causal blocks skipped above the diagonal, grouped K/V heads read in place, and the
log-sum-exp of every row saved for the backward pass (kernels.triton_flash_bwd).

One program owns BLOCK_M query rows of one (batch, head) and streams the keys and values of its
key/value head through in blocks of BLOCK_N, keeping the online softmax (Milakov & Gimelshein
2018; Dao et al. 2022) in registers: a running row max m, a running sum l of exp(s - m) and the
unnormalised output acc, rescaled by exp(m_old - m_new) whenever the max grows. Nothing of size
T x S is ever written to memory.

- Tensor descriptors (tl.make_tensor_descriptor's host-side form, TensorDescriptor) name a
  4-d tensor and the block to move: loads past the end of T, S or Dh return zeros and stores
  past it are dropped, so any T, S and head dim work (ragged last blocks, no multiple of 128).
- Causal, with query row i at position i + S - T (a chunk of new queries after a cache): key
  blocks wholly visible to every row of the query block run without a mask, the blocks on the
  diagonal run masked, and the blocks above it are never loaded.
- GQA: query head h reads key/value head h // G directly; nothing is repeated.
- Scores are kept in base 2 (exp2, with log2(e) folded into the scale); LSE2 = m + log2(l).

Shapes: B batch, H query heads, Hkv key/value heads, G = H // Hkv, T queries, S keys, Dh head
dim, BLOCK_D = Dh rounded up to a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from logitlab.kernels.triton_common import INTERPRET, block_size

LOG2E = 1.4426950408889634


def fwd_configs() -> list[triton.Config]:
    """The autotuner's candidates on a GPU (24, timed once per key: T and S rounded up to powers
    of two, so a growing decode length does not re-tune every step, the head dim and causality);
    one small config under the interpreter, where timing means nothing."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1, pre_hook=_set_blocks)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_blocks)
            for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def _set_blocks(nargs: dict) -> None:
    """Before each launch: give the descriptors the block shapes of the config being run."""
    bm, bn, bd = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"]
    nargs["q_desc"].block_shape = [1, 1, bm, bd]
    nargs["o_desc"].block_shape = [1, 1, bm, bd]
    nargs["k_desc"].block_shape = [1, 1, bn, bd]
    nargs["v_desc"].block_shape = [1, 1, bn, bd]


def _prune(configs, named_args, **kwargs):
    """Drop configs whose tiles cannot fit on chip for large head dims (fewer to time)."""
    big = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 64)) >= 256
    kept = [c for c in configs if not (big and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 64 * 64)]
    return kept or configs[:1]


@triton.jit
def load_tiles(a_desc, b_desc, off_b, off_h, start, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
               UPCAST: tl.constexpr):
    """Rows [start, start + ROWS) of head off_h of batch row off_b from two (B, H, T, Dh)
    descriptors, as two (ROWS, BLOCK_D) tiles, widened to float32 when UPCAST."""
    a = a_desc.load([off_b, off_h, start, 0]).reshape(ROWS, BLOCK_D)
    b = b_desc.load([off_b, off_h, start, 0]).reshape(ROWS, BLOCK_D)
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return a, b


@triton.jit
def _fwd_block_loop(acc, l_i, m_i, q, k_desc, v_desc, off_b, off_kvh, offs_m, lo, hi, S, Q_OFF,
                    qk_scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Key blocks [lo, hi) folded into the online softmax of one query block; MASKED blocks mask
    keys past S and, when CAUSAL, keys after each query's position."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k, v = load_tiles(k_desc, v_desc, off_b, off_kvh, start_n, BLOCK_N, BLOCK_D, UPCAST)
        p_ty = v_desc.dtype
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale   # (BLOCK_M, BLOCK_N)
        if MASKED:
            offs_n = start_n + offs_n0
            keep = offs_n[None, :] < S
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + Q_OFF)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)                          # rescales what came before
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(p_ty)                                             # P rounded as V's dtype
        if UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=fwd_configs(), key=["T_KEY", "S_KEY", "BLOCK_D", "CAUSAL"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def flash_fwd_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, G, T, S, T_KEY, S_KEY,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * H). lse_ptr: (B, H, T) float32, base-2 log-sum-exp per row."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    off_kvh = off_h // G                                           # GQA: the shared K/V head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    Q_OFF = S - T                                                  # query row i sits at i + S - T
    q = q_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        lo = (start_m + Q_OFF + 1) // BLOCK_N * BLOCK_N            # blocks every row sees whole
        hi = tl.minimum(start_m + BLOCK_M + Q_OFF, S)              # past hi: above the diagonal
    else:
        lo = S // BLOCK_N * BLOCK_N                                # full blocks, then a ragged one
        hi = S
    acc, l_i, m_i = _fwd_block_loop(acc, l_i, m_i, q, k_desc, v_desc, off_b, off_kvh, offs_m, 0, lo,
                                    S, Q_OFF, qk_scale, BLOCK_N, BLOCK_D, False, CAUSAL, UPCAST, PRECISION)
    acc, l_i, m_i = _fwd_block_loop(acc, l_i, m_i, q, k_desc, v_desc, off_b, off_kvh, offs_m, lo, hi,
                                    S, Q_OFF, qk_scale, BLOCK_N, BLOCK_D, True, CAUSAL, UPCAST, PRECISION)
    out = acc / l_i[:, None]
    o_desc.store([off_b, off_h, start_m, 0], out.to(o_desc.dtype).reshape(1, 1, BLOCK_M, BLOCK_D))
    tl.store(lse_ptr + off_bh * T + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)


def descriptor(x: torch.Tensor, rows: int = 16) -> TensorDescriptor:
    """A TensorDescriptor over x (B, H|Hkv, T|S, Dh); its block shape is set per launch."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, block_size(x.shape[-1])])


def flash_forward(q, k, v, causal: bool, scale: float, upcast: bool, precision: str):
    """Launch flash_fwd_kernel: q (B, H, T, Dh), k, v (B, Hkv, S, Dh), each ready for a descriptor
    (see triton_attention.prepare) -> (o (B, H, T, Dh) in q's dtype, lse2 (B, H, T) float32)."""
    B, H, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse2 = torch.empty(B, H, T, dtype=torch.float32, device=q.device)

    def grid(meta):
        return (triton.cdiv(T, meta["BLOCK_M"]), B * H)

    flash_fwd_kernel[grid](descriptor(q), descriptor(k), descriptor(v), descriptor(o), lse2,
                           scale * LOG2E, H, H // Hkv, T, S, triton.next_power_of_2(T),
                           triton.next_power_of_2(S), BLOCK_D=block_size(Dh), CAUSAL=causal,
                           UPCAST=upcast, PRECISION=precision)
    return o, lse2
