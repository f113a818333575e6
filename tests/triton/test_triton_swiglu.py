"""Fused SwiGLU (kernels.triton_swiglu) against F.silu(gate) * up: values and the gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logitlab.kernels.triton_swiglu import swiglu


def reference(gu):
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [37, 1100])                      # one ragged block, two blocks
def test_swiglu_equals_silu_times_up(device, dtype, width):
    gu = (torch.randn(2, 3, 2 * width, device=device) * 3).to(dtype).requires_grad_()
    out, ref = swiglu(gu), reference(gu)
    assert out.shape == ref.shape == (2, 3, width) and out.dtype == dtype
    dy = torch.randn_like(out)
    (got,), (want,) = torch.autograd.grad(out, (gu,), dy), torch.autograd.grad(ref, (gu,), dy)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(got, want, **tol)


def test_swiglu_of_a_sliced_projection(device):
    full = torch.randn(4, 5, 40, device=device)
    gu = full[..., :32]                                            # rows not contiguous
    torch.testing.assert_close(swiglu(gu), reference(gu), rtol=1e-5, atol=1e-6)


def test_swiglu_rejects_an_odd_width(device):
    with pytest.raises(ValueError, match="even, non-zero width"):
        swiglu(torch.randn(3, 7, device=device))
