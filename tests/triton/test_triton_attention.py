"""The attention kernels against logitlab.model.attention.eager_attention (float32 reference)
and torch's SDPA: the teaching steps (naive, tiled) forward, FlashAttention forward and backward
over causal / not, GQA, ragged T and S, a chunk after cached keys, a decode step, head dims and
dtypes.

Tolerances by dtype, as FlashAttention's own tests set them: in float32 the kernel must match
the float32 reference to ~1e-5; in float16 and bfloat16 its error from the float32 reference
must stay within a small multiple of the error of the eager path run in that dtype (plus a
floor), since both round the same products."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from logitlab.kernels.triton_attention import flash_attention
from logitlab.kernels.triton_attention_steps import naive_attention, tiled_attention
from logitlab.model.attention import eager_attention, repeat_kv


def reference(q, k, v, causal):
    """eager_attention on repeated K/V heads; causal: query t sees keys up to t + S - T."""
    T, S = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T) if causal else None
    return eager_attention(q, repeat_kv(k, G), repeat_kv(v, G), mask)[0]


def inputs(device, B, H, Hkv, T, S, Dh, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, S, Dh, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, S, Dh, generator=g).to(device, dtype)
    return q, k, v


def check_close(got, ref32, low_ref, dtype, what):
    """got vs the float32 reference; for 16-bit dtypes within 3x the eager path's own error + a floor."""
    err = (got.float() - ref32).abs().max().item()
    if dtype == torch.float32:
        assert err <= 2e-5 * max(1.0, ref32.abs().max().item()), f"{what}: {err}"
    else:
        low_err = (low_ref.float() - ref32).abs().max().item()
        floor = 1e-2 if dtype == torch.bfloat16 else 2e-3
        assert err <= 3 * low_err + floor, f"{what}: {err} vs eager {dtype} {low_err}"


