"""The mixture-of-experts MLP: a router picks K of E expert MLPs for each token, the token's output
is the weighted sum of theirs (plus a shared expert's, where the model has one).

moe.py owns the block's parts: `route` (the three scoring rules, as pure functions of the router
logits), `Router`, `Experts` (E SwiGLU MLPs stored stacked, [E, ...] parameters, as torchtitan
does), and `MoE`, which joins them with an optional shared expert. How the routed tokens meet
their experts is model/moe_forms.py: four forms that compute the same values (tests/test_moe.py
checks them against each other):

- "loop": for each expert, the tokens routed to it, through it, added back: the reference, read by eye;
- "sorted": the (token, expert) assignments sorted by expert once, the tokens gathered in that
  order, then expert by expert over its contiguous rows (one product per expert, no masks);
- "grouped": the same sort, then all experts at once (Experts.products: torch's grouped matrix
  product where it runs, one call for all experts), the outputs scattered back in one call;
- "gather": each token multiplies the weights of its own K experts, gathered (a handful of tokens
  when decoding: no sort, no host sync, the same shapes every step, so it compiles).

`MoE.impl` ("auto" by default) takes "sorted" or "grouped", whichever measured faster on this
machine for the call's shape (moe_forms.choose_form, once per process and shape), and "gather"
for a handful of tokens (N * K <= E) under torch.compile. Dropless by default; with
`capacity_factor` each expert takes at most C = ceil(capacity_factor * N * K / E) assignments per
call, in token order, and drops the rest (the token keeps its residual), the same in all forms.
Which layers are MoE is config.mlp_kinds (layers.py builds the block); the losses that train the
router, and the update of sigmoid_topk's correction bias, live in train/moe.py.

Shapes: N tokens (B * T), D d_model, E experts, K experts per token, F one expert's width
(config.moe_d_ff), Fs the shared expert's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.hooks import tap
from logitlab.model.mlp import SwiGLU
from logitlab.model.moe_forms import (  # noqa: F401 (the forms' names, imported from here too)
    FORMS,
    choose_form,
    experts_gather,
    experts_grouped,
    experts_loop,
    experts_sorted,
    group_products,
    sort_by_expert,
)

MOE_IMPLS = ("auto", "loop", "sorted", "grouped", "gather")


# ------------------------------------------------------------------------------------------
# Routing: logits (N, E) -> (weights (N, K), experts (N, K))
# ------------------------------------------------------------------------------------------

def route(logits: torch.Tensor, config, correction_bias: torch.Tensor | None = None):
    """The router's choice for each token: logits (N, E) -> (weights (N, K) float32, experts (N, K)).

    softmax_topk (Mixtral, Qwen-MoE): p = softmax(logits); the K largest p, renormalised to sum 1
        when norm_topk_prob (Mixtral always; Qwen3-MoE's norm_topk_prob);
    topk_softmax (gpt-oss): the K largest logits, then a softmax over those K;
    sigmoid_topk (DeepSeek-V3): s = sigmoid(logits); the choice reads s + correction_bias (the
        auxiliary-loss-free balancing bias, for selection only), limited to the topk_groups groups
        whose two best experts score highest; the weights are s itself, renormalised when
        norm_topk_prob.
    Every kind ends multiplied by routed_scaling_factor (1.0 but for DeepSeek-V3's 2.5)."""
    K = config.n_experts_per_token
    logits = logits.float()
    if config.router == "topk_softmax":
        top, experts = torch.topk(logits, K, dim=-1)                       # (N, K)
        weights = torch.softmax(top, dim=-1)
    elif config.router == "softmax_topk":
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        if config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = torch.sigmoid(logits)                                     # (N, E)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        experts = torch.topk(_limit_groups(choice, config), K, dim=-1).indices
        weights = scores.gather(-1, experts)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, experts


def _limit_groups(choice: torch.Tensor, config) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): the E experts form G groups; a group scores the sum of
    its two best experts' choice scores; experts outside the topk_groups best groups get -inf."""
    G, best = config.n_expert_groups, config.topk_groups
    if G == 1:
        return choice
    N, E = choice.shape
    by_group = choice.view(N, G, E // G)                                   # (N, G, E/G)
    group_score = by_group.topk(2, dim=-1).values.sum(dim=-1)              # (N, G)
    kept = torch.zeros_like(group_score, dtype=torch.bool)
    kept.scatter_(1, group_score.topk(best, dim=-1).indices, True)         # (N, G)
    return by_group.masked_fill(~kept[..., None], float("-inf")).view(N, E)


def capacity_keep(experts: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor | None:
    """Which assignments an expert of `capacity` slots takes: experts (N, K) -> keep (N, K) bool,
    the first `capacity` assignments of each expert in token order (row-major over (N, K)).
    None (dropless) when capacity is None."""
    if capacity is None:
        return None
    onehot = F.one_hot(experts.reshape(-1), n_experts)                     # (N*K, E)
    rank = (onehot.cumsum(0) * onehot).sum(-1) - 1                         # place within its expert
    return (rank < capacity).view(experts.shape)


def expert_capacity(config, n_tokens: int) -> int | None:
    """C = ceil(capacity_factor * N * K / E) slots per expert, or None (dropless)."""
    if config.capacity_factor is None:
        return None
    return math.ceil(config.capacity_factor * n_tokens * config.n_experts_per_token / config.n_experts)


class Router(nn.Module):
    """The router: one linear map D -> E (weight (E, D), a bias only when router_bias), giving each
    token a logit per expert. For sigmoid_topk routing it also holds `correction_bias` (E,), a
    persistent buffer that the auxiliary-loss-free balancing updates outside the optimizer
    (train.moe.update_correction_bias) and that only the selection reads."""

    def __init__(self, config):
        super().__init__()
        E, D = config.n_experts, config.d_model
        self.weight = nn.Parameter(torch.empty(E, D))
        self.bias = nn.Parameter(torch.empty(E)) if config.router_bias else None
        if config.router == "sigmoid_topk":
            self.register_buffer("correction_bias", torch.zeros(E, dtype=torch.float32))
        else:
            self.correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, D) -> logits (N, E), float32."""
        return F.linear(x, self.weight, self.bias).float()

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.correction_bias is not None:
            self.correction_bias.zero_()


# ------------------------------------------------------------------------------------------
# Experts, stacked
# ------------------------------------------------------------------------------------------

class Experts(nn.Module):
    """E SwiGLU MLPs as stacked parameters (the layout of nn.Linear weights, one per expert):

        gate_up_proj (E, 2F, D)   rows: gate (F), then up (F), as the dense SwiGLU's gate_up_proj
        down_proj    (E, D, F)
        gate_up_bias (E, 2F), down_bias (E, D)   expert_bias only

    expert e maps x (n, D) to down_e(act(gate_e x, up_e x)); act is silu(gate) * up, or gpt-oss's
    clamped form (expert_act="clamped_swiglu"): gate <= limit, -limit <= up <= limit,
    (up + 1) * gate * sigmoid(alpha * gate)."""

    def __init__(self, config):
        super().__init__()
        E, D, Fe = config.n_experts, config.d_model, config.moe_d_ff
        self.n_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fe, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, Fe))
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * Fe)) if config.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(E, D)) if config.expert_bias else None
        self.clamped = config.expert_act == "clamped_swiglu"
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    @torch.no_grad()
    def reset_parameters(self, std: float, down_std: float) -> None:
        """Weights ~ Normal(0, std), the down (residual output) projection ~ Normal(0, down_std)."""
        nn.init.normal_(self.gate_up_proj, 0.0, std)
        nn.init.normal_(self.down_proj, 0.0, down_std)
        for bias in (self.gate_up_bias, self.down_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., 2F), the gate then the up rows -> (..., F)."""
        gate, up = h.chunk(2, dim=-1)
        if not self.clamped:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def stacked(self) -> tuple:
        """(gate_up (E, 2F, D), gate_up_bias, down (E, D, F), down_bias): the tensors every form
        multiplies by. A LoRA on the experts (train/lora.py) overrides it to add its update."""
        return self.gate_up_proj, self.gate_up_bias, self.down_proj, self.down_bias

    def per_expert(self, stacked: tuple | None = None) -> list[tuple]:
        """(gate_up, gate_up_bias, down, down_bias) of each expert of `stacked` (default:
        self.stacked()), views made by one unbind per tensor: its backward stacks the experts'
        gradients once, where indexing the stacked parameter expert by expert would add a
        zero-filled gradient of all E experts for each."""
        stacked = stacked or self.stacked()
        E = stacked[0].shape[0]
        parts = [t.unbind(0) if t is not None else (None,) * E for t in stacked]
        return list(zip(*parts))

    def expert(self, e: int, x: torch.Tensor, weights: list[tuple] | None = None) -> torch.Tensor:
        """Expert e on x (n, D) -> (n, D); weights: per_expert(), when the caller runs several."""
        w1, b1, w2, b2 = (weights or self.per_expert())[e]
        return F.linear(self.act(F.linear(x, w1, b1)), w2, b2)

    def products(self, rows: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor,
                 stacked: tuple | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        """rows (n, D) grouped by expert -> each through its expert, times scale (n,) when given
        (moe_forms.group_products). stacked: the experts' tensors (default: self.stacked();
        expert parallelism passes this rank's). A Triton grouped-GEMM kernel
        (kernels/triton_grouped_gemm.py) overrides this method."""
        return group_products(self, rows, counts, ids, stacked, scale)


# ------------------------------------------------------------------------------------------
# The block's MLP
# ------------------------------------------------------------------------------------------

class MoE(nn.Module):
    """The MoE MLP of a block: y = sum over the token's K experts of weight * expert(x), plus
    sigmoid(shared_gate(x)) * shared(x) when the model has a shared expert (the gate only where
    shared_expert_gate: Qwen's form; DeepSeek's shared expert is ungated).

    Keys under blocks.{i}.mlp.: router.weight (E, D) [router.bias (E,)] [router.correction_bias
    (E,), a buffer], experts.* (see Experts), shared.gate_up_proj / shared.down_proj (a SwiGLU of
    width Fs), shared_gate.weight (1, D). `impl` picks the form of the expert products (MOE_IMPLS,
    moe_forms.py)."""

    HOOKS = {"router_logits": "(B, T, E) float32: the router's logits", "experts": "(B, T, K) int: the experts "
             "each token goes to", "weights": "(B, T, K) float32: their weights (0 drops an expert's share)"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.impl = "auto"
        self.router = Router(config)
        self.experts = Experts(config)
        Fs = config.shared_expert_d_ff
        self.shared = SwiGLU(config, d_ff=Fs) if Fs else None
        self.shared_gate = nn.Linear(config.d_model, 1, bias=False) if config.shared_expert_gate else None

    def forward(self, x: torch.Tensor, record: dict | None = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D). record: a dict that receives this call's router_logits (N, E),
        experts (N, K), weights (N, K) and dropped (the share of assignments over capacity)."""
        B, T, D = x.shape
        flat = x.reshape(B * T, D)                                         # (N, D)
        logits = tap(self, "router_logits", self.router(flat), (B, T, -1))   # (N, E) float32; hooks.py
        weights, experts = route(logits, self.config, self.router.correction_bias)
        weights, experts = tap(self, "weights", weights, (B, T, -1)), tap(self, "experts", experts, (B, T, -1))
        keep = capacity_keep(experts, self.config.n_experts, expert_capacity(self.config, B * T))
        out = self.routed(flat, weights, experts, keep)                   # (N, D)
        if self.shared is not None:
            shared = self.shared(x).reshape(B * T, D)                      # (N, D); its hooks see (B, T, Fs)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        if record is not None:
            dropped = (1.0 - keep.float().mean()) if keep is not None else torch.zeros((), device=x.device)
            record.update(router_logits=logits, experts=experts, weights=weights, dropped=dropped)
        return out.view(B, T, D)

    def routed(self, x, weights, experts, keep) -> torch.Tensor:
        """The routed experts' weighted sum for each token: x (N, D) -> (N, D), by the form
        `impl` names. Expert parallelism (parallel/expert.py) overrides this method: the
        tokens travel to the ranks that hold their experts and back."""
        return FORMS[self.form(x)](self.experts, x, weights, experts, keep)

    def form(self, x: torch.Tensor) -> str:
        """The form `impl` names for x (N, D); "auto": moe_forms.choose_form (sorted or grouped,
        whichever measured faster here; gather for a few tokens while torch.compile traces;
        grouped where a kernel replaced Experts.products)."""
        if self.impl not in MOE_IMPLS:
            raise ValueError(f"MoE impl must be one of {MOE_IMPLS}, got {self.impl!r}")
        if self.impl != "auto":
            return self.impl
        replaced = type(self.experts).products is not Experts.products
        return choose_form(self.experts, x, self.config.n_experts_per_token, replaced)


def set_moe_impl(model: nn.Module, impl: str) -> None:
    """Set the expert-product form (MOE_IMPLS) of every MoE layer of `model`."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"MoE impl must be one of {MOE_IMPLS}, got {impl!r}")
    for module in model.modules():
        if isinstance(module, MoE):
            module.impl = impl
