"""FlashAttention backward in Triton (Dao 2023, FlashAttention-2's split): a preprocessing pass
delta = rowsum(O * dO), then one kernel for dK and dV (a program per key block, looping over
query blocks) and one for dQ (a program per query block, looping over key blocks), so every
gradient is written by exactly one program: no atomics, the same result on every run.

The attention probabilities are never stored: each is recomputed from q, k and the base-2
log-sum-exp LSE2 saved by the forward pass, P = exp2(s * log2(e) / sqrt(Dh) - LSE2). With
dP = dO V^T and dS = P * (dP - delta) (the softmax's Jacobian, delta_i = sum_j P_ij dP_ij =
rowsum(O * dO)_i):  dV = P^T dO,  dK = scale * dS^T Q,  dQ = scale * dS K.

Ragged blocks need no mask: descriptor loads past T or S return zeros, and a zero row of q, dO
(with zero LSE2 and delta) or of k, v adds nothing to the gradients that are stored; only the
causal diagonal blocks are masked, blocks above the diagonal are skipped as in the forward pass.
GQA: the dK/dV program of key/value head j sums over its G query heads h = j * G + g.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitlab.kernels.triton_common import INTERPRET, block_size
from logitlab.kernels.triton_flash_fwd import LOG2E, _prune, descriptor, load_tiles

DELTA_BLOCK = 16 if INTERPRET else 64                              # rows per program of the delta pass


def _blocks_setter(m_names: tuple[str, ...], n_names: tuple[str, ...]):
    """A config pre_hook giving the named descriptors the config's block shapes."""
    def set_blocks(nargs: dict) -> None:
        bm, bn, bd = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_D"]
        for name in m_names:
            nargs[name].block_shape = [1, 1, bm, bd]
        for name in n_names:
            nargs[name].block_shape = [1, 1, bn, bd]
    return set_blocks


_DKDV_HOOK = _blocks_setter(("q_desc", "do_desc"), ("k_desc", "v_desc", "dk_desc", "dv_desc"))
_DQ_HOOK = _blocks_setter(("q_desc", "do_desc", "dq_desc"), ("k_desc", "v_desc"))


def bwd_configs(kind: str) -> list[triton.Config]:
    """Autotuner candidates of the dK/dV ("dkdv": a key block per program, so BLOCK_N is the
    larger side) and dQ ("dq") kernels; one 16 x 16 config under the interpreter."""
    hook = _DKDV_HOOK if kind == "dkdv" else _DQ_HOOK
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1, pre_hook=hook)]
    if kind == "dkdv":
        shapes = ((32, 64), (64, 64), (32, 128), (64, 128))
    else:
        shapes = ((64, 32), (64, 64), (128, 32), (128, 64))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st, pre_hook=hook)
            for bm, bn in shapes for w in (4, 8) for st in (1, 2, 3)]


_KEY = ["T_KEY", "S_KEY", "BLOCK_D", "CAUSAL"]


