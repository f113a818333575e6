"""The MLP kinds of a block: GELU (GPT-2), SwiGLU (Llama, Qwen) and ReLU² (the small-model
training recipe), and make_mlp.

Shapes: B batch, T positions, D d_model, F d_ff."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.hooks import tap

_GELU_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu; compiled, the tanh approximation is written as x * sigmoid(2u), which equals
    0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), since 1 + tanh(u) = 2 sigmoid(2u).
    Inductor's CPU code evaluates tanh several times slower than exp: compiled forward + backward
    over a (1024, 3072) float32 tensor took 18.4 ms with F.gelu and 8.8 ms in this form (1 thread),
    within 5e-7 of F.gelu. It is evaluated in float32, as F.gelu does for bf16 (inductor fuses the
    casts). Eager calls F.gelu (one kernel beats five)."""
    if approximate == "tanh" and torch.compiler.is_compiling():
        y = x.float()
        return (y * torch.sigmoid(_GELU_TANH_SCALE * (y + 0.044715 * (y * y * y)))).to(x.dtype)
    return F.gelu(x, approximate=approximate)


class GeluMLP(nn.Module):
    """down_proj(gelu(up_proj(x))): D -> F -> D (GPT-2; approximate="tanh" is GPT-2's gelu_new)."""

    HOOKS = {"pre": "(B, T, F) up_proj(x), the GELU's input", "post": "(B, T, F) gelu(pre), what down_proj reads"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config):
        super().__init__()
        self.approximate = config.gelu_approximate
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = tap(self, "pre", self.up_proj(x))                      # (B, T, F); hook points: hooks.py
        return self.down_proj(tap(self, "post", gelu(h, self.approximate)))


class SwiGLU(nn.Module):
    """down_proj(silu(gate) * up): D -> F -> D (Shazeer 2020; Llama, Qwen).

    gate_up_proj: D -> 2F, its output rows are the gate (F), then the up projection (F): one
    matrix product instead of two. d_ff: another width than config.d_ff (an MoE's shared expert)."""

    HOOKS = {"pre": "(B, T, F) the gate, silu's input", "up": "(B, T, F) the linear branch",
             "post": "(B, T, F) silu(pre) * up, what down_proj reads"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config, d_ff: int | None = None):
        super().__init__()
        d_ff = d_ff or config.d_ff
        self.gate_up_proj = nn.Linear(config.d_model, 2 * d_ff, bias=config.bias)
        self.down_proj = nn.Linear(d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)          # (B, T, F) views each
        gate, up = tap(self, "pre", gate), tap(self, "up", up)    # hook points: hooks.py
        return self.down_proj(tap(self, "post", F.silu(gate) * up))


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): D -> F -> D (So et al. 2021, "Primer"; modded-nanogpt,
    nanochat). Squaring keeps ReLU's sparsity and its cheapness, with a smooth positive side.
    The keys are GeluMLP's (up_proj, down_proj)."""

    def __init__(self, config):
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())        # (B, T, F) -> (B, T, D)


def make_mlp(config) -> nn.Module:
    """`config.mlp` is "gelu", "swiglu" or "relu2"."""
    if config.mlp == "swiglu":
        return SwiGLU(config)
    if config.mlp == "gelu":
        return GeluMLP(config)
    if config.mlp == "relu2":
        return ReluSquaredMLP(config)
    raise ValueError(f"mlp must be 'gelu', 'swiglu' or 'relu2', got {config.mlp!r}")