def forward_backward(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


# ------------------------------------------------------------------------------------------
# The teaching steps
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [naive_attention, tiled_attention])
@pytest.mark.parametrize("causal,T,S", [(False, 19, 23), (True, 21, 21), (True, 3, 30)])
def test_teaching_steps_equal_eager(device, step, causal, T, S):
    q, k, v = inputs(device, 1, 2, 2, T, S, 24, torch.float32)
    torch.testing.assert_close(step(q, k, v, causal), reference(q, k, v, causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", [naive_attention, tiled_attention])
def test_teaching_steps_in_half(device, step):
    q, k, v = inputs(device, 1, 2, 2, 17, 17, 16, torch.float16)
    ref32 = reference(q.float(), k.float(), v.float(), True)
    check_close(step(q, k, v, True), ref32, reference(q, k, v, True), torch.float16, step.__name__)


def test_teaching_steps_check_shapes(device):
    q, k, v = inputs(device, 1, 2, 1, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="one K/V head per query head|q \\(B, H, T, Dh\\)"):
        tiled_attention(q, k, v)


# ------------------------------------------------------------------------------------------
# FlashAttention: forward and backward
# ------------------------------------------------------------------------------------------

CASES = {                                     # B, H, Hkv, T, S, Dh, causal
    "causal-ragged": (1, 2, 2, 37, 37, 24, True),
    "plain-ragged-S": (2, 2, 2, 20, 33, 16, False),
    "gqa-causal": (1, 4, 2, 21, 21, 32, True),
    "gqa-8": (1, 8, 1, 9, 9, 16, True),
    "chunk-after-cache": (1, 4, 2, 5, 40, 32, True),
    "decode-step": (2, 2, 1, 1, 29, 16, False),
    "decode-causal": (1, 2, 2, 1, 18, 16, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flash_forward_and_backward_equal_eager_fp32(device, case):
    B, H, Hkv, T, S, Dh, causal = CASES[case]
    q, k, v = inputs(device, B, H, Hkv, T, S, Dh, torch.float32)
    do = torch.randn(B, H, T, Dh, device=device)
    got = forward_backward(lambda a, b, c: flash_attention(a, b, c, causal), q, k, v, do)
    ref = forward_backward(lambda a, b, c: reference(a, b, c, causal), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        check_close(a, b, None, torch.float32, f"{case} {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_in_16_bit_within_the_eager_error(device, dtype, causal):
    q, k, v = inputs(device, 1, 4, 2, 23, 23, 32, dtype)
    do = torch.randn(1, 4, 23, 32, device=device).to(dtype)
    got = forward_backward(lambda a, b, c: flash_attention(a, b, c, causal), q, k, v, do)
    low = forward_backward(lambda a, b, c: reference(a, b, c, causal), q, k, v, do)
    ref32 = forward_backward(lambda a, b, c: reference(a, b, c, causal), q.float(), k.float(), v.float(),
                             do.float())
    for name, a, lo, r in zip(("out", "dq", "dk", "dv"), got, low, ref32):
        assert a.dtype == dtype, name
        check_close(a, r, lo, dtype, f"{dtype} causal={causal} {name}")


def test_flash_equals_sdpa_with_gqa(device):
    q, k, v = inputs(device, 2, 4, 2, 18, 18, 16, torch.float32)
    want = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    torch.testing.assert_close(flash_attention(q, k, v, causal=True), want, rtol=1e-5, atol=2e-5)


def test_flash_reads_strided_views_and_a_custom_scale(device):
    x = torch.randn(1, 19, 3, 2, 16, device=device)                # (B, T, q|k|v, H, Dh) as a fused projection
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))       # (B, H, T, Dh) views, not contiguous
    got = flash_attention(q, k, v, causal=True, scale=0.5)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_flash_rows_never_see_the_future(device):
    q, k, v = inputs(device, 1, 2, 2, 20, 20, 16, torch.float32)
    base = flash_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 13:] += 5.0
    v2[:, :, 13:] -= 3.0                                           # change only keys 13..19
    moved = flash_attention(q, k2, v2, causal=True)
    torch.testing.assert_close(moved[:, :, :13], base[:, :, :13], rtol=0, atol=0)
    assert not torch.allclose(moved[:, :, 13:], base[:, :, 13:])


@pytest.mark.parametrize("shapes,message", [
    (((1, 3, 4, 16), (1, 2, 4, 16)), "multiple of key/value heads"),
    (((1, 2, 4, 12), (1, 2, 4, 12)), "head dim must be a multiple of 8"),
    (((1, 2, 4, 16), (1, 2, 4, 32)), "k and v must be"),
    (((1, 2, 8, 16), (1, 2, 4, 16)), "causal attention needs T <= S"),
])
def test_flash_rejects_bad_inputs(device, shapes, message):
    (qs, ks) = shapes
    q, k = torch.randn(qs, device=device), torch.randn(ks, device=device)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k, causal=True)


def test_flash_rejects_mixed_dtypes_and_bad_scale(device):
    q = torch.randn(1, 2, 4, 16, device=device)
    with pytest.raises(ValueError, match="share dtype"):
        flash_attention(q, q.half(), q.half())
    with pytest.raises(ValueError, match="scale must be"):
        flash_attention(q, q, q, scale=-1.0)


@pytest.mark.slow
@pytest.mark.parametrize("Dh", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_head_dims_sweep(device, Dh, causal):
    q, k, v = inputs(device, 1, 4, 2, 70, 70, Dh, torch.float32)
    do = torch.randn(1, 4, 70, Dh, device=device)
    got = forward_backward(lambda a, b, c: flash_attention(a, b, c, causal), q, k, v, do)
    ref = forward_backward(lambda a, b, c: reference(a, b, c, causal), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        check_close(a, b, None, torch.float32, f"Dh={Dh} {name}")


@pytest.mark.slow
def test_flash_long_ragged_sequence(device):
    T = 131                                                        # neither a multiple of 16 nor 128
    q, k, v = inputs(device, 1, 2, 1, T, T, 40, torch.float32)
    torch.testing.assert_close(flash_attention(q, k, v, causal=True), reference(q, k, v, True),
                               rtol=1e-5, atol=2e-5)
    assert math.isfinite(flash_attention(q, k, v).abs().sum().item())


def test_causal_blocks_above_the_diagonal_are_never_loaded(device):
    """NaN values for the last keys: a query block whose diagonal ends before them stays finite
    only if their blocks are skipped (a masked load would still multiply 0 by NaN)."""
    from logitlab.kernels.triton_flash_bwd import bwd_configs
    from logitlab.kernels.triton_flash_fwd import fwd_configs

    configs = fwd_configs()
    if len(configs) != 1:
        pytest.skip("block sizes are autotuned here; the check needs the interpreter's one config")
    bm, bn = configs[0].kwargs["BLOCK_M"], configs[0].kwargs["BLOCK_N"]
    assert all((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (bm, bn) for k in ("dkdv", "dq") for c in bwd_configs(k))
    T = 3 * bm
    q, k, v = inputs(device, 1, 2, 2, T, T, 16, torch.float32)
    v[:, :, 2 * bm:] = float("nan")
    q.requires_grad_()
    out = flash_attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    assert torch.isfinite(out[:, :, :2 * bm]).all() and torch.isfinite(dq[:, :, :2 * bm]).all()
    assert torch.isnan(out[:, :, 2 * bm:]).all()


def test_autotune_degrades_to_one_config_in_the_interpreter():
    from logitlab.kernels.triton_common import INTERPRET
    from logitlab.kernels.triton_flash_bwd import _dkdv_kernel, _dq_kernel, bwd_configs
    from logitlab.kernels.triton_flash_fwd import flash_fwd_kernel, fwd_configs

    for kernel, configs in ((flash_fwd_kernel, fwd_configs()), (_dkdv_kernel, bwd_configs("dkdv")),
                            (_dq_kernel, bwd_configs("dq"))):
        assert len(kernel.configs) == len(configs)
        distinct = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs}
        assert len(distinct) == (1 if INTERPRET else 24)           # compiled: a real search space