@triton.jit
def _delta_kernel(o_desc, do_desc, delta_ptr, T, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, H):
    """delta (B, H, T) float32 = rowsum(O * dO); grid (cdiv(T, BLOCK_M), B * H)."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    o = o_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D).to(tl.float32)
    do = do_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D).to(tl.float32)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(delta_ptr + off_bh * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@triton.jit
def _dkdv_loop(dk, dv, k, v, q_desc, do_desc, lse_ptr, delta_ptr, off_b, off_h, row0, offs_n, lo, hi, T,
               Q_OFF, qk_scale, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Query blocks [lo, hi) of head off_h added into one key block's dK, dV (transposed form:
    rows are keys). row0 = (b * H + h) * T, the head's first LSE2/delta entry."""
    for start_m in range(lo, hi, BLOCK_M):
        q, do = load_tiles(q_desc, do_desc, off_b, off_h, start_m, BLOCK_M, BLOCK_D, UPCAST)
        p_ty = do_desc.dtype
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse = tl.load(lse_ptr + row0 + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(delta_ptr + row0 + offs_m, mask=offs_m < T, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)                 # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
        if MASKED:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + Q_OFF, p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        p_t, ds_t = p_t.to(p_ty), ds_t.to(p_ty)
        if UPCAST:
            p_t, ds_t = p_t.to(tl.float32), ds_t.to(tl.float32)
        dv = tl.dot(p_t, do, dv, input_precision=PRECISION)
        dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
    return dk, dv


@triton.autotune(configs=bwd_configs("dkdv"), key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr, sm_scale, qk_scale,
                 H, G, T, S, T_KEY, S_KEY, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(S, BLOCK_N), B * Hkv): dK, dV of one key block of one key/value head."""
    start_n = tl.program_id(0) * BLOCK_N
    off_bkv = tl.program_id(1)
    Hkv = H // G
    off_b, off_kvh = off_bkv // Hkv, off_bkv % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    Q_OFF = S - T
    k, v = load_tiles(k_desc, v_desc, off_b, off_kvh, start_n, BLOCK_N, BLOCK_D, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:   # query rows before start_n - Q_OFF see none of these keys; from `full` on, all
        lo = tl.maximum(start_n - Q_OFF, 0) // BLOCK_M * BLOCK_M
        full = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - Q_OFF, 0), BLOCK_M) * BLOCK_M, T)
        full = tl.maximum(full, lo)
    else:
        lo = 0
        full = 0
    for g in range(0, G):
        off_h = off_kvh * G + g
        row0 = (off_b * H + off_h) * T
        dk, dv = _dkdv_loop(dk, dv, k, v, q_desc, do_desc, lse_ptr, delta_ptr, off_b, off_h, row0, offs_n, lo,
                            full, T, Q_OFF, qk_scale, BLOCK_M, BLOCK_D, True, UPCAST, PRECISION)
        dk, dv = _dkdv_loop(dk, dv, k, v, q_desc, do_desc, lse_ptr, delta_ptr, off_b, off_h, row0, offs_n, full,
                            T, T, Q_OFF, qk_scale, BLOCK_M, BLOCK_D, False, UPCAST, PRECISION)
    dk = dk * sm_scale
    dk_desc.store([off_b, off_kvh, start_n, 0], dk.to(dk_desc.dtype).reshape(1, 1, BLOCK_N, BLOCK_D))
    dv_desc.store([off_b, off_kvh, start_n, 0], dv.to(dv_desc.dtype).reshape(1, 1, BLOCK_N, BLOCK_D))


@triton.jit
def _dq_loop(dq, q, do, lse, delta, k_desc, v_desc, off_b, off_kvh, offs_m, lo, hi, Q_OFF, qk_scale,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
             PRECISION: tl.constexpr):
    """Key blocks [lo, hi) added into one query block's dQ (unscaled)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k, v = load_tiles(k_desc, v_desc, off_b, off_kvh, start_n, BLOCK_N, BLOCK_D, UPCAST)
        p_ty = k_desc.dtype
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                   # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(start_n + offs_n0[None, :] <= offs_m[:, None] + Q_OFF, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(p_ty)
        if UPCAST:
            ds = ds.to(tl.float32)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
    return dq


@triton.autotune(configs=bwd_configs("dq"), key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, sm_scale, qk_scale, H, G, T, S,
               T_KEY, S_KEY, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), B * H): dQ of one query block of one head."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b, off_h = off_bh // H, off_bh % H
    off_kvh = off_h // G
    offs_m = start_m + tl.arange(0, BLOCK_M)
    Q_OFF = S - T
    q, do = load_tiles(q_desc, do_desc, off_b, off_h, start_m, BLOCK_M, BLOCK_D, UPCAST)
    lse = tl.load(lse_ptr + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(delta_ptr + off_bh * T + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        lo = (start_m + Q_OFF + 1) // BLOCK_N * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M + Q_OFF, S)
    else:
        lo = S
        hi = S
    dq = _dq_loop(dq, q, do, lse, delta, k_desc, v_desc, off_b, off_kvh, offs_m, 0, lo, Q_OFF, qk_scale,
                  BLOCK_N, BLOCK_D, False, UPCAST, PRECISION)
    dq = _dq_loop(dq, q, do, lse, delta, k_desc, v_desc, off_b, off_kvh, offs_m, lo, hi, Q_OFF, qk_scale,
                  BLOCK_N, BLOCK_D, True, UPCAST, PRECISION)
    dq = dq * sm_scale
    dq_desc.store([off_b, off_h, start_m, 0], dq.to(dq_desc.dtype).reshape(1, 1, BLOCK_M, BLOCK_D))


def flash_backward(do, q, k, v, o, lse2, causal: bool, scale: float, upcast: bool, precision: str):
    """-> (dq, dk, dv) in the dtypes and shapes of q, k, v (contiguous)."""
    B, H, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    bd = block_size(Dh)
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    _delta_kernel[(triton.cdiv(T, DELTA_BLOCK), B * H)](descriptor(o, DELTA_BLOCK), descriptor(do, DELTA_BLOCK),
                                                        delta, T, BLOCK_M=DELTA_BLOCK, BLOCK_D=bd, H=H)
    keys = (triton.next_power_of_2(T), triton.next_power_of_2(S))
    common = dict(BLOCK_D=bd, CAUSAL=causal, UPCAST=upcast, PRECISION=precision)
    # each kernel gets descriptors of its own: the autotuner's pre_hook sets their block shapes
    _dkdv_kernel[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)](
        descriptor(q), descriptor(k), descriptor(v), descriptor(do), descriptor(dk), descriptor(dv), lse2, delta,
        scale, scale * LOG2E, H, H // Hkv, T, S, *keys, **common)
    _dq_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        descriptor(q), descriptor(k), descriptor(v), descriptor(do), descriptor(dq), lse2, delta, scale,
        scale * LOG2E, H, H // Hkv, T, S, *keys, **common)
    return dq, dk, dv
