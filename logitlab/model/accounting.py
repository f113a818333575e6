"""Parameter, FLOP and memory accounting for a ModelConfig.

accounting.py owns the arithmetic of model size and cost; it returns numbers (dataclasses), the
CLI formats them. Two routes to the parameter count, checked against each other in the tests:

- exact: the Transformer itself, built on the meta device (no memory, even for 70B), its
  parameters grouped by state-dict name; a tied LM head is the embedding Parameter, counted once;
- formula: the back-of-envelope count per layer, attention 2·D·H·Dh + 2·D·Hkv·Dh (q and o are
  D x H·Dh, k and v D x Hkv·Dh; latent attention's in accounting_mla.py), MLP 3·D·F (SwiGLU: gate, up,
  down) or 2·D·F (GELU: up, down), embeddings V·D once (tied) or twice. It leaves out norms, biases,
  learned positions and vocabulary padding rows; `explain_difference` itemises them, and the
  classic 12·D²·L rule (MHA, F = 4·D, no embeddings) is shown beside both.

FLOPs (multiply-add = 2 FLOPs) per token of a forward pass at context T:
    2·N_matmul + 2·L·T·H·Dh
where N_matmul counts every weight matrix that multiplies activations (blocks + LM head, not the
embedding lookup, norms or biases) and the second term is QK^T and attention·V (2 matmuls x 2 FLOPs
x H·Dh) over the T/2 keys a causal query sees on average. A training step costs 3x the forward
(the backward pass computes gradients for both activations and weights).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

from logitlab.model import accounting_mla as mla
from logitlab.model import accounting_moe as moe
from logitlab.model.config import ModelConfig
from logitlab.model.matmul_rate import matmul_peak_flops, measure_matmul_flops  # noqa: F401  (importable here)

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


# --------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamCount:
    """Exact parameter counts by component, summed over the layers; the per-layer numbers are
    properties (attention per attention layer, Gated DeltaNet per linear layer; in a hybrid stack
    norms_per_layer and per_layer are averages). Norms include QK-norm weights; biases sit with
    their layer. linear_items itemises one Gated DeltaNet layer."""

    embeddings: int            # token embedding table (padded_vocab_size x D)
    positions: int             # learned position table (context_length x D), else 0
    attention: int             # q, k, v, o projections (+ gate, sinks, biases), all attention layers
    mlp: int                   # gate/up/down (+ biases), all layers
    norms_in_blocks: int       # attn_norm, mlp_norm, q_norm, k_norm, all layers
    final_norm: int
    lm_head: int               # 0 when tied to the embedding
    n_layers: int
    tied: bool
    biases: int = 0            # all bias vectors outside the norms (already inside the groups above)
    linear_attention: int = 0  # Gated DeltaNet layers, all of them
    n_linear_layers: int = 0
    linear_items: dict = field(default_factory=dict)
    value_embeddings: int = 0  # value-embedding tables and gates, all layers (ModelConfig.value_embeddings)
    inactive: int = 0          # MoE: routed-expert parameters a token does not use (accounting_moe)

    @property
    def active(self) -> int:   # the parameters one token uses (the total for a dense model)
        return self.total - self.inactive

    @property
    def n_attention_layers(self) -> int:
        return self.n_layers - self.n_linear_layers

    @property
    def attention_per_layer(self) -> int:
        return self.attention // self.n_attention_layers if self.n_attention_layers else 0

    @property
    def linear_attention_per_layer(self) -> int:
        return self.linear_attention // self.n_linear_layers if self.n_linear_layers else 0

    @property
    def mlp_per_layer(self) -> int:
        return self.mlp // self.n_layers

    @property
    def norms_per_layer(self) -> int:
        return self.norms_in_blocks // self.n_layers

    @property
    def per_layer(self) -> int:
        return (self.attention + self.linear_attention + self.mlp + self.norms_in_blocks) // self.n_layers

    @property
    def norms(self) -> int:
        return self.norms_in_blocks + self.final_norm

    @property
    def total(self) -> int:
        return (self.embeddings + self.positions + self.attention + self.linear_attention + self.mlp
                + self.norms_in_blocks + self.final_norm + self.lm_head + self.value_embeddings)

    def as_dict(self) -> dict:
        return dict(embeddings=self.embeddings, positions=self.positions,
                    attention_per_layer=self.attention_per_layer, mlp_per_layer=self.mlp_per_layer,
                    norms_per_layer=self.norms_per_layer, per_layer=self.per_layer, attention=self.attention,
                    linear_attention=self.linear_attention, linear_attention_per_layer=self.linear_attention_per_layer,
                    n_linear_layers=self.n_linear_layers, linear_items=dict(self.linear_items),
                    mlp=self.mlp, norms=self.norms, final_norm=self.final_norm, lm_head=self.lm_head,
                    biases=self.biases, n_layers=self.n_layers, tied=self.tied, total=self.total,
                    value_embeddings=self.value_embeddings, active=self.active)


def meta_model(config: ModelConfig):
    """The Transformer for `config` on the meta device: real shapes, no storage."""
    import torch

    from logitlab.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(config)


_TOP = {"tok_emb": "embeddings", "pos_emb": "positions", "final_norm": "final_norm", "lm_head": "lm_head",
        "value_embeds": "value_embeddings"}


def _group(name: str) -> str:
    """The accounting group of one parameter name (see ParamCount)."""
    parts = name.split(".")
    if parts[0] in _TOP:
        return _TOP[parts[0]]
    if parts[0] == "blocks" and len(parts) > 3:
        sub = parts[2]
        if sub.endswith("_norm") or parts[3].endswith("_norm"):
            return "norms_in_blocks"
        if sub in ("attn", "mlp", "linear_attn"):
            return {"attn": "attention", "mlp": "mlp", "linear_attn": "linear_attention"}[sub]
    raise ValueError(f"parameter {name!r} belongs to no accounting group")


def count_parameters(model_or_config) -> ParamCount:
    """Exact counts from a built model (or a config, built on meta). Shared Parameters (a tied
    head) are counted once, under the name that owns them first (tok_emb)."""
    model = meta_model(model_or_config) if isinstance(model_or_config, ModelConfig) else model_or_config
    config = model.config
    groups = dict.fromkeys(("embeddings", "positions", "attention", "linear_attention", "mlp",
                            "norms_in_blocks", "final_norm", "lm_head", "value_embeddings"), 0)
    biases, items = 0, {}
    for name, p in model.named_parameters():  # remove_duplicate=True: a tied Parameter appears once
        n = p.numel()
        group = _group(name)
        groups[group] += n
        parts = name.split(".")
        if group == "linear_attention":
            items[parts[3]] = items.get(parts[3], 0) + n
        if parts[-1] in ("bias", "gate_up_bias", "down_bias") and not parts[-2].endswith("_norm"):
            biases += n
    n_linear = sum(kind == "linear_attention" for kind in config.layer_kinds)
    if n_linear:
        items = {k: v // n_linear for k, v in items.items()}
    return ParamCount(groups["embeddings"], groups["positions"], groups["attention"], groups["mlp"],
                      groups["norms_in_blocks"], groups["final_norm"], groups["lm_head"], config.n_layers,
                      config.tie_embeddings, biases, groups["linear_attention"], n_linear, items,
                      groups["value_embeddings"], moe.inactive_parameters(model))


@dataclass(frozen=True)
class FormulaCount:
    """The back-of-envelope count (see the module docstring)."""

    attention_per_layer: int   # 2·D·H·Dh + 2·D·Hkv·Dh (+ the output gate's D·H·Dh or D·H)
    mlp_per_layer: int         # 3·D·F (SwiGLU) or 2·D·F (GELU)
    embeddings: int            # V·D once (tied) or twice, + V·Hkv·Dh per value embedding
    n_layers: int
    classic: int               # 12·D²·L
    linear_per_layer: int = 0  # Gated DeltaNet: D·(2·Hk·Dk + Hv·Dv) + 2·D·Hv·Dv + 2·D·Hv + C·K
    n_linear_layers: int = 0
    moe_per_layer: int = 0     # an MoE layer's MLP: E·3·D·F + E·D (+ shared expert), accounting_moe
    n_moe_layers: int = 0

    @property
    def per_layer(self) -> int:
        """Attention + MLP of one attention layer (the uniform stack's layer)."""
        return self.attention_per_layer + (self.moe_per_layer if self.n_moe_layers else self.mlp_per_layer)

    @property
    def layers(self) -> int:
        n_attention = self.n_layers - self.n_linear_layers
        return (self.attention_per_layer * n_attention + self.linear_per_layer * self.n_linear_layers
                + self.mlp_per_layer * (self.n_layers - self.n_moe_layers) + self.moe_per_layer * self.n_moe_layers)

    @property
    def total(self) -> int:
        return self.layers + self.embeddings

    def as_dict(self) -> dict:
        return dict(attention_per_layer=self.attention_per_layer, mlp_per_layer=self.mlp_per_layer,
                    linear_per_layer=self.linear_per_layer, n_linear_layers=self.n_linear_layers,
                    per_layer=self.per_layer, layers=self.layers, embeddings=self.embeddings,
                    total=self.total, classic_12_D2_L=self.classic)


def formula_count(config: ModelConfig) -> FormulaCount:
    c = config
    D, F, L, V = c.d_model, c.d_ff, c.n_layers, c.vocab_size
    attention = mla.attention_formula(c)                        # q, k, v, o (+ gate), or latent attention's
    mlp = (3 if c.mlp == "swiglu" else 2) * D * F
    embeddings = V * D * (1 if c.tie_embeddings else 2) + len(c.value_embedding_layers) * V * c.n_kv_heads * c.head_dim
    Hk, Hv, Dk, Dv = c.linear_n_k_heads, c.linear_n_v_heads, c.linear_k_head_dim, c.linear_v_head_dim
    channels = 2 * Hk * Dk + Hv * Dv
    linear = D * channels + 2 * D * Hv * Dv + 2 * D * Hv + channels * c.linear_conv_kernel
    n_linear = c.layer_kinds.count("linear_attention")
    return FormulaCount(attention, mlp, embeddings, L, 12 * D * D * L, linear if n_linear else 0, n_linear,
                        moe.moe_layer_formula(c) if c.is_moe else 0, moe.n_moe_layers(c))


def explain_difference(config: ModelConfig, exact: ParamCount | None = None) -> dict[str, int]:
    """What the exact count holds beyond the formula; the items add up to exact - formula."""
    exact = exact or count_parameters(config)
    c = config
    n_linear, n_ve = exact.n_linear_layers, len(c.value_embedding_layers)
    linear_vectors = n_linear * sum(exact.linear_items.get(k, 0) for k in ("A_log", "dt_bias", "norm"))
    sinks = (c.n_layers - n_linear) * c.n_heads if c.attn_sinks else 0
    widths = c.d_model * (1 if c.tie_embeddings else 2) + n_ve * c.n_kv_heads * c.head_dim  # tables of V rows
    items = {"norms": exact.norms, "biases": exact.biases, "learned positions": exact.positions,
             "vocabulary padding rows": (c.padded_vocab_size - c.vocab_size) * widths,
             "Gated DeltaNet decay and output-norm vectors": linear_vectors, "attention sink logits": sinks,
             "value-embedding gates": n_ve * c.n_kv_heads}
    return {k: v for k, v in items.items() if v}


def explain_classic(config: ModelConfig) -> str:
    """Why 12·D²·L differs from the formula's layer count for this shape."""
    c = config
    notes = ["12·D²·L = 4·D² attention (MHA, H·Dh = D) + 8·D² MLP (GELU, F = 4·D), no embeddings"]
    if c.n_kv_heads != c.n_heads:
        notes.append(f"GQA: k and v have {c.n_kv_heads} of {c.n_heads} heads")
    if c.n_heads * c.head_dim != c.d_model:
        notes.append(f"H·Dh = {c.n_heads * c.head_dim} differs from D = {c.d_model}")
    if (3 if c.mlp == "swiglu" else 2) * c.d_ff != 8 * c.d_model:
        notes.append(f"MLP is {'3' if c.mlp == 'swiglu' else '2'}·D·F with F = {c.d_ff}, not 8·D²")
    return "; ".join(notes)


# --------------------------------------------------------------------------------------------
# FLOPs, memory, KV cache
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _block_matrix_params(config: ModelConfig) -> int:
    """Weights of the blocks that multiply activations: every matrix (and the depthwise conv of
    Gated DeltaNet), not the norms, biases, decay vectors or sink logits."""
    model = meta_model(config)
    return sum(p.numel() for name, p in model.named_parameters()
               if name.startswith("blocks.") and p.dim() >= 2 and not name.endswith("_bias"))   # stacked expert biases


def matmul_params(config: ModelConfig) -> int:
    """N_matmul: weights that multiply activations per token (blocks + LM head). The LM head's
    vocabulary padding rows are never multiplied (Transformer._head uses its first V rows).
    For a uniform stack the block part is the formula's layer count exactly (an MoE's: K experts)."""
    if not config.is_hybrid and config.attn_gate == "none" and not config.is_moe:
        return formula_count(config).layers + config.vocab_size * config.d_model
    return _block_matrix_params(config) - moe.inactive_matrix_params(config) + config.vocab_size * config.d_model


def _keys_seen(kind: str, T: int, window: int | None, attention: str = "causal") -> float:
    """Keys a query reads on average over a context of T: T/2 with full causal attention, T
    with bidirectional (an encoder), sum over t of min(t, W) / T with a sliding window of W."""
    if kind == "sliding_attention" and window is not None and window < T:
        return (window * (window + 1) / 2 + (T - window) * window) / T
    return T if attention == "bidirectional" else T / 2


def flops_per_token(config: ModelConfig, context: int | None = None) -> dict[str, float]:
    """Forward and training FLOPs per token at context T (default: context_length).

    attention: QK^T and attention·V, 4·H·Dh FLOPs per key a query reads, per attention layer;
    linear_state: a Gated DeltaNet layer's recall, write and read of its state, three Dk x Dv
    products per value head, 6·Hv·Dk·Dv FLOPs whatever T is."""
    c = config
    T = context or c.context_length
    dense = 2 * matmul_params(c)
    kinds = c.layer_kinds
    attention = sum(mla.flops_per_key(c) * _keys_seen(kind, T, c.sliding_window, c.attention)   # 4·H·Dh per key
                    for kind in kinds if kind != "linear_attention")
    linear = 6 * c.linear_n_v_heads * c.linear_k_head_dim * c.linear_v_head_dim * kinds.count("linear_attention")
    forward = dense + attention + linear
    out = {"context": T, "dense": dense, "attention": attention, "forward": forward, "training": 3 * forward}
    if linear:
        out["linear_state"] = linear
    return out


def weight_bytes(n_params: int) -> dict[str, int]:
    return {name: n_params * DTYPE_BYTES[name] for name in ("fp32", "bf16", "int8")}


def kv_cache_bytes(config: ModelConfig, dtype: str = "bf16", tokens: int | None = None) -> dict[str, int]:
    """What decoding keeps per sequence. Full attention: K and V, 2·Hkv·Dh values per token per layer
    (GQA shrinks it by H / Hkv; latent attention keeps R + Dr, accounting_mla); a sliding window keeps
    at most W tokens; a Gated DeltaNet layer keeps a fixed state (Hv·Dk·Dv float32 plus its last K-1
    conv inputs) at any length.
    full_attention_equivalent is what the same shape with every layer full attention would hold."""
    c = config
    b = dtype_bytes(dtype)
    T = tokens or c.context_length
    per_layer_token = mla.cache_values_per_token(c) * b
    kinds = c.layer_kinds
    n_full = kinds.count("full_attention")
    window = min(T, c.sliding_window) if c.sliding_window else T
    channels = 2 * c.linear_n_k_heads * c.linear_k_head_dim + c.linear_n_v_heads * c.linear_v_head_dim
    state = (c.linear_n_v_heads * c.linear_k_head_dim * c.linear_v_head_dim * 4
             + channels * (c.linear_conv_kernel - 1) * b)
    fixed = kinds.count("linear_attention") * state + kinds.count("sliding_attention") * window * per_layer_token
    total = n_full * per_layer_token * T + fixed
    return {"per_token": n_full * per_layer_token, "tokens": T, "fixed": fixed, "total": total,
            "full_attention_equivalent": c.n_layers * per_layer_token * T}


def activation_elements_per_token(config: ModelConfig) -> int:
    """Values a training step keeps per token for the backward pass (fused attention, which
    stores no T x T probabilities; no recomputation). Per attention layer: both norms' inputs and
    outputs (4·D), q (H·Dh), k and v (2·Hkv·Dh), the attention output (H·Dh), QK-norm inputs when
    present, the output gate before and after its sigmoid when present (latent attention's:
    accounting_mla); per Gated DeltaNet layer:
    the norms (4·D), the conv's input and output (2·C), z, the rule's output and its normed value
    (3·Hv·Dv), beta and g (2·Hv). Every layer adds the MLP's hidden values (SwiGLU: gate, up,
    silu(gate), product = 4·F; GELU: 2·F; an MoE layer: accounting_moe.moe_activation_elements);
    then the final norm's input and output (2·D). Logits are counted separately (fp32)."""
    c = config
    attention = mla.activation_elements(c)                      # per attention layer (MLA's too)
    channels = 2 * c.linear_n_k_heads * c.linear_k_head_dim + c.linear_n_v_heads * c.linear_v_head_dim
    linear = 4 * c.d_model + 2 * channels + 3 * c.linear_n_v_heads * c.linear_v_head_dim + 2 * c.linear_n_v_heads
    mlp, n_moe = (4 if c.mlp == "swiglu" else 2) * c.d_ff, moe.n_moe_layers(c)   # an MoE layer: accounting_moe
    mlps = (c.n_layers - n_moe) * mlp + (n_moe * moe.moe_activation_elements(c) if n_moe else 0)
    n_linear = c.layer_kinds.count("linear_attention")
    return (c.n_layers - n_linear) * attention + n_linear * linear + mlps + 2 * c.d_model


@dataclass(frozen=True)
class TrainingPlan:
    """Training memory for one step with AdamW: fp32 weights and gradients, two fp32 moments,
    activations in the compute dtype, fp32 logits and their gradient."""

    batch_size: int
    context: int
    dtype: str
    n_params: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    memory_limit: int | None
    flops_per_step: float
    matmul_flops_per_s: float | None
    extra: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    @property
    def fits(self) -> bool | None:
        return None if self.memory_limit is None else self.total <= self.memory_limit

    @property
    def seconds_per_step(self) -> float | None:
        """At 100% of the matmul rate; real steps reach a fraction of it (that fraction is MFU)."""
        if not self.matmul_flops_per_s:
            return None
        return self.flops_per_step / self.matmul_flops_per_s

    def as_dict(self) -> dict:
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**known, "total": self.total, "fits": self.fits, "seconds_per_step": self.seconds_per_step}


def plan_training(config: ModelConfig, batch_size: int = 1, context: int | None = None,
                  dtype: str = "bf16", memory_gb: float | None = None,
                  matmul_flops_per_s: float | None = None, n_params: int | None = None) -> TrainingPlan:
    """Memory and time of one training step of B x T tokens (see TrainingPlan)."""
    T = context or config.context_length
    if batch_size <= 0 or T <= 0:
        raise ValueError(f"batch_size ({batch_size}) and context ({T}) must be positive")
    if T > config.context_length:
        raise ValueError(f"context ({T}) exceeds the model's context_length ({config.context_length})")
    N = n_params if n_params is not None else count_parameters(config).total
    tokens = batch_size * T
    activations = tokens * activation_elements_per_token(config) * dtype_bytes(dtype)
    logits = 2 * tokens * config.vocab_size * 4  # (B, T, V): the model never forms padded columns
    limit = None if memory_gb is None else int(memory_gb * 2**30)
    return TrainingPlan(batch_size, T, dtype, N, 4 * N, 4 * N, 8 * N, activations, logits, limit,
                        flops_per_token(config, T)["training"] * tokens, matmul_flops_per_s)
