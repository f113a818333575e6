"""The checks of ModelConfig's mixture-of-experts fields: config.py declares the fields and calls
check_moe from ModelConfig.__post_init__; the checks live here so that config.py stays short.
Imports nothing."""

from __future__ import annotations


def check_moe(c, fix) -> None:
    """The MoE fields of ModelConfig `c`: experts, top-k, widths, routing, the per-layer MLP kinds.
    fix(name, value) sets a derived field (moe_d_ff defaults to d_ff; an all-moe mlp_types is
    stored as None, the default). Fields an MoE reads must stay unset without experts."""
    E, K = c.n_experts, c.n_experts_per_token
    if E < 0:
        raise ValueError(f"n_experts must be >= 0, got {E}")
    if c.mlp_types is not None and len(c.mlp_types) != c.n_layers:
        raise ValueError(f"mlp_types has {len(c.mlp_types)} entries but n_layers is {c.n_layers}")
    if E == 0:
        for name in ("n_experts_per_token", "moe_d_ff", "capacity_factor"):
            if getattr(c, name) is not None:
                raise ValueError(f"{name}={getattr(c, name)!r} is set but n_experts is 0")
        if c.shared_expert_d_ff:
            raise ValueError(f"shared_expert_d_ff={c.shared_expert_d_ff} is set but n_experts is 0")
        if c.mlp_types is not None and "moe" in c.mlp_types:
            raise ValueError("mlp_types has moe layers but n_experts is 0")
        fix("mlp_types", None)
        return
    if c.mlp_types is not None and set(c.mlp_types) == {"moe"}:
        fix("mlp_types", None)                                 # the default, stored as such
    if K is None or not 1 <= K <= E:
        raise ValueError(f"n_experts_per_token must be in [1, n_experts={E}], got {K!r}")
    if c.mlp != "swiglu":
        raise ValueError(f"experts are SwiGLU MLPs: n_experts > 0 needs mlp='swiglu', got {c.mlp!r}")
    if c.moe_d_ff is None:
        fix("moe_d_ff", c.d_ff)
    for name in ("moe_d_ff", "n_expert_groups", "topk_groups"):
        if getattr(c, name) <= 0:
            raise ValueError(f"{name} must be a positive integer, got {getattr(c, name)!r}")
    if c.shared_expert_d_ff < 0:
        raise ValueError(f"shared_expert_d_ff must be >= 0, got {c.shared_expert_d_ff}")
    if c.shared_expert_gate and not c.shared_expert_d_ff:
        raise ValueError("shared_expert_gate=True needs a shared expert (shared_expert_d_ff > 0)")
    _check_routing(c, E, K)


def _check_routing(c, E: int, K: int) -> None:
    groups, best = c.n_expert_groups, c.topk_groups
    if c.router != "sigmoid_topk" and (groups, best) != (1, 1):
        raise ValueError(f"n_expert_groups={groups}, topk_groups={best}: group-limited routing needs "
                         f"router='sigmoid_topk', got {c.router!r}")
    if E % groups or (groups > 1 and E // groups < 2):
        raise ValueError(f"n_experts ({E}) must split into n_expert_groups ({groups}) groups of >= 2 experts")
    if best > groups or K > best * (E // groups):
        raise ValueError(f"topk_groups ({best}) must be <= n_expert_groups ({groups}) and hold the "
                         f"n_experts_per_token ({K}) experts: {best} x {E // groups} < {K}")
    if c.routed_scaling_factor <= 0:
        raise ValueError(f"routed_scaling_factor must be > 0, got {c.routed_scaling_factor}")
    if c.swiglu_limit <= 0 or c.swiglu_alpha <= 0:
        raise ValueError(f"swiglu_alpha ({c.swiglu_alpha}) and swiglu_limit ({c.swiglu_limit}) must be > 0")
    if c.capacity_factor is not None and c.capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or null: dropless), got {c.capacity_factor}")
    if c.router_aux_loss_coef < 0 or c.router_z_loss_coef < 0:
        raise ValueError(f"router_aux_loss_coef ({c.router_aux_loss_coef}) and router_z_loss_coef "
                         f"({c.router_z_loss_coef}) must be >= 0")
