"""LoRA on the experts of a mixture of experts: one low-rank update per expert of each stacked
expert tensor, as PEFT's `target_parameters` (its LoRA on an nn.Parameter) adapts them.

An MoE layer's experts are not nn.Linear modules but two stacked tensors (model/moe.py):
gate_up_proj (E, 2F, D) and down_proj (E, D, F). A LoRA on one of them gives every expert e
its own pair A_e (r, in), B_e (out, r), and the expert multiplies by

    W_e + s * B_e A_e,      A_e ~ Kaiming-uniform, B_e = 0 (the update starts at 0),

s = alpha / r (or alpha / sqrt(r), rsLoRA). The experts' `stacked()` (which every form of the
layer multiplies by: loop, grouped, gather) returns these sums, so each form sees the adapted
weights with no change of its own; merge writes them into the base tensors. Dropout on the
adapter's input has no place here (the update is a weight, not a side branch), as in PEFT.

Targets: "experts.gate_up_proj" and "experts.down_proj" (lora.EXPERT_TARGETS). The attention
projections of an MoE model take the ordinary targets (lora.py); gate_proj / up_proj /
down_proj reach its dense layers only. The shared expert, where a family has one, is not adapted.

Shapes: E experts, r rank, out/in a projection's output/input width (gate_up: 2F/D, down: D/F).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from logitlab.model.moe import Experts

EXPERT_PARTS = {"experts.gate_up_proj": "gate_up_proj", "experts.down_proj": "down_proj"}


class LoRAExperts(Experts):
    """An Experts module (its stacked tensors frozen, their state-dict keys kept) with an adapter
    per part: `lora_A.{part}` (E, r, in) and `lora_B.{part}` (E, out, r), part in gate_up_proj /
    down_proj. Made by `wrap_experts` from a built Experts (same Parameters, not copies)."""

    parts: tuple[str, ...] = ()
    scaling: float = 1.0
    merged: bool = False

    def delta(self, part: str) -> torch.Tensor:
        """s * B_e A_e for every expert e: (E, out, in)."""
        return self.scaling * torch.bmm(self.lora_B[part], self.lora_A[part])

    def stacked(self) -> tuple:
        w1, b1, w2, b2 = super().stacked()
        if self.merged:
            return w1, b1, w2, b2
        if "gate_up_proj" in self.parts:
            w1 = w1 + self.delta("gate_up_proj")                           # (E, 2F, D)
        if "down_proj" in self.parts:
            w2 = w2 + self.delta("down_proj")                              # (E, D, F)
        return w1, b1, w2, b2

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            for part in self.parts:
                getattr(self, part).add_(self.delta(part))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            for part in self.parts:
                getattr(self, part).sub_(self.delta(part))
            self.merged = False

    def base_weights(self) -> dict[str, torch.Tensor]:
        """{part: the frozen tensor without the update} (a merged module's minus its delta)."""
        return {p: getattr(self, p) - self.delta(p) if self.merged else getattr(self, p) for p in self.parts}

    def adapted_weights(self) -> dict[str, torch.Tensor]:
        """{part: the tensor with the update}."""
        return {p: getattr(self, p) if self.merged else getattr(self, p) + self.delta(p) for p in self.parts}


def wrap_experts(experts: Experts, parts, r: int, scaling: float,
                 generator: torch.Generator | None = None) -> LoRAExperts:
    """Turn `experts` (in place) into a LoRAExperts with adapters on `parts` -> it."""
    if isinstance(experts, LoRAExperts):
        raise ValueError("these experts already have LoRA adapters")
    experts.__class__ = LoRAExperts
    experts.parts, experts.scaling, experts.merged = tuple(sorted(parts)), float(scaling), False
    experts.lora_A, experts.lora_B = nn.ParameterDict(), nn.ParameterDict()
    for part in experts.parts:
        W = getattr(experts, part)                                         # (E, out, in)
        E, out, inp = W.shape
        A = torch.empty(E, r, inp, device=W.device, dtype=W.dtype)
        for e in range(E):   # PEFT's default, per expert: A Kaiming-uniform over its (r, in), B zero
            nn.init.kaiming_uniform_(A[e], a=math.sqrt(5), generator=generator)
        experts.lora_A[part] = nn.Parameter(A)
        experts.lora_B[part] = nn.Parameter(torch.zeros(E, out, r, device=W.device, dtype=W.dtype))
    return experts


def expert_lora_modules(model) -> dict[str, LoRAExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRAExperts)}


def apply_expert_lora(model, targets, r: int, scaling: float, dropout: float,
                      generator: torch.Generator | None = None) -> list[str]:
    """Adapters on the experts of every MoE layer of `model` for the expert `targets` -> the
    wrapped module names (blocks.{i}.mlp.experts)."""
    parts = [EXPERT_PARTS[t] for t in targets if t in EXPERT_PARTS]
    if not parts:
        return []
    if not model.config.is_moe:
        raise ValueError(f"LoRA targets {sorted(t for t in targets if t in EXPERT_PARTS)} need a mixture of "
                         "experts (n_experts > 0)")
    if dropout > 0:
        raise ValueError(f"LoRA dropout ({dropout}) cannot apply to experts' stacked weights (an update of the "
                         "weight, not a side branch on the input); use dropout 0 with experts targets")
    names = []
    for i, kind in enumerate(model.config.mlp_kinds):
        if kind == "moe":
            wrap_experts(model.get_submodule(f"blocks.{i}.mlp.experts"), parts, r, scaling, generator)
            names.append(f"blocks.{i}.mlp.experts")
    return names


__all__ = ["EXPERT_PARTS", "LoRAExperts", "apply_expert_lora", "expert_lora_modules", "wrap_experts"]
