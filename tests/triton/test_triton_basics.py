"""Vector add, fused softmax and fused RMSNorm forward (kernels.triton_basics) against eager torch."""

from __future__ import annotations

import pytest
import torch

from logitlab.kernels import triton_basics as tb
from logitlab.model.norms import RMSNorm


@pytest.mark.parametrize("n", [1, 1000, 2049])                     # one lane, ragged, three blocks
def test_vector_add_equals_torch(device, n):
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    torch.testing.assert_close(tb.vector_add(x, y), x + y, rtol=0, atol=0)


def test_vector_add_keeps_shape_and_half_dtype(device):
    x = torch.randn(3, 7, device=device).half()
    y = torch.randn(3, 7, device=device).half()
    out = tb.vector_add(x, y)
    assert out.shape == (3, 7) and out.dtype == torch.float16
    torch.testing.assert_close(out, (x.float() + y.float()).half(), rtol=0, atol=0)


def test_vector_add_rejects_mismatched_inputs(device):
    with pytest.raises(ValueError, match="one shape and dtype"):
        tb.vector_add(torch.zeros(3, device=device), torch.zeros(4, device=device))


@pytest.mark.parametrize("cols", [1, 37, 128])
def test_softmax_equals_torch(device, cols):
    x = torch.randn(5, cols, device=device) * 4
    if cols > 1:
        x[0, 0] = float("-inf")                                    # a masked entry gets weight 0
    out = tb.softmax(x)
    torch.testing.assert_close(out, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    assert out[0, 0] == (0 if cols > 1 else 1)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # -inf - -inf, as torch
def test_softmax_of_an_all_masked_row_is_nan_as_torch(device):
    x = torch.full((2, 5), float("-inf"), device=device)
    assert torch.isnan(tb.softmax(x)).all() and torch.isnan(torch.softmax(x, -1)).all()


def test_softmax_bf16_within_one_rounding(device):
    x = torch.randn(2, 3, 50, device=device).bfloat16()
    ref = torch.softmax(x.float(), -1)
    out = tb.softmax(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-3)


def test_softmax_of_a_transposed_view(device):
    x = torch.randn(6, 4, device=device).t()                       # last dim not contiguous
    torch.testing.assert_close(tb.softmax(x), torch.softmax(x, -1), rtol=1e-5, atol=1e-6)


def test_softmax_rejects_empty_rows(device):
    with pytest.raises(ValueError, match="1 to"):
        tb.softmax(torch.zeros(3, 0, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_forward_equals_rmsnorm(device, dtype):
    norm = RMSNorm(37, eps=1e-5).to(device)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, 37, device=device).to(dtype)
    y, rstd = tb.rms_norm_forward(x, norm.weight.detach(), 1e-5)
    ref = norm(x).detach()
    assert y.dtype == ref.dtype and y.shape == ref.shape and rstd.shape == (10,)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(y, ref, **tol)
    expected_rstd = x.float().pow(2).mean(-1).add(1e-5).rsqrt().reshape(-1)
    torch.testing.assert_close(rstd, expected_rstd, rtol=1e-5, atol=1e-6)


def test_rms_norm_forward_checks_its_arguments(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="weight has 7 entries"):
        tb.rms_norm_forward(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="eps must be positive"):
        tb.rms_norm_forward(x, torch.ones(8, device=device), eps=0.0)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        tb.rms_norm_forward(x.long(), torch.ones(8, device=device))
