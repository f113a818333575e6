"""Total against active parameters of a mixture of experts (accounting.py counts the model; this
module says what of it a token uses).

A token goes through K of the E routed experts of each MoE layer, so (E - K) / E of the experts'
parameters are idle for it: active = total - inactive. Everything else is active: attention, the
router (every token scores every expert), the shared expert, embeddings and head. FLOPs per token
follow the active matrices (accounting.matmul_params); memory follows the total, since every
expert must be resident.

Per MoE layer, the back-of-envelope formula (SwiGLU experts of width F, a shared expert of width Fs):
    total:  E·3·D·F (experts) + E·D (router) + 3·D·Fs (shared expert) + D (its gate)
    active: K·3·D·F           + E·D          + 3·D·Fs                 + D
"""

from __future__ import annotations

from logitlab.model.config import ModelConfig


def moe_layer_formula(config: ModelConfig, active: bool = False) -> int:
    """The formula's parameters of one MoE layer (its experts, router and shared expert); with
    active=True only the K experts a token uses."""
    c = config
    D, E = c.d_model, c.n_experts
    experts = (c.n_experts_per_token if active else E) * 3 * D * c.moe_d_ff
    shared = 3 * D * c.shared_expert_d_ff + (D if c.shared_expert_gate else 0)
    return experts + E * D + shared


def n_moe_layers(config: ModelConfig) -> int:
    return config.mlp_kinds.count("moe")


def inactive_parameters(model) -> int:
    """Parameters of `model`'s routed experts that a token does not use: (E - K) / E of each MoE
    layer's experts (their biases included)."""
    from logitlab.model.moe import Experts

    c = model.config
    if not c.is_moe:
        return 0
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    return experts * (c.n_experts - c.n_experts_per_token) // c.n_experts


def inactive_matrix_params(config: ModelConfig) -> int:
    """Expert weight matrices a token does not multiply: (E - K)·3·D·F per MoE layer."""
    c = config
    if not c.is_moe:
        return 0
    return n_moe_layers(c) * (c.n_experts - c.n_experts_per_token) * 3 * c.d_model * c.moe_d_ff


def moe_activation_elements(config: ModelConfig) -> int:
    """Values an MoE layer keeps per token for the backward pass: the router's logits and
    probabilities (2·E), and for each of the K experts its gathered input (D), hidden values
    (4·F, as a dense SwiGLU's) and weighted output (D); the shared expert's 4·Fs (+ its gate)."""
    c = config
    shared = 4 * c.shared_expert_d_ff + (2 if c.shared_expert_gate else 0)
    return 2 * c.n_experts + c.n_experts_per_token * (4 * c.moe_d_ff + 2 * c.d_model) + shared


def moe_summary(config: ModelConfig, exact, matmul_params: int) -> dict | None:
    """What `logitlab params` shows about the experts: counts, the per-expert size, the total and
    active parameters and the active share. exact: accounting.ParamCount; matmul_params: the weights
    a token multiplies (accounting.matmul_params: the active ones less the embedding table, which is
    looked up, not multiplied; gpt-oss publishes this count as its active parameters). None for a
    dense model."""
    c = config
    if not c.is_moe:
        return None
    per_expert = 3 * c.d_model * c.moe_d_ff + (2 * c.moe_d_ff + c.d_model if c.expert_bias else 0)
    return {"n_experts": c.n_experts, "experts_per_token": c.n_experts_per_token, "n_moe_layers": n_moe_layers(c),
            "expert_d_ff": c.moe_d_ff, "shared_expert_d_ff": c.shared_expert_d_ff, "per_expert": per_expert,
            "routed_experts": per_expert * c.n_experts * n_moe_layers(c), "total": exact.total,
            "active": exact.active, "inactive": exact.inactive, "active_share": exact.active / exact.total,
            "active_matmul": matmul_params,
            "layer_formula": moe_layer_formula(c), "layer_formula_active": moe_layer_formula(c, active=True)}
