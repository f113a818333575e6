"""Parameter, FLOP and memory accounting for a ModelConfig.

accounting.py owns the arithmetic of model size and cost; it returns numbers (dataclasses), the
CLI formats them. Two routes to the parameter count, checked against each other in the tests:

- exact: the Transformer itself, built on the meta device (no memory, even for 70B), its
  parameters grouped by state-dict name; a tied LM head is the embedding Parameter, counted once;
- formula: the back-of-envelope count per layer, attention 2·D·H·Dh + 2·D·Hkv·Dh (= 2·D² +
  2·D·Hkv·Dh when H·Dh = D: q and o are D x H·Dh, k and v D x Hkv·Dh), MLP 3·D·F (SwiGLU: gate, up,
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
from dataclasses import dataclass, field

from logitlab.model.config import ModelConfig

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
    """Exact parameter counts by component. Per-layer numbers are for one block (all blocks share
    one shape); totals multiply by L. Norms include QK-norm weights; biases sit with their layer."""

    embeddings: int            # token embedding table (padded_vocab_size x D)
    positions: int             # learned position table (context_length x D), else 0
    attention_per_layer: int   # q, k, v, o projections (+ biases)
    mlp_per_layer: int         # gate/up/down (+ biases)
    norms_per_layer: int       # attn_norm, mlp_norm, q_norm, k_norm
    final_norm: int
    lm_head: int               # 0 when tied to the embedding
    n_layers: int
    tied: bool
    biases: int = 0            # all bias vectors outside the norms (already inside the groups above)

    @property
    def per_layer(self) -> int:
        return self.attention_per_layer + self.mlp_per_layer + self.norms_per_layer

    @property
    def attention(self) -> int:
        return self.attention_per_layer * self.n_layers

    @property
    def mlp(self) -> int:
        return self.mlp_per_layer * self.n_layers

    @property
    def norms(self) -> int:
        return self.norms_per_layer * self.n_layers + self.final_norm

    @property
    def total(self) -> int:
        return (self.embeddings + self.positions + self.per_layer * self.n_layers + self.final_norm
                + self.lm_head)

    def as_dict(self) -> dict:
        return dict(embeddings=self.embeddings, positions=self.positions,
                    attention_per_layer=self.attention_per_layer, mlp_per_layer=self.mlp_per_layer,
                    norms_per_layer=self.norms_per_layer, per_layer=self.per_layer, attention=self.attention,
                    mlp=self.mlp, norms=self.norms, final_norm=self.final_norm, lm_head=self.lm_head,
                    biases=self.biases, n_layers=self.n_layers, tied=self.tied, total=self.total)


def meta_model(config: ModelConfig):
    """The Transformer for `config` on the meta device: real shapes, no storage."""
    import torch

    from logitlab.model.transformer import Transformer

    with torch.device("meta"):
        return Transformer(config)


def count_parameters(model_or_config) -> ParamCount:
    """Exact counts from a built model (or a config, built on meta). Shared Parameters (a tied
    head) are counted once, under the name that owns them first (tok_emb)."""
    model = meta_model(model_or_config) if isinstance(model_or_config, ModelConfig) else model_or_config
    config = model.config
    groups = dict(embeddings=0, positions=0, attention=0, mlp=0, norms=0, final_norm=0, lm_head=0)
    biases = 0
    for name, p in model.named_parameters():  # remove_duplicate=True: a tied Parameter appears once
        n = p.numel()
        parts = name.split(".")
        if parts[0] == "tok_emb":
            groups["embeddings"] += n
        elif parts[0] == "pos_emb":
            groups["positions"] += n
        elif parts[0] == "final_norm":
            groups["final_norm"] += n
        elif parts[0] == "lm_head":
            groups["lm_head"] += n
        elif parts[0] == "blocks":
            sub = parts[2]
            if sub.endswith("_norm") or (len(parts) > 3 and parts[3].endswith("_norm")):
                groups["norms"] += n
            elif sub == "attn":
                groups["attention"] += n
            elif sub == "mlp":
                groups["mlp"] += n
            else:
                raise ValueError(f"parameter {name!r} belongs to no accounting group")
            if parts[-1] == "bias" and not parts[-2].endswith("_norm"):
                biases += n
        else:
            raise ValueError(f"parameter {name!r} belongs to no accounting group")
    L = config.n_layers
    for key in ("attention", "mlp", "norms"):
        if groups[key] % L:
            raise ValueError(f"{key} parameters ({groups[key]}) are not equal across {L} layers")
    return ParamCount(embeddings=groups["embeddings"], positions=groups["positions"],
                      attention_per_layer=groups["attention"] // L, mlp_per_layer=groups["mlp"] // L,
                      norms_per_layer=groups["norms"] // L, final_norm=groups["final_norm"],
                      lm_head=groups["lm_head"], n_layers=L, tied=config.tie_embeddings, biases=biases)


@dataclass(frozen=True)
class FormulaCount:
    """The back-of-envelope count (see the module docstring)."""

    attention_per_layer: int   # 2·D·H·Dh + 2·D·Hkv·Dh
    mlp_per_layer: int         # 3·D·F (SwiGLU) or 2·D·F (GELU)
    embeddings: int            # V·D once (tied) or twice
    n_layers: int
    classic: int               # 12·D²·L

    @property
    def per_layer(self) -> int:
        return self.attention_per_layer + self.mlp_per_layer

    @property
    def layers(self) -> int:
        return self.per_layer * self.n_layers

    @property
    def total(self) -> int:
        return self.layers + self.embeddings

    def as_dict(self) -> dict:
        return dict(attention_per_layer=self.attention_per_layer, mlp_per_layer=self.mlp_per_layer,
                    per_layer=self.per_layer, layers=self.layers, embeddings=self.embeddings,
                    total=self.total, classic_12_D2_L=self.classic)


def formula_count(config: ModelConfig) -> FormulaCount:
    c = config
    D, H, Hkv, Dh, F, L, V = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.n_layers, c.vocab_size
    attention = 2 * D * H * Dh + 2 * D * Hkv * Dh
    mlp = (3 if c.mlp == "swiglu" else 2) * D * F
    embeddings = V * D * (1 if c.tie_embeddings else 2)
    return FormulaCount(attention, mlp, embeddings, L, 12 * D * D * L)


def explain_difference(config: ModelConfig, exact: ParamCount | None = None) -> dict[str, int]:
    """What the exact count holds beyond the formula; the items add up to exact - formula."""
    exact = exact or count_parameters(config)
    c = config
    padding_rows = (c.padded_vocab_size - c.vocab_size) * c.d_model
    items = {"norms": exact.norms, "biases": exact.biases, "learned positions": exact.positions,
             "vocabulary padding rows": padding_rows * (1 if c.tie_embeddings else 2)}
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

def matmul_params(config: ModelConfig) -> int:
    """N_matmul: weights that multiply activations per token (blocks + LM head). The LM head's
    vocabulary padding rows are never multiplied (Transformer._head uses its first V rows)."""
    f = formula_count(config)
    return f.layers + config.vocab_size * config.d_model


def flops_per_token(config: ModelConfig, context: int | None = None) -> dict[str, float]:
    """Forward and training FLOPs per token at context T (default: context_length)."""
    c = config
    T = context or c.context_length
    dense = 2 * matmul_params(c)
    attention = 2 * c.n_layers * T * c.n_heads * c.head_dim
    forward = dense + attention
    return {"context": T, "dense": dense, "attention": attention, "forward": forward,
            "training": 3 * forward}


def weight_bytes(n_params: int) -> dict[str, int]:
    return {name: n_params * DTYPE_BYTES[name] for name in ("fp32", "bf16", "int8")}


def kv_cache_bytes(config: ModelConfig, dtype: str = "bf16", tokens: int | None = None) -> dict[str, int]:
    """K and V for every layer: 2·L·Hkv·Dh values per token (GQA shrinks it by H / Hkv)."""
    c = config
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * dtype_bytes(dtype)
    T = tokens or c.context_length
    return {"per_token": per_token, "tokens": T, "total": per_token * T}


def activation_elements_per_token(config: ModelConfig) -> int:
    """Values a training step keeps per token for the backward pass (fused attention, which
    stores no T x T probabilities; no recomputation). Per layer: both norms' inputs and outputs
    (4·D), q (H·Dh), k and v (2·Hkv·Dh), the attention output (H·Dh), QK-norm inputs when present,
    and the MLP's hidden values (SwiGLU: gate, up, silu(gate), product = 4·F; GELU: 2·F);
    then the final norm's input and output (2·D). Logits are counted separately (fp32)."""
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = 4 * c.d_model + 2 * q + 2 * kv + (q + kv if c.qk_norm else 0)
    per_layer += (4 if c.mlp == "swiglu" else 2) * c.d_ff
    return c.n_layers * per_layer + 2 * c.d_model


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
        return dict(batch_size=self.batch_size, context=self.context, dtype=self.dtype,
                    n_params=self.n_params, weights=self.weights, gradients=self.gradients,
                    optimizer=self.optimizer, activations=self.activations, logits=self.logits,
                    total=self.total, memory_limit=self.memory_limit, fits=self.fits,
                    flops_per_step=self.flops_per_step, matmul_flops_per_s=self.matmul_flops_per_s,
                    seconds_per_step=self.seconds_per_step)


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


