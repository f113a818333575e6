"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): frozen base
weights plus trainable low-rank updates on chosen linear layers; merge, unmerge, and adapters in
the format Hugging Face PEFT loads.

lora.py owns the adapters. A wrapped projection computes

    y = x W^T + b + s * (dropout(x) A^T) B^T,   A (r, in) ~ Kaiming-uniform, B (out, r) = 0,

so a freshly wrapped model gives exactly the base model's logits; s = alpha / r, or alpha / sqrt(r)
with rsLoRA (Kalajdzievski 2023). Only A and B require grad, so only they reach the optimizer
(optim.param_groups skips frozen parameters).

Targets are named as in Hugging Face (and PEFT): q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj, lm_head, or "all-linear" (every projection of every block, not the head).
logitlab fuses q/k/v into one attn.qkv_proj and gate/up into one mlp.gate_up_proj. A target
inside a fused projection gets its own adapter over its own block of output rows: A_q (r, D),
B_q (H*Dh, r), and so on. This is the choice that makes both directions exact at the same rank:
PEFT's adapters on Hugging Face's separate q_proj / k_proj / v_proj are exactly these, key for
key. (One LoRA on the fused matrix, a shared A with B's rows split into q, k and v, is the special
case A_q = A_k = A_v; it exports exactly by copying A into each part, but PEFT's independent
adapters would need rank 3r to load into it, and "q_proj,v_proj" could not leave k alone.)

Tying. The LM head of a tied model is the embedding Parameter itself. Wrapping the head adds
s * B A to the head's matrix only: the embedding lookup still reads W, so the effective model is
no longer tied, and merging would write W + s B A into the shared Parameter, changing the
embedding as well. `apply_lora` offers two documented behaviours instead, and tie="refuse":
* tie="untie" (the default): the head gets its own copy of W first, config.tie_embeddings
  becomes False (an export says so), and the embedding is never touched;
* tie="shared": one adapter on the shared matrix, used on both sides: the embedding looks rows up
  in W + s B A as well (SharedLoRAEmbedding), so the model stays tied, gradients reach the adapter
  from both uses, and a merge writes the one matrix both read.
Transformer multiplies a padded head's first V rows directly, without calling the module, so
the head can be wrapped only when the vocabulary is not padded (ValueError otherwise).

PEFT's file format (adapter_config.json + adapter_model.safetensors, both ways) is lora_peft.py's.

Shapes: D d_model, r rank, out/in a projection's output/input width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.train.lora_moe import EXPERT_PARTS, apply_expert_lora, expert_lora_modules

HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha, dropout on the adapter's input, targets (HF names, or "all-linear"), rsLoRA."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    rslora: bool = False
    tie: Literal["untie", "shared", "refuse"] = "untie"

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t.strip() for t in self.targets.split(",") if t.strip()))
        if self.targets == ("all-linear",):
            object.__setattr__(self, "targets", ALL_LINEAR)
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in HF_TARGETS and t not in EXPERT_PARTS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {unknown or '(none)'} are not among {HF_TARGETS + tuple(EXPERT_PARTS)} "
                             "or 'all-linear'")
        if self.tie not in ("untie", "shared", "refuse"):
            raise ValueError(f"tie must be 'untie', 'shared' or 'refuse', got {self.tie!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


class LoRALinear(nn.Linear):
    """An nn.Linear (its weight and bias keep their state-dict keys, frozen) plus one adapter per
    part: `parts` = ((name, first row, end row), ...) of the output. Adapter keys:
    `lora_A.{name}` (r, in) and `lora_B.{name}` (rows, r)."""

    def __init__(self, base: nn.Linear, parts, r: int, scaling: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         device="meta")
        self.weight, self.bias = base.weight, base.bias          # the same Parameters, not copies
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.parts = tuple((str(n), int(a), int(b)) for n, a, b in parts)
        self.r, self.scaling, self.merged = r, float(scaling), False
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        D_in = self.in_features
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(r, D_in, **kw)) for n, _, _ in self.parts})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(b - a, r, **kw)) for n, a, b in self.parts})
        for a in self.lora_A.values():  # PEFT's default: A Kaiming-uniform, B zero (the update starts at 0)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)

    def delta_weight(self) -> torch.Tensor:
        """s * B A for every part, in place in an (out, in) matrix (zero rows where no part is)."""
        delta = torch.zeros_like(self.weight)
        for n, a, b in self.parts:
            delta[a:b] = self.scaling * (self.lora_B[n] @ self.lora_A[n])
        return delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)                   # (..., out)
        if self.merged:
            return y
        xd = self.dropout(x)                                      # (..., in)
        pieces, at = [], 0
        for n, a, b in self.parts:                                # parts sorted by first row
            if a > at:
                pieces.append(y.new_zeros(*y.shape[:-1], a - at))
            pieces.append(F.linear(F.linear(xd, self.lora_A[n]), self.lora_B[n]) * self.scaling)  # (..., b - a)
            at = b
        if at < self.out_features:
            pieces.append(y.new_zeros(*y.shape[:-1], self.out_features - at))
        return y + torch.cat(pieces, dim=-1)

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            self.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight -= self.delta_weight()
            self.merged = False


