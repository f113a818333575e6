"""The road to FlashAttention, as two kernels a reader can check by eye before the real one
(kernels.triton_flash_fwd): attention with the scores written to memory, then tiled attention
with the online softmax. Both are forward-only, for q, k, v (B, H, T, Dh) with one K/V head per
query head; each must equal logitlab.model.attention.eager_attention.

1. naive_attention: three passes over memory, as eager PyTorch runs it. A matmul kernel writes
   the scores S = q k^T * scale (B, H, T, S) with the causal mask applied, the row softmax of
   kernels.triton_basics turns them into P in place, and the matmul kernel again gives P v. The
   (T, S) matrix goes to memory and comes back twice: O(T * S) bytes of HBM traffic per head.
2. tiled_attention: one kernel, one program per block of query rows, keys and values streamed
   through in blocks; the softmax is computed online (a running max m and sum l per row, the
   output rescaled by exp(m_old - m_new) when the max grows), so the (T, S) matrix never exists
   and the traffic is O((T + S) * Dh) per block row. Plain pointer arithmetic, masks for ragged
   ends, and a causal mask on every block: skipping the blocks above the diagonal, descriptors,
   autotuning, GQA and the backward pass are the next steps (triton_flash_fwd, triton_flash_bwd).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_basics import softmax
from logitlab.kernels.triton_common import block_size, check_tensor, dot_precision, upcast_dots

STEP_BLOCK = 16                                                    # tile side of both kernels


def _check_mha(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim=4)
    if q.shape[:2] != k.shape[:2] or k.shape != v.shape or q.shape[3] != k.shape[3] or q.dtype != k.dtype:
        raise ValueError(f"q (B, H, T, Dh) and k, v (B, H, S, Dh) of one dtype expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


@triton.jit
def _bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sa_b, sa_m, sa_k, sb_b, sb_k, sb_n, sc_b, sc_m, sc_n, scale,
                CAUSAL_FROM, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """c[b] = scale * a[b] @ b[b] for a (batch, M, K), b (batch, K, N); grid (cdiv(M), cdiv(N), batch).
    CAUSAL_FROM >= 0: entries (m, n) with n > m + CAUSAL_FROM are -inf (the masked scores)."""
    pid_m, pid_n, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + bat * sa_b + offs_m[:, None] * sa_m + offs_k[None, :] * sa_k,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + bat * sb_b + offs_k[:, None] * sb_k + offs_n[None, :] * sb_n,
                    mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    acc = acc * scale
    if CAUSAL_FROM >= 0:
        acc = tl.where(offs_n[None, :] <= offs_m[:, None] + CAUSAL_FROM, acc, float("-inf"))
    tl.store(c_ptr + bat * sc_b + offs_m[:, None] * sc_m + offs_n[None, :] * sc_n, acc.to(c_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _bmm(a: torch.Tensor, b: torch.Tensor, out_dtype, scale: float = 1.0, causal_from: int = -1) -> torch.Tensor:
    """a (batch, M, K) @ b (batch, K, N) * scale -> (batch, M, N) in out_dtype."""
    batch, M, K = a.shape
    N = b.shape[2]
    c = torch.empty(batch, M, N, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, STEP_BLOCK), triton.cdiv(N, STEP_BLOCK), batch)
    _bmm_kernel[grid](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(), scale, causal_from,
                      BLOCK_M=STEP_BLOCK, BLOCK_N=STEP_BLOCK, BLOCK_K=STEP_BLOCK,
                      UPCAST=upcast_dots(a.dtype), PRECISION=dot_precision(a.dtype))
    return c


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Step 1: scores to memory, softmax, then P v. q (B, H, T, Dh), k, v (B, H, S, Dh) -> (B, H, T, Dh).
    Causal: query t sees keys up to t + S - T. Scores and probabilities are float32."""
    _check_mha(q, k, v)
    B, H, T, Dh = q.shape
    S = k.shape[2]
    q3, k3, v3 = q.reshape(B * H, T, Dh), k.reshape(B * H, S, Dh), v.reshape(B * H, S, Dh)
    scores = _bmm(q3, k3.transpose(1, 2), torch.float32, 1.0 / math.sqrt(Dh),
                  S - T if causal else -1)                         # (B*H, T, S) in memory
    p = softmax(scores).to(q.dtype)                                # (B*H, T, S) read, written again
    return _bmm(p, v3, q.dtype).view(B, H, T, Dh)                  # read a third time


@triton.jit
def _tiled_kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, S, Dh, sq_bh, sq_t, sk_bh, sk_s, so_bh, so_t, qk_scale,
                  CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * H); q, k, v, o with a contiguous last dim."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + bh * sq_bh + offs_m[:, None] * sq_t + offs_d[None, :],
                mask=(offs_m[:, None] < T) & (offs_d[None, :] < Dh), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)           # running max of each row
    l_i = tl.zeros([BLOCK_M], tl.float32)                          # running sum of exp(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)                 # running unnormalised output
    for start_n in range(0, S, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < S) & (offs_d[None, :] < Dh)
        k = tl.load(k_ptr + bh * sk_bh + offs_n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + bh * sk_bh + offs_n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        p_ty = v.dtype
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale     # (BLOCK_M, BLOCK_N), base 2
        keep = offs_n[None, :] < S
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + S - T)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(p_ty)
        if UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + bh * so_bh + offs_m[:, None] * so_t + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < T) & (offs_d[None, :] < Dh))


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Step 2: one pass, online softmax. Same arguments and result as naive_attention."""
    _check_mha(q, k, v)
    B, H, T, Dh = q.shape
    S = k.shape[2]
    if causal and T > S:
        raise ValueError(f"causal attention needs T <= S, got T={T}, S={S}")
    q3, k3, v3 = (x.reshape(B * H, x.shape[2], Dh).contiguous() for x in (q, k, v))   # (B*H, T|S, Dh)
    o = torch.empty_like(q3)
    grid = (triton.cdiv(T, STEP_BLOCK), B * H)
    _tiled_kernel[grid](q3, k3, v3, o, T, S, Dh, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1),
                        o.stride(0), o.stride(1), 1.4426950408889634 / math.sqrt(Dh), CAUSAL=causal,
                        BLOCK_M=STEP_BLOCK, BLOCK_N=STEP_BLOCK, BLOCK_D=block_size(Dh),
                        UPCAST=upcast_dots(q.dtype), PRECISION=dot_precision(q.dtype))
    return o.view(B, H, T, Dh)
