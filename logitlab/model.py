"""The decoder-only Transformer: token ids (B, T) -> logits (B, T, V).

model.py owns ModelConfig (frozen, validated) and the Transformer module. It reads no files,
prints nothing and knows no family names; presets and Hugging Face mappings live in
families.py, checkpoint I/O in checkpoint.py / hf.py.

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model,
V vocab (V_padded: the embedding and LM-head rows), H query heads, Hkv key/value heads,
G = H // Hkv, Dh head_dim, F d_ff, L layers.

The path: ids (B, T) -> tok_emb (+ pos_emb for learned positions) -> L blocks -> final_norm ->
lm_head (its first V rows only) -> logits (B, T, V), so padded rows never show.

State-dict keys (an API: checkpoints, Hugging Face maps and accounting rely on them):

    tok_emb.weight                              (V_padded, D)
    pos_emb.weight                              (context_length, D)   positions="learned" only
    blocks.{i}.attn_norm.weight / .bias         (D,)   bias only for norm="layernorm"
    blocks.{i}.attn.qkv_proj.weight / .bias     ((H+2*Hkv)*Dh, D)      rows: q, then k, then v;
                                                                       bias when qkv_bias
    blocks.{i}.attn.o_proj.weight / .bias       (D, H*Dh) / (D,)       bias when bias
    blocks.{i}.attn.q_norm.weight, k_norm.weight (Dh,)  qk_norm only
    blocks.{i}.mlp_norm.weight / .bias          (D,)
    blocks.{i}.mlp.gate_up_proj.weight / .bias  (2F, D) / (2F,)        mlp="swiglu": rows gate, then up
    blocks.{i}.mlp.up_proj.weight / .bias       (F, D) / (F,)          mlp="gelu"
    blocks.{i}.mlp.down_proj.weight / .bias     (D, F) / (D,)
    final_norm.weight / .bias                   (D,)
    lm_head.weight                              (V_padded, D)  the same Parameter as tok_emb.weight
                                                               when tie_embeddings
RoPE cos/sin tables are non-persistent buffers (not in the state dict): `rebuild_buffers()`.
The fused projections (one matrix product for q, k, v and one for gate, up) are split into
Hugging Face's separate tensors by families.py; logitlab model directories written with separate
q_proj / k_proj / v_proj / gate_proj / up_proj keys are joined by checkpoint.upgrade_legacy_state.
With norm_placement="post" the final norm is kept, so the keys do not depend on placement.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from logitlab.kv_cache import KVCache
from logitlab.layers import ATTN_IMPLS, Block, LayerNorm, Linear, RMSNorm, RotaryEmbedding, linear, make_norm


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
        check_field_types(self, prefix="rope_scaling.")
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
        default="pre",
        metadata={"help": "norm before each sublayer (pre, GPT-2/Llama) or after the residual add (post)"})
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

        check_field_types(self)  # JSON types: bools, ints, finite floats, Literal values, rope_scaling
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "vocab_pad_multiple"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
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
        return config_from_dict(cls, data)


def config_from_dict(cls: type, data: dict, name: str | None = None):
    """Build the config dataclass `cls` from a dict (the inverse of dataclasses.asdict); a value
    that is not a dict, or unknown keys, are an error naming them and the known fields. `name`
    (the field the dict was read from, e.g. "rope_scaling") leads the message; default the class."""
    what = name or cls.__name__
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected an object of {cls.__name__} fields, got {_shown(data)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {what} field(s) {unknown}; known fields: {sorted(names)}")
    return cls(**data)


# ------------------------------------------------------------------------------------------
# Field types. Configs are read from JSON, so every field is checked against its declared type
# (the dataclass annotations are the one source): a "false" string is not a bool, 1.0 is not an int.
# ------------------------------------------------------------------------------------------

_BAD = object()  # _conform: the value does not have the type
_PLURAL = {int: "integers", float: "finite numbers", str: "strings", bool: "booleans"}
_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
          type(None): "null", dict: "an object", list: "a list"}


def check_field_types(config, prefix: str = "") -> None:
    """Check every field of the dataclass instance `config` against its annotation, the way a
    value read from JSON must match it: `bool` takes only true/false; `int` an int that is not a
    bool; `float` an int or float (not a bool), finite; `Literal[...]` one of its values;
    `X | None` also None; `tuple[X, ...]` a tuple or list of X; a dataclass an instance or a dict
    of its fields. A mismatch is a ValueError naming prefix + field, the value and the type.
    Values are normalised in place (frozen dataclasses too): an int in a float field becomes a
    float, a list in a tuple field a tuple, a dict in a dataclass field that dataclass."""
    hints = _type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out = conform(value, hints[f.name], prefix + f.name)
        if out is not value:
            object.__setattr__(config, f.name, out)


def conform(value, tp, name: str):
    """`value` as a field of type `tp` holds it (see check_field_types); ValueError naming `name`,
    the value and the expected type when it does not have that type."""
    out = _conform(value, tp, name)
    if out is not _BAD:
        return out
    if typing.get_origin(tp) is Literal:
        raise ValueError(f"{name} must be one of {typing.get_args(tp)}, got {_shown(value)}")
    raise ValueError(f"{name}: expected {describe_type(tp)}, got {_shown(value)}")


def describe_type(tp) -> str:
    """A field type in JSON words, for messages: `int | None` -> 'an integer or null'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        parts = [describe_type(a) for a in args]
        return " or ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + " or " + parts[-1]
    if origin in (tuple, list) and args and (origin is list or args[-1] is Ellipsis):
        return f"a list of {_PLURAL.get(args[0]) or 'items each ' + describe_type(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} items ({', '.join(describe_type(a) for a in args)})"
    if dataclasses.is_dataclass(tp):
        return f"an object ({', '.join(f.name for f in dataclasses.fields(tp))})"
    return _NAMES.get(tp) or getattr(tp, "__name__", str(tp))


