"""Hugging Face names of a mixture-of-experts layer's tensors, both ways (keymap.py calls these for
the MoE layers of a llama-layout checkpoint; transformer.py documents logitlab's keys).

The families store experts three ways, under model.layers.{i}.:

- per expert, as transformers writes Mixtral and Qwen-MoE checkpoints: Mixtral
  block_sparse_moe.gate (the router) and block_sparse_moe.experts.{j}.w1 / w3 / w2 (gate, up,
  down); Qwen3-MoE and Qwen3.5-MoE mlp.gate and mlp.experts.{j}.gate_proj / up_proj / down_proj;
- fused, transformers' own parameters since 5.0: mlp.gate and mlp.experts.gate_up_proj (E, 2F, D),
  mlp.experts.down_proj (E, D, F), logitlab's layout already;
- gpt-oss: mlp.router (with a bias), mlp.experts.gate_up_proj (E, D, 2F) whose columns alternate
  gate, up, gate, up, ..., gate_up_proj_bias (E, 2F) alike, down_proj (E, F, D), down_proj_bias.

Qwen3.5-MoE adds mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate; DeepSeek-V3
(Qwen's expert names) mlp.shared_experts.{gate,up,down}_proj and the router's selection bias
mlp.gate.e_score_correction_bias (logitlab's router.correction_bias). Import reads
the per-expert and fused layouts (which one is the checkpoint's names); export writes per expert,
the layout transformers writes, unless asked for fused. Family names appear here because the
names are the families' (as in keymap.py). Pure functions; this module imports nothing.
"""

from __future__ import annotations

import re

EXPERT_LAYOUTS = ("per_expert", "fused")
_PER_EXPERT = re.compile(r"(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)$")
_PARTS = {"mixtral": {"w1": 0, "w3": 1, "w2": 2}, "qwen": {"gate_proj": 0, "up_proj": 1, "down_proj": 2}}


def moe_family(arch: str) -> str:
    """The naming scheme of an MoE architecture: "mixtral", "qwen", "gpt_oss" or "deepseek"."""
    return {"MixtralForCausalLM": "mixtral", "GptOssForCausalLM": "gpt_oss",
            "DeepseekV3ForCausalLM": "deepseek"}.get(arch, "qwen")


def expert_layout_of(names) -> str:
    """"per_expert" when a checkpoint's names hold one tensor per expert, else "fused"."""
    return "per_expert" if any(_PER_EXPERT.search(n.rpartition(".")[0]) for n in names) else "fused"


def hf_expert_indices(shapes: dict, limit: int) -> set[int]:
    """The expert indices j a checkpoint's tensors hold, from names and shapes alone (name -> shape):
    experts.{j}.* per expert, or 0 .. E - 1 for the first dimension E of a fused experts.gate_up_proj /
    down_proj (at most `limit` of them). A loader compares them with the config's count first, so that
    a count no tensor backs is refused before one name per expert and layer is made."""
    found = set()
    for name, shape in shapes.items():
        per_expert = _PER_EXPERT.search(name.rpartition(".")[0])
        if per_expert:
            found.add(int(per_expert.group(2)))
        elif re.search(r"\.experts\.(gate_up_proj|down_proj)$", name) and shape:
            found.update(range(min(shape[0], limit)))
    return found


