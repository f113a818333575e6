"""Fused RMSNorm forward+backward (kernels.triton_norm) against logitlab.model.norms.RMSNorm, and
the fused chunked LM head + cross-entropy (kernels.triton_cross_entropy) against
logitlab.train.loss.cross_entropy on the full logits: values and gradients."""

from __future__ import annotations

import pytest
import torch

from logitlab.kernels.triton_cross_entropy import default_chunk_rows, linear_cross_entropy
from logitlab.kernels.triton_norm import rms_norm
from logitlab.model.norms import RMSNorm
from logitlab.train.loss import IGNORE_INDEX, cross_entropy


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [37, 64])
def test_rms_norm_forward_backward_equal_rmsnorm(device, dtype, D):
    norm = RMSNorm(D, eps=1e-6).to(device)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 7, D, device=device).to(dtype).requires_grad_()
    y, ref = rms_norm(x, norm.weight, 1e-6), norm(x)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    got, want = grads(y, (x, norm.weight)), grads(ref, (x, norm.weight))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=4e-2)
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(got[0], want[0], **tol)                          # dx, in x's dtype
    torch.testing.assert_close(got[1], want[1], rtol=tol["rtol"], atol=tol["atol"] * 5)   # dw, summed over rows


def test_rms_norm_rejects_a_wrong_weight(device):
    with pytest.raises(ValueError, match="weight has 4 entries for rows of 8"):
        rms_norm(torch.randn(2, 8, device=device), torch.ones(4, device=device))


def _head(device, dtype, N=14, D=24, V=1500, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(device, dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(device)
    return h, w, t


def _reference(h, w, t):
    return cross_entropy((h @ w.t()).unsqueeze(0), t.unsqueeze(0))


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, None, 64])
def test_linear_cross_entropy_equals_the_reference_fp32(device, chunk_rows):
    h, w, t = _head(device, torch.float32)
    t[3] = IGNORE_INDEX
    loss, ref = linear_cross_entropy(h, w, t, chunk_rows=chunk_rows), _reference(h, w, t)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    got, want = torch.autograd.grad(loss * 3, (h, w)), torch.autograd.grad(ref * 3, (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[0][3].abs().sum() == 0                              # an ignored row gets no gradient


def test_linear_cross_entropy_bf16_and_batched_shapes(device):
    h, w, t = _head(device, torch.bfloat16, N=12)
    loss = linear_cross_entropy(h.view(2, 6, -1), w, t.view(2, 6))
    ref = _reference(h, w, t)
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
    got, want = torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2e-3)


def test_linear_cross_entropy_all_ignored_is_nan_like_the_reference(device):
    h, w, t = _head(device, torch.float32, N=4)
    t[:] = IGNORE_INDEX
    assert torch.isnan(linear_cross_entropy(h, w, t)) and torch.isnan(_reference(h, w, t))


def test_linear_cross_entropy_checks_its_arguments(device):
    h, w, t = _head(device, torch.float32, N=4)
    t[1] = 1500
    with pytest.raises(ValueError, match="targets must be in \\[0, 1500\\).*1500"):
        linear_cross_entropy(h, w, t)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        linear_cross_entropy(h, w, t.clamp(max=3), chunk_rows=0)
    with pytest.raises(ValueError, match="share D"):
        linear_cross_entropy(h, w[:, :8], t.clamp(max=3))
    with pytest.raises(ValueError, match="int64"):
        linear_cross_entropy(h, w, t.int())


def test_default_chunk_keeps_a_chunk_of_logits_near_the_size_of_h():
    N, V, D = 8192, 248_320, 1024
    C = default_chunk_rows(N, V, D)
    assert C & (C - 1) == 0 and C * V <= 2 * N * D                # a power of two; (C, V) ~ (N, D)
    assert default_chunk_rows(3, 10, 64) == 3                      # never more rows than there are