def _conform(value, tp, name: str):
    """`value` normalised to the field type `tp` (see check_field_types), or _BAD."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value if any(type(value) is type(a) and value == a for a in args) else _BAD
    if origin in (typing.Union, types.UnionType):
        return next((out for out in (_conform(value, a, name) for a in args) if out is not _BAD), _BAD)
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return _BAD
        kinds = args if origin is tuple and args[-1:] != (Ellipsis,) else args[:1] * len(value)
        if len(kinds) != len(value):
            return _BAD
        out = [_conform(v, k, f"{name}[{i}]") for i, (v, k) in enumerate(zip(value, kinds))]
        return _BAD if any(o is _BAD for o in out) else origin(out)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return config_from_dict(tp, value, name)
        return value if isinstance(value, tp) else _BAD
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _BAD
        try:
            value = float(value)
        except OverflowError:  # an int beyond float range
            return _BAD
        return value if math.isfinite(value) else _BAD
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if tp is type(None):
        return value if value is None else _BAD
    if not isinstance(tp, type):  # an annotation this checker does not know: not checked
        return value
    return value if isinstance(value, tp) else _BAD


@functools.cache
def _type_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------------------------------
# The Transformer
# ------------------------------------------------------------------------------------------

class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size). See the module docstring for the keys.

    attn_impl: "sdpa" (torch's fused scaled_dot_product_attention, default) or "eager" (the
    explicit reference path); a plain attribute, settable at any time.
    validate_inputs: when True (default) forward checks that ids and positions are in range,
    which reads two numbers back from the device; a decode loop that already knows its ids are
    valid may set it False to keep the step free of host syncs. Shape and length checks always run;
    the range checks are skipped while torch.compile traces the model.
    Compiling is done from outside, `torch.compile(model, fullgraph=True)`: forward, backward and
    cached decode trace as one graph with no breaks (a prefill and a decode length each get one
    graph; the cache length becomes a dynamic size after it first changes, not a recompile per step).
    """

    def __init__(self, config: ModelConfig, attn_impl: str = "sdpa"):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"Transformer needs a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.attn_impl = attn_impl
        self.validate_inputs = True
        V, D = config.padded_vocab_size, config.d_model
        self.tok_emb = nn.Embedding(V, D)
        self.pos_emb = nn.Embedding(config.context_length, D) if config.positions == "learned" else None
        self.rope = (RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta,
                                     config.rope_scaling) if config.positions == "rope" else None)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = make_norm(config.norm, D, config.norm_eps)
        self.lm_head = Linear(D, V, bias=False)
        if config.tie_embeddings:
            self.tie_weights()
        self.init_weights()

    # --- set-up ------------------------------------------------------------------------------

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {value!r}")
        self._attn_impl = value

    def tie_weights(self) -> None:
        """Make the LM head the embedding table itself (one Parameter), when tie_embeddings."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def rebuild_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE cos/sin, float32) on the parameters' device,
        and re-tie the LM head, after a model built on the meta device gets real storage:
        `load_state_dict(..., assign=True)` or `to_empty(device=...)` (which unties shared
        Parameters) followed by `init_weights()`."""
        self.tie_weights()
        if self.rope is not None:
            self.rope.rebuild(self.tok_emb.weight.device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation (Radford et al. 2019), in one place:

        - every Linear weight and both embedding tables ~ Normal(0, init_std);
        - the residual output projections (attn.o_proj, mlp.down_proj) ~ Normal(0, init_std /
          sqrt(2L)), so the residual stream's variance does not grow with depth (2 adds per block);
        - every bias zeros; every norm weight ones (LayerNorm bias zeros).
        A tied LM head is the embedding table and is initialised once, as the embedding."""
        std, L = self.config.init_std, self.config.n_layers
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scaled = name.endswith("o_proj") or name.endswith("down_proj")
                if not (module is self.lm_head and self.config.tie_embeddings):
                    nn.init.normal_(module.weight, 0.0, std / math.sqrt(2 * L) if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (RMSNorm, LayerNorm)):
                module.reset_parameters()

    # --- forward -----------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, *, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, vocab_size).

        cache: a KVCache; new keys/values go to slots [cache.length, cache.length + T), attention
        reads slots [0, cache.length + T), and the cache advances by T at the end of this call.
        positions (B, T) (or (T,)) int: position of each token, default cache.length + arange(T)
        (per-row positions let left-padded rows start at 0). attn_mask (B, S') bool with S' >=
        S = cache.length + T (T without a cache): False marks key slot s of row b as padding.
        Logits come in the model's compute dtype (bf16 under bf16 weights or autocast); loss and
        sampling code upcast to float32. They are contiguous also with vocabulary padding: the
        padded rows of the LM head are never multiplied (see _head)."""
        return self.unembed(self._run(ids, cache, positions, attn_mask)[0])

    def forward_features(self, ids, *, cache=None, positions=None, attn_mask=None) -> torch.Tensor:
        """-> h (B, T, D), the last block's output BEFORE the final norm; forward(ids) equals
        unembed(forward_features(ids)). A prefill that needs only the last position's logits
        runs `model.unembed(model.forward_features(ids, cache=cache)[:, -1:])` and skips the
        LM head for the other T-1 positions. Same arguments and cache behaviour as forward."""
        return self._run(ids, cache, positions, attn_mask)[0]

    def forward_with_hidden(self, ids, *, cache=None, positions=None, attn_mask=None):
        """-> (logits (B, T, V), hidden: list of L+1 tensors (B, T, D)).

        As transformers' output_hidden_states: hidden[0] is the embedding output (token plus
        learned position embedding), hidden[i] the output of blocks[i-1] (1 <= i < L), and
        hidden[L] the last block's output AFTER the final norm (unembed(h) applies the final
        norm itself, so use it on hidden[:-1]; the returned logits are hidden[-1] through the LM
        head's first V rows alone)."""
        h, hidden, _ = self._run(ids, cache, positions, attn_mask, want_hidden=True)
        hidden.append(self.final_norm(h))
        return self._head(hidden[-1]), hidden

    def forward_with_attention(self, ids, *, cache=None, positions=None, attn_mask=None):
        """-> (logits (B, T, V), weights: list of L tensors (B, H, T, S)) through the eager path,
        whatever attn_impl is. Masked slots have weight 0; each row sums to 1."""
        h, _, weights = self._run(ids, cache, positions, attn_mask, want_weights=True)
        return self.unembed(h), weights

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D), a residual-stream state before the final norm -> logits (B, T, V):
        final norm, LM head, padded columns dropped (the logit lens reads any block this way)."""
        return self._head(self.final_norm(h))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) after the final norm -> logits (B, T, V).

        With vocabulary padding the LM head multiplies only its first V rows (a contiguous view
        of the (V_padded, D) weight) instead of slicing V columns out of (B, T, V_padded) logits:
        the same values bit for bit, but contiguous logits, so the loss's reshape copies nothing
        and backward fills no (B, T, V_padded) gradient with zeros (head + cross-entropy forward and
        backward at (1024, 384) x 50304: 1530 -> 1333 ms, 1 thread)."""
        V = self.config.vocab_size
        weight = self.lm_head.weight                               # (V_padded, D)
        if weight.shape[0] == V:
            return self.lm_head(h)                                 # (B, T, V)
        return linear(h, weight[:V])                               # (B, T, V)

    def _run(self, ids, cache, positions, attn_mask, want_hidden=False, want_weights=False):
        """Embeddings and blocks: -> (h (B, T, D) before the final norm, hidden list, weights list)."""
        cfg = self.config
        self._check_ids(ids)
        B, T = ids.shape
        past = cache.length if cache is not None else 0
        S = past + T
        if S > cfg.context_length:
            raise ValueError(f"sequence too long: {past} cached + {T} new = {S} positions exceed "
                             f"context_length ({cfg.context_length})")
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"ids have batch size {B} but the KV cache was built for {cache.batch_size}")
        if positions is None:
            positions = torch.arange(past, S, device=ids.device).unsqueeze(0)          # (1, T)
        else:
            positions = self._check_positions(positions, B, T)
        mask, is_causal = self._mask(attn_mask, B, T, past, ids.device)

        x = self.tok_emb(ids)                                      # (B, T, D)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)                        # (B or 1, T, D) broadcast over B
        rope = None
        if self.rope is not None:                                  # cos, sin: (B|1, T, 1, Dh)
            cos, sin = self.rope(positions)
            rope = (cos, sin) if cos.dtype == x.dtype else (cos.to(x.dtype), sin.to(x.dtype))
        hidden, weights = ([x] if want_hidden else []), []
        for i, block in enumerate(self.blocks):
            x, w = block(x, rope, cache=cache, layer=i, mask=mask, is_causal=is_causal,
                         impl=self.attn_impl, need_weights=want_weights)
            if want_weights:
                weights.append(w)
            if want_hidden and i < len(self.blocks) - 1:
                hidden.append(x)
        if cache is not None:
            cache.advance(T)  # the one place the cache moves
        return x, hidden, weights

    @staticmethod
    def _mask(attn_mask, B, T, past, device):
        """-> (mask (B|1, 1, T, S) bool or None, is_causal) for keys at slots [0, S), S = past + T.

        The query at slot past+t may read key slot s when s <= past+t and attn_mask[b, s]. Every
        query may always read its own slot, so a padding row never has all keys masked (which
        would make softmax NaN); padding rows' outputs are meaningless and ignored."""
        S = past + T
        if attn_mask is None:
            if past == 0:
                return None, True                                  # plain causal, SDPA's fast path
            if T == 1:
                return None, False                                 # one new query sees every slot
        q_slot = torch.arange(past, S, device=device)              # (T,)
        k_slot = torch.arange(S, device=device)                    # (S,)
        causal = k_slot[None, :] <= q_slot[:, None]                # (T, S)
        if attn_mask is None:
            return causal[None, None], False                       # (1, 1, T, S)
        if attn_mask.dtype != torch.bool or attn_mask.ndim != 2 or attn_mask.shape[0] != B \
                or attn_mask.shape[1] < S:
            raise ValueError(f"attn_mask must be bool of shape (B={B}, S>={S}), got "
                             f"{attn_mask.dtype} {tuple(attn_mask.shape)}")
        own = k_slot[None, :] == q_slot[:, None]                   # (T, S)
        mask = (causal[None] & attn_mask[:, None, :S]) | own[None]   # (B, T, S)
        return mask[:, None], False                                # (B, 1, T, S)

    def _validate_values(self, t: torch.Tensor) -> bool:
        """Range checks read values back to the host: skipped when validate_inputs is off, on the
        meta device, and while torch.compile traces (a data-dependent check would break the graph)."""
        return self.validate_inputs and t.device.type != "meta" and not torch.compiler.is_compiling()

    def _check_ids(self, ids) -> None:
        if not isinstance(ids, torch.Tensor):
            raise ValueError(f"ids must be a torch.Tensor of shape (B, T), got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be int64 (or int32), got {ids.dtype}")
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
        if self._validate_values(ids):
            lo, hi = torch.stack(torch.aminmax(ids)).tolist()     # one host sync
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is out of range for vocab_size "
                                 f"{self.config.vocab_size} (valid ids: 0..{self.config.vocab_size - 1})")

    def _check_positions(self, positions, B, T):
        if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int64, torch.int32):
            got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"positions must be an int64 (or int32) tensor of shape (B, T), got {got}")
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)                     # (T,) -> (1, T)
        if positions.ndim != 2 or positions.shape[1] != T or positions.shape[0] not in (1, B):
            raise ValueError(f"positions must have shape (B={B}, T={T}) or (T,), "
                             f"got {tuple(positions.shape)}")
        if self._validate_values(positions):
            lo, hi = torch.stack(torch.aminmax(positions)).tolist()
            if lo < 0 or hi >= self.config.context_length:
                raise ValueError(f"position {lo if lo < 0 else hi} is out of range for context_length "
                                 f"{self.config.context_length}")
        return positions

    # --- Hugging Face entry points ----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory, **kwargs) -> "Transformer":
        """Load a Hugging Face or logitlab model directory (see logitlab.hf.load_pretrained)."""
        from logitlab.hf import load_pretrained

        return load_pretrained(directory, **kwargs)

    def save_pretrained(self, directory, **kwargs):
        """Write a Hugging Face directory that transformers loads (see logitlab.hf.save_pretrained)."""
        from logitlab.hf import save_pretrained

        return save_pretrained(self, directory, **kwargs)
