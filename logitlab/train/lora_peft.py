"""LoRA adapters in Hugging Face PEFT's format: writing them for an exported model, and loading
PEFT adapters trained elsewhere onto a logitlab model.

lora_peft.py owns the key names. PEFT's adapters for a llama-layout Hugging Face model sit under
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (r, in) and `.lora_B.weight`
(out, r), one pair per separate projection; logitlab's per-part adapters on its fused projections
(lora.py) are exactly these, so the map is a renaming, both ways, at the same rank. The directory
is adapter_config.json + adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)` loads.

The experts of a mixture of experts (lora_moe.py) are PEFT's `target_parameters`
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, transformers' stacked (E, out, in) tensors).
PEFT nests one wrapper per adapted tensor, so with both adapted the gate_up_proj pair sits under
`mlp.experts.base_layer.lora_A.weight` and down_proj's under `mlp.experts.lora_A.weight` (with
one, under the latter). Its A stacks the experts' (r, in) matrices into (E * r, in); its B is
(out, r * E) with the expert index innermost: B[o, k * E + e] is expert e's B_e[o, k].
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from logitlab.train.lora import LoRAConfig, SharedLoRAEmbedding, apply_lora, lora_modules
from logitlab.train.lora_moe import EXPERT_PARTS, expert_lora_modules

_HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
              "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj"}
_PEFT_PREFIX = "base_model.model."


def _peft_layout_check(model) -> None:
    from logitlab.model.keymap import key_layout

    if isinstance(model.tok_emb, SharedLoRAEmbedding):
        raise ValueError("a LoRA shared by a tied head and embedding (tie='shared') has no PEFT form here; "
                         "train with tie='untie' to export adapters, or export merged_model(model)")

    if expert_lora_modules(model) and model.config.expert_bias:
        raise ValueError("PEFT adapters on experts are written for the (E, out, in) expert tensors of Mixtral and "
                         "the Qwen MoE families; gpt-oss stores its experts transposed and interleaved")
    if key_layout(model.config) != "llama":
        raise ValueError("PEFT adapters are written for llama-layout models (Llama, Qwen, Mistral exports); "
                         "a GPT-2-layout model's fused c_attn has no per-part names")


def peft_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's key names for the exported Hugging Face model, e.g.
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    _peft_layout_check(model)
    out = {}
    for name, m in lora_modules(model).items():
        for part, _, _ in m.parts:
            if name == "lm_head":
                hf = "lm_head"
            else:
                i = re.fullmatch(r"blocks\.(\d+)\..+", name).group(1)
                hf = f"model.layers.{i}.{_HF_MODULE[part]}"
            out[f"{_PEFT_PREFIX}{hf}.lora_A.weight"] = m.lora_A[part].detach().cpu().contiguous()
            out[f"{_PEFT_PREFIX}{hf}.lora_B.weight"] = m.lora_B[part].detach().cpu().contiguous()
    for key, (m, part, which) in _expert_keys(model).items():
        E, a, b = (m.lora_A if which == "A" else m.lora_B)[part].shape
        t = m.lora_A[part].reshape(E * a, b) if which == "A" else m.lora_B[part].permute(1, 2, 0).reshape(a, b * E)
        out[key] = t.detach().cpu().contiguous()                          # A (E*r, in), B (out, r*E)
    return out


def _expert_keys(model) -> dict[str, tuple]:
    """PEFT key -> (LoRAExperts, part, "A" or "B") for every expert adapter of `model`."""
    out = {}
    for name, m in expert_lora_modules(model).items():
        i = re.fullmatch(r"blocks\.(\d+)\..+", name).group(1)
        for part in m.parts:
            inner = part == "gate_up_proj" and len(m.parts) == 2           # PEFT's nested wrapper
            prefix = f"{_PEFT_PREFIX}model.layers.{i}.mlp.experts{'.base_layer' if inner else ''}"
            out[f"{prefix}.lora_A.weight"], out[f"{prefix}.lora_B.weight"] = (m, part, "A"), (m, part, "B")
    return out


def peft_adapter_config(model, base_model_name_or_path: str | None = None) -> dict:
    config: LoRAConfig = model.lora_config
    modules = sorted(t for t in config.targets if t not in EXPERT_PARTS)
    parameters = [f"mlp.{t}" for t in sorted(EXPERT_PARTS) if t in config.targets]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.r, "lora_alpha": config.alpha,
            "lora_dropout": config.dropout, "target_modules": modules, "target_parameters": parameters or None,
            "use_rslora": config.rslora,
            "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True, "base_model_name_or_path": base_model_name_or_path}


def save_peft_adapter(model, directory: str | os.PathLike, base_model_name_or_path: str | None = None,
                      overwrite: bool = False) -> Path:
    """Atomically write adapter_config.json + adapter_model.safetensors, which
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory) loads."""
    from safetensors.torch import save_file

    from logitlab.io.files import atomic_directory

    if any(m.merged for m in lora_modules(model).values()):
        raise ValueError("the adapters are merged into the weights; unmerge_lora(model) before saving them")
    state = peft_state_dict(model)
    with atomic_directory(directory, "PEFT adapter", overwrite=overwrite) as tmp:
        save_file(state, str(Path(tmp) / "adapter_model.safetensors"), metadata={"format": "pt"})
        text = json.dumps(peft_adapter_config(model, base_model_name_or_path), indent=2) + "\n"
        (Path(tmp) / "adapter_config.json").write_text(text)
    return Path(directory)


def load_peft_adapter(model, directory: str | os.PathLike) -> list[str]:
    """Wrap `model` with the adapters of a PEFT LoRA directory (trained anywhere) -> wrapped names."""
    from safetensors.torch import load_file

    from logitlab.io.files import read_json

    directory = Path(directory)
    cfg = read_json(directory / "adapter_config.json", "adapter config")
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise ValueError(f"{directory / 'adapter_config.json'}: not a PEFT LoRA config (peft_type must be 'LORA')")
    targets = cfg.get("target_modules")
    targets = tuple(targets) if isinstance(targets, list) else ("all-linear",) if targets == "all-linear" else targets
    parameters = cfg.get("target_parameters") or []
    experts = [p.removeprefix("mlp.") for p in parameters if p.removeprefix("mlp.") in EXPERT_PARTS]
    if len(experts) != len(parameters):
        raise ValueError(f"{directory / 'adapter_config.json'}: target_parameters {parameters} are not among "
                         f"{['mlp.' + p for p in EXPERT_PARTS]}")
    targets = (*(targets or ()), *experts)
    config = LoRAConfig(r=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0.0)),
                        targets=targets, rslora=bool(cfg.get("use_rslora", False)))
    _peft_layout_check(model)
    names = apply_lora(model, config)
    state = load_file(str(directory / "adapter_model.safetensors"))
    ours = peft_state_dict(model)
    theirs = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
              for k, v in state.items()}
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or unexpected:
        raise ValueError(f"{directory / 'adapter_model.safetensors'}: keys disagree with the model's adapters: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    _assign_peft(model, theirs)
    return names


@torch.no_grad()
def _assign_peft(model, state: dict) -> None:
    by_key = {}
    for name, m in lora_modules(model).items():
        for part, _, _ in m.parts:
            hf = "lm_head" if name == "lm_head" else \
                f"model.layers.{name.split('.')[1]}.{_HF_MODULE[part]}"
            by_key[f"{_PEFT_PREFIX}{hf}.lora_A.weight"] = m.lora_A[part]
            by_key[f"{_PEFT_PREFIX}{hf}.lora_B.weight"] = m.lora_B[part]
    for key, (m, part, which) in _expert_keys(model).items():
        E, a, b = (m.lora_A if which == "A" else m.lora_B)[part].shape
        t = state[key]
        if tuple(t.shape) != ((E * a, b) if which == "A" else (a, b * E)):
            raise ValueError(f"adapter tensor {key} has shape {tuple(t.shape)}, the model's {E} experts expect "
                             f"{(E * a, b) if which == 'A' else (a, b * E)}")
        if which == "A":
            m.lora_A[part].copy_(t.reshape(E, a, b))
        else:
            m.lora_B[part].copy_(t.reshape(a, b, E).permute(2, 0, 1))
    for key, param in by_key.items():
        if tuple(state[key].shape) != tuple(param.shape):
            raise ValueError(f"adapter tensor {key} has shape {tuple(state[key].shape)}, the model expects "
                             f"{tuple(param.shape)}")
        param.copy_(state[key])


def export_lora_checkpoint(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *,
                           overwrite: bool = False) -> tuple[Path, Path]:
    """A LoRA SFT checkpoint -> (OUT: the base model as a Hugging Face directory with its tokenizer
    (io.hf.save_pretrained); OUT-adapter: the PEFT adapter directory beside it). The base
    is rebuilt from the directory recorded in state.json, wrapped with the recorded LoRAConfig,
    and given the checkpoint's adapters (adapters.safetensors)."""
    import dataclasses

    from safetensors.torch import load_file

    from logitlab.io.checkpoint import read_state
    from logitlab.io.hf import save_pretrained
    from logitlab.io.loading import load_model_and_tokenizer
    from logitlab.train.lora import base_model

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    state = read_state(ckpt)
    if "lora" not in state or not state.get("base") or not (ckpt / "adapters.safetensors").is_file():
        raise ValueError(f"{ckpt} is not a LoRA SFT checkpoint (state.json lacks 'lora' / 'base', or "
                         f"adapters.safetensors is missing)")
    base = load_model_and_tokenizer(state["base"])            # a directory, or a hub id pinned to its commit
    model, tok = base.model, base.tokenizer
    fields = {f.name for f in dataclasses.fields(LoRAConfig)}
    recorded = {k: (tuple(v) if isinstance(v, list) else v) for k, v in state["lora"].items() if k in fields}
    config = LoRAConfig(**recorded)
    apply_lora(model, config)
    missing, unexpected = model.load_state_dict(load_file(str(ckpt / "adapters.safetensors")), strict=False)
    if unexpected or any(".lora_" in k for k in missing):
        raise ValueError(f"{ckpt / 'adapters.safetensors'} does not match {state['base']} with {config}")
    save_pretrained(base_model(model), out_dir, tok, overwrite=overwrite)
    adapter = out_dir.with_name(out_dir.name + "-adapter")
    save_peft_adapter(model, adapter, base_model_name_or_path=str(out_dir), overwrite=overwrite)
    return out_dir, adapter