def measure_matmul_flops(dtype="fp32", n: int = 1024, seconds: float = 0.5, device="cpu") -> float:
    """FLOP/s of an n x n x n matmul (2·n³ FLOPs each) on `device` in `dtype` (a name of
    DTYPE_BYTES or a torch.dtype): the fastest of repeated timings for about `seconds` (at least
    one) after two warm-up calls. Uncached; see matmul_peak_flops."""
    import time

    import torch

    if not isinstance(dtype, torch.dtype):
        dtype_bytes(dtype)  # validates the name
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16}.get(dtype, torch.float32)
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)  # private: the global generators are not touched
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    for _ in range(2):  # warm-up
        a @ b
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@functools.lru_cache(maxsize=None)
def _measured_peak(device: str, dtype: str, size: int) -> float:
    import torch

    return measure_matmul_flops(getattr(torch, dtype), size, 0.1, device)


def matmul_peak_flops(device, dtype=None, size: int | None = None) -> float:
    """Measured dense matmul throughput in FLOP/s (the best of a few square matmuls), cached per
    (device, dtype, size) for the process: MFU = achieved model FLOP/s / this."""
    import torch

    device = torch.device(device)
    dtype = dtype or torch.float32
    size = size or (4096 if device.type == "cuda" else 1024)
    return _measured_peak(str(device), str(dtype).removeprefix("torch."), size)
