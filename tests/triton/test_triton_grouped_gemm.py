"""The Triton grouped product (kernels.triton_grouped_gemm) against a per-group loop of F.linear
and against model.moe_forms.group_products in a whole MoE layer: values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logitlab.kernels.triton_grouped_gemm import grouped_mm, install_grouped_gemm, tile_schedule


def reference(x, w, counts):
    return torch.cat([F.linear(chunk, w[e]) for e, chunk in enumerate(x.split(counts.tolist()))])


def test_tile_schedule_covers_every_row_once_inside_its_group():
    counts = torch.tensor([0, 70, 3, 0, 32, 33])
    expert, start, end = tile_schedule(counts, block_m=32)
    assert expert.tolist() == [1, 1, 1, 2, 4, 5, 5]
    assert start.tolist() == [0, 32, 64, 70, 73, 105, 137] and end.tolist() == [70, 70, 70, 73, 105, 138, 138]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 40, 1], [0, 0, 7, 0]])     # ragged, empty groups, more than a tile
def test_grouped_mm_equals_a_loop_of_products(device, dtype, counts):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 24, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(4, 40, 24, generator=g) * 0.2).to(device, dtype).requires_grad_()
    out, ref = grouped_mm(x, w, counts.to(device)), reference(x, w, counts)
    dy = torch.randn(out.shape, generator=g).to(device, dtype)
    got, want = torch.autograd.grad(out, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=3e-2)
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    assert all(float(got[1][e].abs().max()) == 0 for e in range(4) if counts[e] == 0)   # no rows, no gradient


def test_grouped_mm_names_shapes_that_do_not_fit(device):
    with pytest.raises(ValueError, match="do not fit"):
        grouped_mm(torch.randn(5, 8, device=device), torch.randn(2, 4, 8, device=device), torch.tensor([2, 2]))


@pytest.mark.parametrize("moe_d_ff", [48, 16])     # the router weight on the output (F > D), on the hidden row
def test_an_moe_layer_on_the_kernels_equals_the_torch_grouped_form(device, moe_d_ff):
    from logitlab.model.moe import MoE
    from logitlab.model.transformer import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_heads=4, n_layers=1, mlp="swiglu",
                         n_experts=4, n_experts_per_token=2, moe_d_ff=moe_d_ff)
    layer = MoE(config).to(device)
    with torch.no_grad():
        for p in layer.parameters():                                      # MoE leaves its init to the model
            p.copy_(torch.randn(p.shape) * 0.2)
    layer.impl = "grouped"
    x = torch.randn(2, 9, 32, device=device, requires_grad=True)
    ref = layer(x)
    want = torch.autograd.grad(ref.square().sum(), [x, *layer.parameters()])
    assert install_grouped_gemm(layer) == 1
    out = layer(x)
    got = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