class SharedLoRAEmbedding(nn.Embedding):
    """The embedding of a tied model whose LM head has a LoRA (tie="shared"): it looks rows up in
    the same adapted matrix the head uses, W + s B A, so the tie holds for the effective weights.
    Row i is W[i] + s B[i] A; B and A are the head's (one adapter, trained from both sides)."""

    def __init__(self, base: nn.Embedding, head: LoRALinear):
        super().__init__(base.num_embeddings, base.embedding_dim, device="meta")
        self.weight = base.weight                                 # the shared Parameter
        self._head = [head]                                       # a reference, not a submodule

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.weight)                         # (B, T, D)
        head = self._head[0]
        if head.merged:
            return x
        B, A = head.lora_B["lm_head"], head.lora_A["lm_head"]     # (V, r), (r, D)
        return x + head.scaling * (F.embedding(ids, B) @ A)       # (B, T, r) @ (r, D)


def projection_parts(model) -> dict[str, tuple[str, int, int]]:
    """HF target name -> (logitlab module suffix, first row, end row) within that module."""
    c = model.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    parts = {"q_proj": ("attn.qkv_proj", 0, q), "k_proj": ("attn.qkv_proj", q, q + kv),
             "v_proj": ("attn.qkv_proj", q + kv, q + 2 * kv), "o_proj": ("attn.o_proj", 0, c.d_model),
             "down_proj": ("mlp.down_proj", 0, c.d_model)}
    if c.mlp == "swiglu":
        parts.update(gate_proj=("mlp.gate_up_proj", 0, c.d_ff), up_proj=("mlp.gate_up_proj", c.d_ff, 2 * c.d_ff))
    else:
        parts.update(up_proj=("mlp.up_proj", 0, c.d_ff))
    if getattr(c, "is_mla", False):     # latent attention: q_a/q_b and kv_a/kv_b, not adapted here
        for name in ("q_proj", "k_proj", "v_proj"):
            del parts[name]
    return parts


def _untie(model, config: LoRAConfig) -> None:
    if not model.config.tie_embeddings or config.tie == "shared":
        return
    if config.tie == "refuse":
        raise ValueError("lm_head is tied to tok_emb: a LoRA on it would reach the head only (tie='untie' "
                         "gives the head its own copy of the matrix first)")
    model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    model.config = dataclasses.replace(model.config, tie_embeddings=False)


def _wanted_projections(model, config: LoRAConfig) -> dict[str, list]:
    """Module name -> the (target, first row, end row) parts to adapt in it, for every block's
    projections (not the head, not the experts). gate/up/down reach the dense layers only."""
    parts = projection_parts(model)
    wanted: dict[str, list] = {}
    for target in config.targets:
        if target == "lm_head" or target in EXPERT_PARTS:
            continue
        if target not in parts:
            latent = " with multi-head latent attention" if getattr(model.config, "is_mla", False) else ""
            here = [*parts, "lm_head", *(EXPERT_PARTS if model.config.is_moe else ())]
            raise ValueError(f"LoRA target {target!r} does not exist in a {model.config.mlp} model{latent} "
                             f"(targets here: {', '.join(here)})")
        suffix, a, b = parts[target]
        kinds = model.config.mlp_kinds
        layers = [i for i, kind in enumerate(kinds) if kind == "dense" or not suffix.startswith("mlp.")]
        if not layers and config.targets != ALL_LINEAR:
            raise ValueError(f"LoRA target {target!r}: every layer of this model is a mixture of experts; its "
                             f"experts take the targets {', '.join(EXPERT_PARTS)}")
        for i in layers:
            wanted.setdefault(f"blocks.{i}.{suffix}", []).append((target, a, b))
    return wanted


