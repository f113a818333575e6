"""The Transformer block, and the names of its parts in one place.

A block joins attention (attention.py) and an MLP (mlp.py) with two norms (norms.py) and
residual adds, pre- or post-norm; rotary positions are rope.py's. Every projection is a plain
nn.Linear: fast matrix-product routes are installed into a built model from outside (see
logitlab.kernels). How blocks are stacked, masks built and the KV cache advanced is
transformer.py's business; the cache is duck-typed (`update(layer, k, v)`).

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model,
H query heads.
"""

from __future__ import annotations

import torch
from torch import nn

from logitlab.model.attention import ATTN_IMPLS, Attention, eager_attention, repeat_kv
from logitlab.model.deltanet import GatedDeltaNet
from logitlab.model.hooks import tap
from logitlab.model.mla import MLA
from logitlab.model.mlp import GeluMLP, SwiGLU, gelu, make_mlp
from logitlab.model.moe import MoE
from logitlab.model.norms import LayerNorm, RMSNorm, make_norm
from logitlab.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq

__all__ = ["ATTN_IMPLS", "Attention", "Block", "GeluMLP", "LayerNorm", "RMSNorm", "RotaryEmbedding",
           "SwiGLU", "apply_rope", "eager_attention", "gelu", "make_mlp", "make_norm", "repeat_kv",
           "rope_inv_freq"]


# ------------------------------------------------------------------------------------------
# Compatibility: the trainer's bf16 matmul setting, kept until it installs
# logitlab.kernels.cpu_bf16 itself. The model reads none of it.
# ------------------------------------------------------------------------------------------

BF16_MATMUL_MODES = ("auto", "native", "fp32")
_bf16_matmul = "auto"


def set_bf16_matmul(mode: str) -> None:
    """Record the bf16 matmul mode ("auto", "native" or "fp32"). Compatibility only: no layer
    reads it; the float32-GEMM route is installed with logitlab.kernels.cpu_bf16.install."""
    global _bf16_matmul
    if mode not in BF16_MATMUL_MODES:
        raise ValueError(f"bf16 matmul mode must be one of {BF16_MATMUL_MODES}, got {mode!r}")
    _bf16_matmul = mode


def bf16_matmul_mode() -> str:
    """The mode last recorded by set_bf16_matmul (compatibility only)."""
    return _bf16_matmul


# ------------------------------------------------------------------------------------------
# The block
# ------------------------------------------------------------------------------------------

class Block(nn.Module):
    """One Transformer block: a token mixer then an MLP, each with a norm and a residual add.

    pre-norm (GPT-2, Llama):  x = x + mix(attn_norm(x));  x = x + mlp(mlp_norm(x))
    post-norm (Vaswani et al. 2017): x = attn_norm(x + mix(x));  x = mlp_norm(x + mlp(x))
    The mixer is attention (`attn`; a sliding window for layer type "sliding_attention"; multi-head
    latent attention, mla.py, when config.is_mla) or, for
    "linear_attention", Gated DeltaNet (`linear_attn`, deltanet.py): the one difference between
    the blocks of a hybrid stack. The MLP is dense (mlp.py) or, for mlp kind "moe", a mixture of
    experts (moe.py; `mlp_type` says which). Dropout (config.dropout, training only)
    acts on each sublayer's output before the add."""

    HOOKS = {"resid_pre": "(B, T, D) the residual stream entering the block",
             "attn_out": "(B, T, D) the token mixer's output (attention or Gated DeltaNet)",
             "resid_mid": "(B, T, D) the residual stream after the mixer's add",
             "mlp_out": "(B, T, D) the MLP's output", "resid_post": "(B, T, D) the block's output"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config, layer_type: str = "full_attention", mlp_type: str = "dense"):
        super().__init__()
        self.layer_type = layer_type
        self.post_norm = config.norm_placement == "post"
        zc, affine = config.norm_zero_centered, config.norm_affine
        self.attn_norm = make_norm(config.norm, config.d_model, config.norm_eps, zc, affine)
        if layer_type == "linear_attention":
            self.attn, self.linear_attn = None, GatedDeltaNet(config)
        else:
            attn = MLA(config) if config.is_mla else Attention(config, layer_type)   # mla.py: latent attention
            self.attn, self.linear_attn = attn, None
        self.mlp_norm = make_norm(config.norm, config.d_model, config.norm_eps, zc, affine)
        self.mlp_type = mlp_type
        self.mlp = MoE(config) if mlp_type == "moe" else make_mlp(config)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else None

    def _drop(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dropout is None or not self.training else self.dropout(t)

    def _mlp(self, x, record):
        return self.mlp(x, record=record) if self.mlp_type == "moe" else self.mlp(x)

    def _mix(self, x, rope, cache, layer, mask, is_causal, impl, need_weights, pad, key_rope, record,
             value_embed=None):
        if self.linear_attn is not None:
            return self.linear_attn(x, cache=cache, layer=layer, pad=pad, impl=impl, record=record), None
        return self.attn(x, rope, cache=cache, layer=layer, mask=mask, is_causal=is_causal, impl=impl,
                         need_weights=need_weights, key_rope=key_rope, value_embed=value_embed)

    def forward(self, x, rope, *, cache=None, layer=0, mask=None, is_causal=False, impl="sdpa",
                need_weights=False, pad=None, key_rope=None, record=None, value_embed=None):
        """x (B, T, D) -> (x (B, T, D), attention weights (B, H, T, S) or None).

        pad (B, T) bool or None: the padding of this call's positions (Gated DeltaNet zeroes
        them); key_rope: see Attention.forward; record: a dict for Gated DeltaNet's g and beta and an
        MoE layer's routing (router logits, experts, weights); value_embed: (B, Hkv, T, Dh) added to
        the attention's values (ValueEmbedding)."""
        args = (cache, layer, mask, is_causal, impl, need_weights, pad, key_rope, record, value_embed)
        x = tap(self, "resid_pre", x)                              # hook points: hooks.py
        if self.post_norm:
            a, weights = self._mix(x, rope, *args)
            x = tap(self, "resid_mid", self.attn_norm(x + tap(self, "attn_out", self._drop(a))))
            x = self.mlp_norm(x + tap(self, "mlp_out", self._drop(self._mlp(x, record))))
        else:
            a, weights = self._mix(self.attn_norm(x), rope, *args)
            x = tap(self, "resid_mid", x + tap(self, "attn_out", self._drop(a)))
            x = x + tap(self, "mlp_out", self._drop(self._mlp(self.mlp_norm(x), record)))
        return tap(self, "resid_post", x), weights