def moe_architecture(c, bad) -> str:
    """The Hugging Face class that runs the MoE config `c` exactly, from its typed features:
    gpt-oss (sinks), Qwen3.5-MoE (Qwen3.5's features), Qwen3-MoE (QK-norm) or Mixtral.
    bad(field, value, arch) raises for a feature the class cannot hold."""
    if c.capacity_factor is not None:
        bad("capacity_factor", c.capacity_factor, "MoE (transformers' experts are dropless)")
    for field in ("routed_scaling_factor", "n_expert_groups"):
        if getattr(c, field) != 1:
            bad(field, getattr(c, field), "Mixtral, Qwen-MoE or gpt-oss")
    if c.attn_sinks:
        need, arch = dict(router="topk_softmax", router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                          shared_expert_d_ff=0, qk_norm=False, bias=True, qkv_bias=True), "GptOssForCausalLM"
    elif c.norm_zero_centered or c.attn_gate != "none" or "linear_attention" in c.layer_kinds:
        need, arch = dict(router="softmax_topk", norm_topk_prob=True, shared_expert_gate=True, router_bias=False,
                          expert_bias=False, expert_act="swiglu"), "Qwen3_5MoeForCausalLM"
    else:
        need = dict(router="softmax_topk", router_bias=False, expert_bias=False, expert_act="swiglu",
                    shared_expert_d_ff=0, bias=False, qkv_bias=False)
        arch = "Qwen3MoeForCausalLM" if c.qk_norm else "MixtralForCausalLM"
        if arch == "MixtralForCausalLM":
            need["norm_topk_prob"] = True
    for field, value in need.items():
        if getattr(c, field) != value:
            bad(field, getattr(c, field), arch)
    if arch != "Qwen3MoeForCausalLM" and c.mlp_types is not None:
        bad("mlp_types", c.mlp_types, f"{arch} (every layer an MoE)")
    kinds = set(c.layer_kinds)
    if arch == "MixtralForCausalLM" and len(kinds) > 1 or arch == "Qwen3MoeForCausalLM" and kinds != {"full_attention"}:
        bad("layer_types", sorted(kinds), arch)
    return arch


# ------------------------------------------------------------------------------------------
# Hugging Face -> logitlab
# ------------------------------------------------------------------------------------------

def is_moe_key(sub: str) -> bool:
    """Whether a name under model.layers.{i}. belongs to an MoE layer's router, experts or shared expert."""
    return bool(re.match(r"(block_sparse_moe\.|mlp\.(gate|router|experts|shared_experts?|shared_expert_gate)\.)",
                         sub + "."))


def moe_from_hf(i: str, sub: str, tensor, config, arch: str, pending: dict):
    """One Hugging Face tensor of MoE layer i (sub: its name under model.layers.{i}.) -> the
    logitlab (name, tensor) pairs it completes: per-expert and shared-expert parts are held in
    `pending` until their stacked or fused tensor is whole."""
    import torch

    out = f"blocks.{i}.mlp."
    if re.fullmatch(r"(block_sparse_moe|mlp)\.(gate|router)\.(weight|bias)", sub):
        return [(out + "router." + sub.rsplit(".", 1)[1], tensor)]
    if sub == "mlp.gate.e_score_correction_bias":                          # DeepSeek-V3
        return [(out + "router.correction_bias", tensor)]
    if sub == "mlp.shared_expert_gate.weight":
        return [(out + "shared_gate.weight", tensor)]
    if sub.startswith(("mlp.shared_expert.", "mlp.shared_experts.")):
        part = sub.split(".")[2]
        if part == "down_proj":
            return [(out + "shared.down_proj.weight", tensor)]
        name = out + "shared.gate_up_proj.weight"
        parts = pending.setdefault(name, {})
        parts[part] = tensor
        if len(parts) < 2:
            return []
        del pending[name]
        return [(name, torch.cat([parts["gate_proj"], parts["up_proj"]]))]
    m = _PER_EXPERT.fullmatch(sub.rsplit(".", 1)[0])
    if m:
        return _per_expert_part(out, int(m.group(2)), m.group(3), tensor, config, pending)
    name = sub.rsplit(".", 1)[-1]
    if moe_family(arch) == "gpt_oss":
        return [_gpt_oss_from_hf(out, name, tensor)]
    return [(out + "experts." + name, tensor)]                             # fused: our layout already


def _per_expert_part(out: str, j: int, part: str, tensor, config, pending: dict):
    import torch

    index = _PARTS["mixtral"].get(part, _PARTS["qwen"].get(part))
    if index is None:
        raise ValueError(f"unexpected expert tensor {part!r} of layer {out.split('.')[1]}")
    E = config.n_experts
    name = out + ("experts.down_proj" if index == 2 else "experts.gate_up_proj")
    parts = pending.setdefault(name, {})
    parts[(j, index)] = tensor
    if len(parts) < (E if index == 2 else 2 * E):
        return []
    del pending[name]
    if index == 2:
        return [(name, torch.stack([parts[(e, 2)] for e in range(E)]))]       # (E, D, F)
    return [(name, torch.stack([torch.cat([parts[(e, 0)], parts[(e, 1)]]) for e in range(E)]))]  # (E, 2F, D)