def apply_lora(model, config: LoRAConfig, seed: int | None = None) -> list[str]:
    """Freeze every parameter of `model` (in place) and wrap the targets -> the wrapped module names.
    seed: the A matrices' initialisation draws from a generator seeded with it (None: torch's global one)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed) if seed is not None else None
    for p in model.parameters():
        p.requires_grad_(False)
    wanted = _wanted_projections(model, config)
    if "lm_head" in config.targets:
        if model.config.padded_vocab_size != model.config.vocab_size:
            raise ValueError("LoRA on lm_head needs an unpadded vocabulary (vocab_pad_multiple=1): a padded "
                             "head is multiplied through its weight, not its module, so the adapter would be skipped")
        _untie(model, config)
        wanted["lm_head"] = [("lm_head", 0, model.config.vocab_size)]
    for name, part_list in wanted.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        if isinstance(base, LoRALinear):
            raise ValueError(f"{name} already has LoRA adapters")
        setattr(parent, leaf, LoRALinear(base, sorted(part_list, key=lambda p: p[1]), config.r,
                                         config.scaling, config.dropout, generator))
    if "lm_head" in wanted and model.config.tie_embeddings:       # tie="shared": both sides adapted
        model.tok_emb = SharedLoRAEmbedding(model.tok_emb, model.lm_head)
    experts = apply_expert_lora(model, config.targets, config.r, config.scaling, config.dropout, generator)
    model.lora_config = config
    return sorted([*wanted, *experts])


def lora_modules(model) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model) -> None:
    """Add every adapter's s * B A into its base weight (forward then skips the adapters)."""
    for m in [*lora_modules(model).values(), *expert_lora_modules(model).values()]:
        m.merge()


def unmerge_lora(model) -> None:
    """Subtract what merge_lora added (exact up to float rounding)."""
    for m in [*lora_modules(model).values(), *expert_lora_modules(model).values()]:
        m.unmerge()


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """Only the adapters: {"blocks.0.attn.qkv_proj.lora_A.q_proj": (r, D), ...}."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


@torch.no_grad()
def merged_model(model):
    """A plain Transformer (new, same config) whose weights are the adapted model's, merged."""
    from logitlab.model.transformer import Transformer

    plain = Transformer(model.config).to(next(model.parameters()).device)
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, m in lora_modules(model).items():
        state[f"{name}.weight"] = m.weight if m.merged else m.weight + m.delta_weight()
    for name, m in expert_lora_modules(model).items():
        state.update({f"{name}.{part}": w for part, w in m.adapted_weights().items()})
    if model.config.tie_embeddings and "lm_head.weight" in state:   # tie="shared": one adapted matrix
        state["tok_emb.weight"] = state.pop("lm_head.weight")
    plain.load_state_dict(state, strict=not model.config.tie_embeddings)
    plain.tie_weights()
    return plain.eval()


@torch.no_grad()
def base_model(model):
    """A plain Transformer (new, same config) holding the adapted model's base weights only: what
    `save_pretrained` exports beside a PEFT adapter directory."""
    from logitlab.model.transformer import Transformer

    plain = Transformer(model.config).to(next(model.parameters()).device)
    state = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, m in lora_modules(model).items():
        if m.merged:
            state[f"{name}.weight"] = m.weight - m.delta_weight()
    for name, m in expert_lora_modules(model).items():
        state.update({f"{name}.{part}": w for part, w in m.base_weights().items()})
    plain.load_state_dict(state, strict=not model.config.tie_embeddings)
    plain.tie_weights()
    return plain.eval()


def train_token_rows(model, ids) -> "_Handles":
    """Make only the rows `ids` of the embedding (and of the LM head, the same Parameter when tied;
    an untied head's rows too) trainable, as PEFT's trainable_token_indices: a new special token's
    embedding has to be learned even when everything else stays frozen.

    The table's gradient is masked to those rows by a hook, so with no weight decay on the table
    AdamW leaves every other row exactly as it was (its gradients, moments and so its updates are
    all zero). The embedding, and a tied head with it, is never decayed unless
    TrainConfig.decay_embeddings; an untied head is a matrix, decayed unless weight_decay is 0.
    -> the hooks' handle (remove() undoes them)."""
    ids = torch.as_tensor(list(ids), dtype=torch.long)
    V = model.config.vocab_size
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"token rows must be a non-empty list of ids in 0..{V - 1}, got {ids.tolist()}")
    tables = [model.tok_emb.weight]
    if model.lm_head.weight is not model.tok_emb.weight:
        tables.append(model.lm_head.weight)
    handles = []
    for weight in tables:
        mask = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)   # (V_padded, 1)
        mask[ids.to(weight.device)] = 1
        weight.requires_grad_(True)
        handles.append(weight.register_hook(lambda grad, mask=mask: grad * mask))
    return _Handles(handles)


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
