"""ModelConfig: every architectural switch of the model, one typed field each, validated.

config.py owns the frozen config dataclasses (ModelConfig, RopeScaling). The field-type checks
every config of the package shares (check_field_types, conform, describe_type, config_from_dict)
live in fields.py and are re-exported here. It imports nothing of logitlab outside model/.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from logitlab.model.fields import (  # noqa: F401  (re-exported: their old home)
    check_field_types,
    config_from_dict,
    conform,
    describe_type,
)
from logitlab.model.limits import SIZE_LIMITS, check_size_limits  # noqa: F401  (importable from here)
from logitlab.model.mla_config import check_mla, mla_head_dim
from logitlab.model.moe_config import check_moe

LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
MlpType = Literal["dense", "moe"]
RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_topk"]


def _help(text: str):
    return field(default=None, metadata={"help": text})


RopeType = Literal["linear", "dynamic", "ntk", "yarn", "llama3", "longrope"]
# the fields each rope_type reads besides factor (the others must stay null); defaults filled in
_ROPE_FIELDS = {
    "linear": {}, "ntk": {}, "dynamic": {"original_context_length": None},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 8192},
    "yarn": {"original_context_length": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
             "mscale_all_dim": None, "attention_factor": None, "truncate": True},
    "longrope": {"original_context_length": None, "short_factor": None, "long_factor": None,
                 "attention_factor": None},
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, one kind per `rope_type` (Hugging Face's names; the formulas are in
    logitlab.model.rope_scaling): "linear" position interpolation, "dynamic" NTK (base grown with
    the sequence at run time), "ntk" static NTK-aware base, "yarn", "llama3" (Llama 3.1) and
    "longrope" (per-frequency short/long factors).

    rope_type defaults to "llama3", so the JSON of earlier versions ({factor, low_freq_factor,
    high_freq_factor, original_context_length}) still reads as before. Each kind reads only its
    own fields (_ROPE_FIELDS); a field another kind reads must stay null, and a kind's optional
    fields get their defaults (llama3 1.0 / 4.0 / 8192; yarn beta_fast 32, beta_slow 1, truncate)."""

    factor: float = 8.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_context_length: int | None = None
    rope_type: RopeType = "llama3"
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        check_field_types(self, prefix="rope_scaling.")
        check_size_limits(self, prefix="rope_scaling.")
        kind, own = self.rope_type, _ROPE_FIELDS[self.rope_type]
        for f in dataclasses.fields(self)[1:]:
            value = getattr(self, f.name)
            if f.name == "rope_type" or f.name in own:
                if value is None and own.get(f.name) is not None:
                    object.__setattr__(self, f.name, own[f.name])
            elif value is not None:
                raise ValueError(f"rope_scaling.{f.name}={value!r} is not read by rope_type={kind!r} "
                                 f"(its fields: factor{''.join(', ' + k for k in own)})")
        missing = [k for k in ("original_context_length", "short_factor", "long_factor")
                   if k in own and getattr(self, k) is None]
        if missing:
            raise ValueError(f"rope_scaling of rope_type={kind!r} needs {', '.join(missing)}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}")
        if self.original_context_length is not None and self.original_context_length <= 0:
            raise ValueError("rope_scaling.original_context_length must be > 0, "
                             f"got {self.original_context_length}")
        if kind == "yarn" and not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(f"rope_scaling needs 0 < beta_slow <= beta_fast, got beta_slow={self.beta_slow}, "
                             f"beta_fast={self.beta_fast}")
        if kind == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"rope_scaling.short_factor has {len(self.short_factor)} entries but long_factor "
                             f"{len(self.long_factor)}")


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
    d_ff: int | None = _help("MLP hidden width F (default 4*D for gelu and relu2, round_up(8D/3, 256) for swiglu)")
    norm: Literal["layernorm", "rmsnorm"] = field(default="layernorm", metadata={"help": "normalisation"})
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon inside the norms"})
    norm_placement: Literal["pre", "post"] = field(
        default="pre",
        metadata={"help": "norm before each sublayer (pre, GPT-2/Llama) or after the residual add (post)"})
    mlp: Literal["gelu", "swiglu", "relu2"] = field(
        default="gelu", metadata={"help": "MLP kind: gelu (GPT-2), swiglu (Llama) or relu2 (relu(x)^2, Primer)"})
    gelu_approximate: Literal["tanh", "none"] = field(
        default="tanh", metadata={"help": "GELU form for mlp=gelu (GPT-2 uses tanh)"})
    positions: Literal["learned", "sinusoidal", "rope", "alibi", "none"] = field(
        default="learned", metadata={"help": "position encoding: learned (GPT-2), sinusoidal (Vaswani), rope, "
                                              "alibi (Press et al.) or none (NoPE)"})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base"})
    rope_scaling: RopeScaling | None = field(
        default=None,
        metadata={"help": "RoPE frequency scaling (rope_type: linear, dynamic, ntk, yarn, llama3, longrope)"})
    rope_interleaved: bool = field(
        default=False, metadata={"help": "RoPE rotates adjacent pairs (RoFormer / Meta layout) instead of halves"})
    qk_norm: bool = field(default=False, metadata={"help": "RMSNorm each head of q and k before RoPE (Qwen3)"})
    bias: bool = field(default=True, metadata={"help": "biases in the output projection and MLP"})
    qkv_bias: bool | None = _help("biases in the q/k/v projections (default: same as bias)")
    tie_embeddings: bool = field(default=True, metadata={"help": "LM head shares the embedding table"})
    vocab_pad_multiple: int = field(
        default=1, metadata={"help": "pad the embedding/LM head rows to a multiple of this (1 = no padding)"})
    attention: Literal["causal", "bidirectional"] = field(
        default="causal", metadata={"help": "causal mask (a decoder: position t reads 0..t) or bidirectional "
                                             "(an encoder, BERT: every position reads every position)"})
    # --- attention variants and hybrid stacks (Mistral, gpt-oss, Qwen3-Next, Qwen3.5) ---
    layer_types: tuple[LayerType, ...] | None = _help(
        "token mixer of each layer: full_attention, sliding_attention or linear_attention (null: all full)")
    sliding_window: int | None = _help("keys a sliding_attention query reads, itself included (W)")
    attn_gate: Literal["none", "headwise", "elementwise"] = field(
        default="none", metadata={"help": "sigmoid gate on the attention output before o_proj (Qwen3.5)"})
    attn_sinks: bool = field(
        default=False, metadata={"help": "a learned per-head sink logit in the softmax denominator (gpt-oss)"})
    partial_rotary_factor: float = field(
        default=1.0, metadata={"help": "share of each head's dimensions that RoPE rotates (0.25 in Qwen3.5)"})
    norm_zero_centered: bool = field(
        default=False, metadata={"help": "RMSNorm weights stored as w - 1: y = x / rms(x) * (1 + w) (Qwen3.5)"})
    linear_n_k_heads: int | None = _help("Gated DeltaNet query/key heads (default n_kv_heads)")
    linear_n_v_heads: int | None = _help("Gated DeltaNet value heads, a multiple of the key heads (default n_heads)")
    linear_k_head_dim: int | None = _help("Gated DeltaNet query/key head width Dk (default head_dim)")
    linear_v_head_dim: int | None = _help("Gated DeltaNet value head width Dv (default head_dim)")
    linear_conv_kernel: int = field(default=4, metadata={"help": "Gated DeltaNet causal conv1d kernel size"})
    # --- the small-model training recipe (modded-nanogpt, nanochat): each off by default ---
    logit_softcap: float | None = _help(
        "cap the logits smoothly at +-C: C * tanh(logits / C) (Gemma 2; no parameters)")
    value_embeddings: Literal["none", "alternate", "all"] = field(
        default="none", metadata={"help": "a token embedding table per attention layer added to its values, "
                                           "gated per head (alternate: every other layer, the last included)"})
    zero_init_output: bool = field(
        default=False, metadata={"help": "initialise the residual output projections (o_proj, down_proj) to zero"})
    norm_affine: bool = field(
        default=True, metadata={"help": "norms carry a learned gain; false: parameter-free RMSNorm (rmsnorm only)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on residual branches during training"})
    init_std: float = field(default=0.02, metadata={"help": "std of the normal weight initialisation"})
    # --- mixture of experts (moe.py; Mixtral, Qwen3-MoE, Qwen3.5-MoE, gpt-oss, DeepSeek-V3 routing) ---
    n_experts: int = field(default=0, metadata={"help": "routed experts E of an MoE layer (0: every MLP is dense)"})
    n_experts_per_token: int | None = _help("experts K each token is sent to (top-k); needed when n_experts > 0")
    moe_d_ff: int | None = _help("hidden width of one expert (default d_ff)")
    mlp_types: tuple[MlpType, ...] | None = _help(
        "MLP of each layer: dense (width d_ff) or moe (null: every layer moe when n_experts > 0, else dense)")
    router: RouterKind = field(
        default="softmax_topk", metadata={"help": "softmax_topk: softmax over the E logits, then the top K (Mixtral, "
                                          "Qwen); topk_softmax: the top K logits, then a softmax over them (gpt-oss); "
                                          "sigmoid_topk: sigmoid scores, a selection-only bias, group-limited "
                                          "(DeepSeek-V3)"})
    norm_topk_prob: bool = field(
        default=True, metadata={"help": "renormalise the K kept weights to sum to 1 (softmax_topk, sigmoid_topk)"})
    router_bias: bool = field(default=False, metadata={"help": "a bias in the router's linear layer (gpt-oss)"})
    n_expert_groups: int = field(default=1, metadata={"help": "sigmoid_topk: experts fall in this many groups"})
    topk_groups: int = field(default=1, metadata={"help": "sigmoid_topk: a token's experts come from its best groups"})
    routed_scaling_factor: float = field(default=1.0, metadata={"help": "the routed experts' sum is scaled by this"})
    expert_bias: bool = field(default=False, metadata={"help": "biases in the experts' projections (gpt-oss)"})
    expert_act: Literal["swiglu", "clamped_swiglu"] = field(
        default="swiglu", metadata={"help": "the experts' activation: silu(gate) * up, or gpt-oss's clamped form "
                                            "(up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit"})
    swiglu_alpha: float = field(default=1.702, metadata={"help": "clamped_swiglu: the sigmoid's gain alpha"})
    swiglu_limit: float = field(default=7.0, metadata={"help": "clamped_swiglu: the clamp limit"})
    shared_expert_d_ff: int = field(
        default=0, metadata={"help": "width of a shared expert every token goes through beside its routed ones "
                                     "(0: none)"})
    shared_expert_gate: bool = field(
        default=False, metadata={"help": "a sigmoid gate, one per token, on the shared expert's output (Qwen)"})
    capacity_factor: float | None = _help(
        "tokens an expert takes per call, as a multiple of N*K/E; later ones are dropped (null: dropless)")
    router_aux_loss_coef: float = field(
        default=0.0, metadata={"help": "training: weight of the load-balancing loss (Switch / Mixtral form)"})
    router_z_loss_coef: float = field(default=0.0, metadata={"help": "training: weight of the router z-loss"})
    # --- multi-head latent attention (mla.py; DeepSeek-V2/V3) ---
    kv_lora_rank: int | None = _help(
        "width R of the compressed key/value latent that the cache holds (null: standard attention; set: MLA)")
    q_lora_rank: int | None = _help("MLA: width Rq of the queries' low-rank path (null: one D -> H*Dh projection)")
    qk_rope_head_dim: int | None = _help("MLA: the RoPE part Dr of each query/key head (one rotated key for all heads)")
    qk_nope_head_dim: int | None = _help("MLA: the part Dn of each query/key head that carries no position")
    v_head_dim: int | None = _help("MLA: each value head's width Dv (default qk_nope_head_dim)")

    def __post_init__(self) -> None:
        def fix(name: str, value) -> None:
            object.__setattr__(self, name, value)

        check_field_types(self)  # JSON types: bools, ints, finite floats, Literal values, rope_scaling
        check_size_limits(self)  # before any size is used (layer_kinds is a tuple of n_layers entries)
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
        if self.kv_lora_rank is not None:                          # MLA: Dh = Dn + Dr (mla_config.py)
            derived = mla_head_dim(self)
            fix("head_dim", derived if self.head_dim is None else self.head_dim)
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                                 "unless head_dim is given")
            fix("head_dim", self.d_model // self.n_heads)
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive integer, got {self.head_dim!r}")
        if self.positions == "rope" and self.head_dim % 2 and self.kv_lora_rank is None:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for positions='rope'")
        if self.positions != "rope" and self.rope_interleaved:     # (a rope_scaling there is unused, as ever)
            raise ValueError(f"rope_interleaved=True needs positions='rope', got {self.positions!r}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model ({self.d_model}) must be even for positions='sinusoidal'")
        if self.d_ff is None:
            if self.mlp in ("gelu", "relu2"):
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
        self._check_layer_types(fix)
        self._check_attention()
        self._check_recipe()
        check_moe(self, fix)                                       # moe_config.py
        check_mla(self, fix)                                       # mla_config.py

    def _check_recipe(self) -> None:
        """The recipe's switches: a positive soft cap, parameter-free norms only as RMSNorm."""
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0 (or null: no cap), got {self.logit_softcap}")
        if not self.norm_affine and (self.norm != "rmsnorm" or self.norm_zero_centered):
            raise ValueError(f"norm_affine=False (parameter-free norms) needs norm='rmsnorm' without "
                             f"norm_zero_centered, got norm={self.norm!r} and {self.norm_zero_centered}")

    def has_value_embedding(self, layer: int) -> bool:
        """Whether attention layer `layer` adds a value embedding: value_embeddings "all", or
        "alternate" on every other layer counted back from the last (so the last has one)."""
        if self.value_embeddings == "none" or self.layer_kinds[layer] == "linear_attention":
            return False
        return self.value_embeddings == "all" or (self.n_layers - 1 - layer) % 2 == 0

    @property
    def value_embedding_layers(self) -> tuple[int, ...]:
        """The layers that add a value embedding (has_value_embedding)."""
        return tuple(i for i in range(self.n_layers) if self.has_value_embedding(i))

    def _check_attention(self) -> None:
        """attention="bidirectional" needs full attention layers whose mask is all a position's keys:
        a sliding window, Gated DeltaNet's recurrence and ALiBi's one-sided distance bias are causal."""
        if self.attention == "causal":
            return
        others = sorted(set(self.layer_kinds) - {"full_attention"})
        if others:
            raise ValueError(f"attention='bidirectional' needs every layer to be full_attention, but layer_types "
                             f"has {', '.join(others)} (their masks and recurrences are causal)")
        if self.positions == "alibi":
            raise ValueError("attention='bidirectional' does not support positions='alibi' (its bias is "
                             "one-sided, for causal attention); use learned, sinusoidal, rope or none")

    def _check_layer_types(self, fix) -> None:
        """layer_types, sliding_window, the rotary share and the Gated DeltaNet shapes."""
        if self.layer_types is not None and set(self.layer_types) == {"full_attention"}:
            fix("layer_types", None)                               # the default, stored as such
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but n_layers is {self.n_layers}")
        if "sliding_attention" in self.layer_kinds:
            if self.sliding_window is None or self.sliding_window <= 0:
                raise ValueError("layer_types has sliding_attention layers: sliding_window must be a positive "
                                 f"integer, got {self.sliding_window!r}")
        elif self.sliding_window is not None:
            raise ValueError(f"sliding_window={self.sliding_window} is set but no layer is sliding_attention "
                             "(set layer_types)")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.positions == "rope" and self.rotary_dim % 2 and not self.is_mla:   # MLA's: mla_config
            raise ValueError(f"RoPE rotates int(head_dim * partial_rotary_factor) = {self.rotary_dim} "
                             "dimensions per head, which must be even")
        r = self.rope_scaling
        if self.positions == "rope" and r is not None and r.rope_type == "longrope" \
                and len(r.short_factor) != self.rotary_dim // 2:
            raise ValueError(f"rope_scaling.short_factor/long_factor need rotary_dim / 2 = {self.rotary_dim // 2} "
                             f"entries, got {len(r.short_factor)}")
        if self.norm_zero_centered and self.norm != "rmsnorm":
            raise ValueError(f"norm_zero_centered needs norm='rmsnorm', got norm={self.norm!r}")
        defaults = dict(linear_n_k_heads=self.n_kv_heads, linear_n_v_heads=self.n_heads,
                        linear_k_head_dim=self.head_dim, linear_v_head_dim=self.head_dim)
        for name, default in defaults.items():
            if getattr(self, name) is None:
                fix(name, default)
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.linear_n_v_heads % self.linear_n_k_heads:
            raise ValueError(f"linear_n_v_heads ({self.linear_n_v_heads}) must be divisible by "
                             f"linear_n_k_heads ({self.linear_n_k_heads})")
        if self.linear_conv_kernel <= 0:
            raise ValueError(f"linear_conv_kernel must be a positive integer, got {self.linear_conv_kernel}")

    # --- mixture of experts ---------------------------------------------------------------------

    @property
    def mlp_kinds(self) -> tuple[str, ...]:
        """The MLP of every layer: mlp_types, or all "moe" (n_experts > 0) / all "dense" when None."""
        return self.mlp_types or (("moe" if self.n_experts else "dense"),) * self.n_layers

    @property
    def is_moe(self) -> bool:
        """True when some layer's MLP is a mixture of experts."""
        return "moe" in self.mlp_kinds

    # --------------------------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (kv_lora_rank set; mla.py)."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates: int(head_dim * partial_rotary_factor), or MLA's
        decoupled qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The token mixer of every layer: layer_types, or all "full_attention" when it is None
        (an all-full layer_types is stored as None, so n_layers can change alone)."""
        return self.layer_types or ("full_attention",) * self.n_layers

    @property
    def is_hybrid(self) -> bool:
        """True when some layer is not full attention."""
        return self.layer_types is not None

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
