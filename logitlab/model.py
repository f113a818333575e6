"""The decoder-only Transformer: token ids (B, T) -> logits (B, T, V).

model.py owns ModelConfig (frozen, validated) and the Transformer module. It reads no files,
prints nothing and knows no family names; presets and Hugging Face mappings live in
families.py, checkpoint I/O in checkpoint.py / hf.py.

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model,
V vocab (padded), H query heads, Hkv key/value heads, G = H // Hkv, Dh head_dim, F d_ff,
L layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal


def _help(text: str):
    return field(default=None, metadata={"help": text})


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1-style RoPE frequency scaling ("llama3" rope_type in Hugging Face configs).

    Wavelengths longer than original_context_length / low_freq_factor are divided by `factor`,
    shorter than original_context_length / high_freq_factor are kept, and the band in between
    is interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context_length: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}")
        if self.original_context_length <= 0:
            raise ValueError("rope_scaling.original_context_length must be > 0, "
                             f"got {self.original_context_length}")


@dataclass(frozen=True)
class ModelConfig:
    """Every architectural switch of the model, one field each.

    `None` in n_kv_heads / head_dim / d_ff / qkv_bias means "derive it": n_heads, d_model //
    n_heads, 4·D for GELU or Llama's round_up(8·D/3, 256) for SwiGLU, and `bias`. The derived
    values are filled in by __post_init__, so a built config always holds concrete numbers.
    """

    vocab_size: int = field(default=50257, metadata={"help": "number of real tokens V"})
    context_length: int = field(default=1024, metadata={"help": "longest sequence the model accepts"})
    d_model: int = field(default=768, metadata={"help": "residual stream width D"})
    n_layers: int = field(default=12, metadata={"help": "number of blocks L"})
    n_heads: int = field(default=12, metadata={"help": "query heads H"})
    n_kv_heads: int | None = _help("key/value heads Hkv (GQA when < n_heads; default n_heads)")
    head_dim: int | None = _help("per-head width Dh (default d_model // n_heads)")
    d_ff: int | None = _help("MLP hidden width F (default 4*D for gelu, round_up(8D/3, 256) for swiglu)")
    norm: Literal["layernorm", "rmsnorm"] = field(default="layernorm", metadata={"help": "normalisation"})
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon inside the norms"})
    norm_placement: Literal["pre", "post"] = field(
        default="pre", metadata={"help": "norm before each sublayer (pre, GPT-2/Llama) or after the residual add (post)"})
    mlp: Literal["gelu", "swiglu"] = field(default="gelu", metadata={"help": "MLP kind"})
    gelu_approximate: Literal["tanh", "none"] = field(
        default="tanh", metadata={"help": "GELU form for mlp=gelu (GPT-2 uses tanh)"})
    positions: Literal["learned", "rope", "none"] = field(default="learned", metadata={"help": "position encoding"})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base"})
    rope_scaling: RopeScaling | None = field(default=None, metadata={"help": "Llama-3.1 RoPE scaling"})
    qk_norm: bool = field(default=False, metadata={"help": "RMSNorm each head of q and k before RoPE (Qwen3)"})
    bias: bool = field(default=True, metadata={"help": "biases in the output projection and MLP"})
    qkv_bias: bool | None = _help("biases in the q/k/v projections (default: same as bias)")
    tie_embeddings: bool = field(default=True, metadata={"help": "LM head shares the embedding table"})
    vocab_pad_multiple: int = field(
        default=1, metadata={"help": "pad the embedding/LM head rows to a multiple of this (1 = no padding)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on residual branches during training"})
    init_std: float = field(default=0.02, metadata={"help": "std of the normal weight initialisation"})

    def __post_init__(self) -> None:
        def fix(name: str, value) -> None:
            object.__setattr__(self, name, value)

        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "vocab_pad_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, allowed in (("norm", ("layernorm", "rmsnorm")), ("norm_placement", ("pre", "post")),
                              ("mlp", ("gelu", "swiglu")), ("gelu_approximate", ("tanh", "none")),
                              ("positions", ("learned", "rope", "none"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.n_kv_heads is None:
            fix("n_kv_heads", self.n_heads)
        if self.n_kv_heads <= 0:
            raise ValueError(f"n_kv_heads must be a positive integer, got {self.n_kv_heads!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                                 "unless head_dim is given")
            fix("head_dim", self.d_model // self.n_heads)
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive integer, got {self.head_dim!r}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for positions='rope'")
        if self.d_ff is None:
            if self.mlp == "gelu":
                fix("d_ff", 4 * self.d_model)
            else:
                fix("d_ff", 256 * math.ceil(int(8 * self.d_model / 3) / 256))
        if self.d_ff <= 0:
            raise ValueError(f"d_ff must be a positive integer, got {self.d_ff!r}")
        if self.qkv_bias is None:
            fix("qkv_bias", self.bias)
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if isinstance(self.rope_scaling, dict):
            fix("rope_scaling", RopeScaling(**self.rope_scaling))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table and the LM head: vocab_size rounded up to vocab_pad_multiple."""
        m = self.vocab_pad_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def n_groups(self) -> int:
        """G = H // Hkv query heads share each key/value head."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field (rope_scaling as a nested dict or None)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """Inverse of to_dict; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(names)}")
        return cls(**data)
