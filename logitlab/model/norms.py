"""The two normalisations of the residual stream: RMSNorm and LayerNorm, and make_norm.

Each normalises over the last dimension with statistics in float32 where the input is in a lower
precision, as Hugging Face does, so bf16 runs match theirs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension (Zhang & Sennrich 2019).

    The statistics are computed in float32 and the normalised value is cast back to the input
    dtype before the weight multiplies it, exactly as Llama / Hugging Face do, so bf16 runs
    match theirs bit for bit. affine=False: no weight at all, y = x / sqrt(mean(x^2) + eps)
    (ModelConfig.norm_affine; modded-nanogpt's parameter-free norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:                       # (..., dim) -> (..., dim)
        if self.weight is None:                                   # parameter-free: statistics in float32
            return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one call, bit for bit the three-op form on
        # a float32 input (the weight goes in too: the same products). Other dtypes are normalised
        # in float32 and rounded to x's dtype before the weight, as Hugging Face does (handing
        # F.rms_norm a bf16 x directly rounds eps to bf16 on older torch releases).
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)


class ZeroCenteredRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), the weight stored as an offset from 1 and
    initialised to zeros (Qwen3-Next, Qwen3.5): weight decay then pulls the scale towards 1, not 0.

    The whole product is taken in float32 and only then rounded to x's dtype (where RMSNorm rounds
    before the weight), which is the order those checkpoints were trained with."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:                       # (..., dim) -> (..., dim)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class GatedRMSNorm(nn.Module):
    """y = weight * x / rms(x) * silu(z): the output norm of a Gated DeltaNet head, gated by a
    projection z of the layer's input. Statistics in float32, rounded before the weight as RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:     # x, z (..., dim)
        normed = self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (normed * F.silu(z.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LayerNorm(nn.Module):
    """y = weight * (x - mean) / sqrt(var + eps) + bias over the last dimension (Ba et al. 2016).

    Always with a bias, as GPT-2 has; the state-dict keys are `weight` and `bias`."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


def make_norm(kind: str, dim: int, eps: float, zero_centered: bool = False, affine: bool = True) -> nn.Module:
    """`kind` is ModelConfig.norm: "rmsnorm" or "layernorm"; zero_centered (rmsnorm only) is
    ModelConfig.norm_zero_centered, affine (rmsnorm only) ModelConfig.norm_affine."""
    if kind == "rmsnorm":
        return ZeroCenteredRMSNorm(dim, eps) if zero_centered else RMSNorm(dim, eps, affine)
    if kind == "layernorm":
        return LayerNorm(dim, eps)
    raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {kind!r}")