def _gpt_oss_from_hf(out: str, name: str, tensor):
    """gpt-oss's transposed, interleaved expert tensors -> logitlab's (E, 2F, D) / (E, D, F)."""
    if name in ("gate_up_proj", "gate_up_proj_bias"):
        t = tensor.transpose(1, 2) if name == "gate_up_proj" else tensor      # (E, 2F, D) or (E, 2F)
        deinterleaved = t.new_empty(t.shape)
        F2 = t.shape[1] // 2
        deinterleaved[:, :F2], deinterleaved[:, F2:] = t[:, 0::2], t[:, 1::2]
        return out + ("experts.gate_up_proj" if name == "gate_up_proj" else "experts.gate_up_bias"), deinterleaved
    if name == "down_proj":
        return out + "experts.down_proj", tensor.transpose(1, 2).contiguous()   # (E, D, F)
    if name == "down_proj_bias":
        return out + "experts.down_bias", tensor
    raise ValueError(f"unexpected gpt-oss expert tensor {name!r}")


# ------------------------------------------------------------------------------------------
# logitlab -> Hugging Face
# ------------------------------------------------------------------------------------------

def moe_to_hf(i: str, sub: str, tensor, config, arch: str, layout: str = "per_expert") -> dict:
    """One logitlab tensor of MoE layer i (sub: its name under blocks.{i}.mlp.) -> its Hugging
    Face tensors under model.layers.{i}. (per expert, or `layout`="fused"; gpt-oss has one layout)."""
    family = moe_family(arch)
    base = f"model.layers.{i}."
    owner = "block_sparse_moe" if family == "mixtral" and layout == "per_expert" else "mlp"
    if sub == "router.correction_bias":
        return {base + "mlp.gate.e_score_correction_bias": tensor}
    if sub.startswith("router."):
        return {f"{base}{owner}.{'router' if family == 'gpt_oss' else 'gate'}.{sub[7:]}": tensor}
    if sub == "shared_gate.weight":
        return {base + "mlp.shared_expert_gate.weight": tensor}
    if sub.startswith("shared."):
        shared = base + ("mlp.shared_experts." if family == "deepseek" else "mlp.shared_expert.")
        if sub.startswith("shared.down_proj"):
            return {shared + "down_proj.weight": tensor}
        gate, up = tensor.chunk(2, dim=0)
        return {shared + "gate_proj.weight": gate, shared + "up_proj.weight": up}
    name = sub.split(".", 1)[1]                                            # experts.<name>
    if family == "gpt_oss":
        return {base + "mlp.experts." + k: v for k, v in _gpt_oss_to_hf(name, tensor).items()}
    if layout == "fused":
        return {base + "mlp.experts." + name: tensor}
    gate_name, up_name, down_name = (("w1", "w3", "w2") if family == "mixtral"
                                     else ("gate_proj", "up_proj", "down_proj"))
    out = {}
    for j in range(tensor.shape[0]):
        prefix = f"{base}{owner}.experts.{j}."
        if name == "down_proj":
            out[prefix + down_name + ".weight"] = tensor[j]
        else:
            gate, up = tensor[j].chunk(2, dim=0)
            out[prefix + gate_name + ".weight"], out[prefix + up_name + ".weight"] = gate, up
    return out


def _gpt_oss_to_hf(name: str, tensor) -> dict:
    import torch

    if name in ("gate_up_proj", "gate_up_bias"):
        gate, up = tensor.chunk(2, dim=1)                                  # (E, F, ...) each
        interleaved = torch.stack((gate, up), dim=2).reshape(tensor.shape)  # rows g0 u0 g1 u1 ...
        if name == "gate_up_proj":
            return {"gate_up_proj": interleaved.transpose(1, 2)}            # (E, D, 2F)
        return {"gate_up_proj_bias": interleaved}
    if name == "down_proj":
        return {"down_proj": tensor.transpose(1, 2)}                       # (E, F, D)
    return {"down_proj_bias": tensor}
