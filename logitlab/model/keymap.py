"""Hugging Face state-dict key maps: pure functions over {name: tensor}.

state_dict_from_hf / state_dict_to_hf map between Hugging Face tensor names and logitlab's
(transformer.py documents ours); hf_tensors_to_logitlab converts one tensor at a time for
streaming loaders. Two layouts exist: "gpt2" (Conv1D weights stored (in, out), q, k, v fused in
one c_attn, as logitlab's qkv_proj) and "llama" (nn.Linear weights, shared by Llama, Mistral,
Qwen2, Qwen3; separate q/k/v and gate/up, joined into logitlab's fused projections). Which
layout a config uses follows from hf_architecture, the Hugging Face class chosen from its typed
features (also families.config_to_hf's choice). This module never touches the disk.
"""

from __future__ import annotations

import re

from logitlab.model.config import ModelConfig
from logitlab.model.keymap_mla import deepseek_v3_architecture, drop_mtp_layers, mla_name_from_hf, mla_name_to_hf
from logitlab.model.keymap_moe import (  # noqa: F401  (expert_layout_of: importable from here)
    expert_layout_of,
    is_moe_key,
    moe_architecture,
    moe_from_hf,
    moe_to_hf,
)


def hf_architecture(config: ModelConfig) -> str:
    """The Hugging Face class that runs `config` exactly, chosen from typed features:
    learned positions + LayerNorm + GELU -> GPT2LMHeadModel; QK-norm -> Qwen3ForCausalLM; biases on
    q/k/v only -> Qwen2ForCausalLM; otherwise LlamaForCausalLM. A config no class can run exactly
    raises ValueError naming the field."""
    c = config

    def bad(field: str, value, arch: str) -> None:
        raise ValueError(f"{field}={value!r} cannot be expressed as a Hugging Face {arch} checkpoint")

    if c.norm_placement != "pre":
        bad("norm_placement", c.norm_placement, "model")
    if c.is_mla:                                         # DeepSeek-V3: keymap_mla.py
        return deepseek_v3_architecture(c, bad)
    if c.is_moe:                                         # Mixtral, Qwen3-MoE, Qwen3.5-MoE, gpt-oss: keymap_moe.py
        return _moe(c, bad)
    if c.attn_sinks:
        bad("attn_sinks", True, "causal-LM")
    found = features_without_hf_class(c)
    if found:
        raise ValueError(f"the model has {listed(found)}, which no Hugging Face class that logitlab writes has "
                         f"a place for")
    if c.norm_zero_centered or c.attn_gate != "none" or "linear_attention" in c.layer_kinds:
        return _qwen3_5(c, bad)
    if c.partial_rotary_factor != 1.0:
        bad("partial_rotary_factor", c.partial_rotary_factor, "GPT-2 or Llama-style")
    if c.positions == "learned" and c.norm == "layernorm" and c.mlp == "gelu":
        arch = "GPT2LMHeadModel"
        if not (c.bias and c.qkv_bias):
            bad("bias", (c.bias, c.qkv_bias), arch)
        if c.qk_norm or c.n_kv_heads != c.n_heads or c.head_dim * c.n_heads != c.d_model:
            bad("qk_norm/n_kv_heads/head_dim", (c.qk_norm, c.n_kv_heads, c.head_dim), arch)
        return arch
    if c.positions != "rope" or c.norm != "rmsnorm" or c.mlp != "swiglu":
        bad("positions/norm/mlp", (c.positions, c.norm, c.mlp), "GPT-2 or Llama-style")
    kinds = set(c.layer_kinds)
    if c.qk_norm:
        if c.bias or c.qkv_bias:
            bad("bias/qkv_bias", (c.bias, c.qkv_bias), "Qwen3ForCausalLM")
        return "Qwen3ForCausalLM"
    if c.qkv_bias and not c.bias:
        return "Qwen2ForCausalLM"
    if c.bias != c.qkv_bias:
        bad("bias/qkv_bias", (c.bias, c.qkv_bias), "LlamaForCausalLM")
    if kinds == {"sliding_attention"}:
        return "MistralForCausalLM"
    if kinds != {"full_attention"}:  # a mix of full and sliding layers: Qwen2's per-layer types
        bad("layer_types", sorted(kinds), "Llama or Mistral (every layer alike)")
    return "LlamaForCausalLM"


# The small-model training recipe's switches that change the function (zero_init_output, only an
# initialisation, does not): in words, with the field that sets each.
_RECIPE_FEATURES = (("value embeddings", "value_embeddings", lambda c: c.value_embeddings != "none"),
                    ("ReLU² MLPs", "mlp", lambda c: c.mlp == "relu2"),
                    ("soft-capped logits", "logit_softcap", lambda c: c.logit_softcap is not None),
                    ("parameter-free RMSNorm", "norm_affine", lambda c: not c.norm_affine))


def features_without_hf_class(config: ModelConfig) -> list[str]:
    """What `config` computes that no Hugging Face class logitlab writes can hold, one phrase per
    feature naming its field, e.g. "value embeddings (value_embeddings='alternate')" (a value
    embedding is a token table added to attention's values, for which Llama and Qwen have no
    weight); [] when there is none."""
    return [f"{words} ({name}={getattr(config, name)!r})" for words, name, on in _RECIPE_FEATURES if on(config)]


def listed(phrases: list[str]) -> str:
    """["a"] -> "a"; ["a", "b", "c"] -> "a, b and c"."""
    return phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} and {phrases[-1]}"


def _qwen3_5(c: ModelConfig, bad) -> str:
    """Qwen3.5's text model: zero-centred RMSNorm, QK-norm, an element-wise output gate, Gated
    DeltaNet and full attention layers, no biases."""
    arch = "Qwen3_5ForCausalLM"
    need = dict(norm_zero_centered=True, qk_norm=True, attn_gate="elementwise", bias=False, qkv_bias=False,
                positions="rope", norm="rmsnorm", mlp="swiglu")
    for field, value in need.items():
        if getattr(c, field) != value:
            bad(field, getattr(c, field), arch)
    if not set(c.layer_kinds) <= {"linear_attention", "full_attention"}:
        bad("layer_types", sorted(set(c.layer_kinds)), arch)
    return arch


def _moe(c: ModelConfig, bad) -> str:
    """An MoE family: its class from keymap_moe, and the dense features that class also needs."""
    arch = moe_architecture(c, bad)
    if arch == "Qwen3_5MoeForCausalLM":
        _qwen3_5(c, bad)
    elif c.positions != "rope" or c.norm != "rmsnorm" or c.partial_rotary_factor != 1.0 or c.norm_zero_centered:
        bad("positions/norm/partial_rotary_factor", (c.positions, c.norm, c.partial_rotary_factor), arch)
    elif c.attn_gate != "none" or (c.attn_sinks and arch != "GptOssForCausalLM"):
        bad("attn_gate/attn_sinks", (c.attn_gate, c.attn_sinks), arch)
    return arch


# Keys of buffers that old checkpoints carry and that hold no learned state.
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$"
                      r"|^(mtp|model\.visual|visual)\.")  # Qwen3.5: the multi-token head, the vision tower

_LLAMA_BLOCK = {  # Hugging Face suffix under model.layers.{i}. -> logitlab suffix under blocks.{i}.
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
    **{f"self_attn.{p}": f"attn.{p}" for p in ("o_proj", "q_norm", "k_norm")},
    "self_attn": "attn",                                                   # self_attn.sinks (gpt-oss)
    "mlp.down_proj": "mlp.down_proj",
}
# logitlab's fused projections and the Hugging Face (llama-layout) tensors they hold, in row order.
_LLAMA_FUSED = {"attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_LLAMA_PART = {part: (fused, j, len(parts)) for fused, parts in _LLAMA_FUSED.items() for j, part in enumerate(parts)}
_LLAMA_TOP = {"model.embed_tokens": "tok_emb", "model.norm": "final_norm", "lm_head": "lm_head"}
_GPT2_TOP = {"transformer.wte": "tok_emb", "transformer.wpe": "pos_emb", "transformer.ln_f": "final_norm",
             "lm_head": "lm_head"}
_GPT2_BLOCK = {"ln_1": "attn_norm", "ln_2": "mlp_norm", "attn.c_attn": "attn.qkv_proj",
               "attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_GPT2_CONV1D = ("c_attn", "c_proj", "c_fc")  # Conv1D weights are stored (in, out): transposed here


def hf_token_table(config: ModelConfig) -> str:
    """The cleaned Hugging Face name of the token embedding's table (model.embed_tokens.weight,
    transformer.wte.weight): the one tensor a forward pass reads only some rows of."""
    top = {v: k for k, v in (_GPT2_TOP if key_layout(config) == "gpt2" else _LLAMA_TOP).items()}
    return f"{top['tok_emb']}.weight"


def key_layout(config: ModelConfig) -> str:
    """"gpt2" or "llama": which Hugging Face naming scheme `config` uses (Qwen3.5 is llama's, with
    linear_attn.* tensors and the output gate's rows inside q_proj)."""
    return "gpt2" if hf_architecture(config) == "GPT2LMHeadModel" else "llama"


def _split_key(key: str) -> tuple[str, str]:
    module, _, leaf = key.rpartition(".")
    return module, leaf


def hf_key_to_logitlab(key: str, layout: str) -> str | None:
    """Name of one Hugging Face tensor in logitlab; None for a llama-layout q/k/v or gate/up
    tensor, which is one block of rows of a fused logitlab projection (see hf_tensors_to_logitlab).
    Unknown names raise ValueError naming the key."""
    module, leaf = _split_key(key)
    top, block_prefix, block = ((_GPT2_TOP, "transformer.h.", _GPT2_BLOCK) if layout == "gpt2"
                                else (_LLAMA_TOP, "model.layers.", _LLAMA_BLOCK))
    if module in top:
        return f"{top[module]}.{leaf}"
    m = re.fullmatch(re.escape(block_prefix) + r"(\d+)\.(.+)", module)
    if m and m.group(2) in block:
        return f"blocks.{m.group(1)}.{block[m.group(2)]}.{leaf}"
    if m and layout == "llama" and m.group(2) in _LLAMA_PART:
        return None
    if m and layout == "llama" and m.group(2).split(".")[0] == "linear_attn":   # Gated DeltaNet: same names
        return f"blocks.{m.group(1)}.{m.group(2)}.{leaf}"
    raise ValueError(f"unexpected tensor {key!r} in a {layout}-layout checkpoint")


def _normalise_prefix(state: dict, layout: str) -> dict:
    """Base-model checkpoints (GPT2Model, LlamaModel) omit the "transformer." / "model." prefix."""
    prefix = "transformer." if layout == "gpt2" else "model."
    if any(k.startswith(prefix) for k in state):
        return state
    return {(k if k.startswith("lm_head.") else prefix + k): v for k, v in state.items()}


# A block's tensors in every layout: transformer.h.{i}. (GPT-2), model.layers.{i}. (llama), the text
# model of an image-text checkpoint (model.language_model.layers.{i}.), or a base model's own names
_HF_LAYER = re.compile(r"(?:transformer\.h|model\.(?:language_model\.)?layers|h|layers)\.(\d+)\.")


def hf_layer_indices(names) -> set[int]:
    """The block indices i that the Hugging Face tensor names hold (any layout), from names alone:
    a loader checks the config's layer count against them before it builds anything."""
    return {int(m.group(1)) for m in map(_HF_LAYER.match, names) if m}


def check_layers(indices: set[int], n_layers: int, field: str, config_path, weights, kind: str = "layers") -> None:
    """ValueError naming the config's layer-count field and its value when the block indices the
    weights hold (`indices`) are not exactly 0 .. n_layers - 1: a count no tensor backs is refused
    before a model of that depth is built. kind="experts": the same for an MoE's expert count."""
    if indices == set(range(n_layers)):
        return
    held = sorted(indices)
    if not held:
        what = f"no {kind} at all"
    elif held == list(range(len(held))):
        what = f"{kind} 0..{len(held) - 1}{' only' if len(held) < n_layers else ''} ({len(held)} {kind})"
    else:
        shown = ", ".join(map(str, held[:5])) + (f", ... ({len(held)} in all)" if len(held) > 5 else "")
        what = f"the {kind} {shown}, which are not 0..{n_layers - 1}"
    raise ValueError(f"{config_path}: {field} = {n_layers}, but {weights} holds {what}")


def clean_hf_state(hf_state: dict, config: ModelConfig) -> dict:
    """The learned tensors of a Hugging Face checkpoint under their full names: buffers with no
    learned state dropped, a missing "transformer." / "model." prefix restored, and a tied
    lm_head (which some checkpoints store as a copy of the embedding) dropped."""
    layout = key_layout(config)
    # the text model of a Qwen3.5 image-text checkpoint lives under model.language_model.
    hf_state = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
                for k, v in hf_state.items()}
    state = _normalise_prefix({k: v for k, v in hf_state.items() if not _IGNORED.search(k)}, layout)
    if config.is_mla:                                   # DeepSeek's multi-token-prediction layer
        state = drop_mtp_layers(state, config.n_layers)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def hf_fused_pieces(key: str, config: ModelConfig) -> list[tuple[str, int, int, int, int]] | None:
    """Where the rows of a cleaned llama-layout q/k/v or gate/up tensor go: (logitlab name of a
    fused projection, its first row there, first and end row of the tensor, the projection's
    rows), one piece per run of rows, so a loader can read (or map) each straight into place; None
    for any other tensor and for latent attention's own q_proj. One piece per tensor but for
    Qwen3.5's gated q_proj, whose rows hold, head by head, Dh query rows then Dh gate rows: H
    pieces into qkv_proj's query rows and H into the output gate's gate_proj."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
    if m is None or m.group(2) not in _LLAMA_PART or key_layout(config) != "llama":
        return None
    fused, j, _ = _LLAMA_PART[m.group(2)]
    if fused == "attn.qkv_proj" and config.is_mla:
        return None                              # latent attention's own q_proj
    H, Hkv, Dh, F = config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff
    sizes = (H * Dh, Hkv * Dh, Hkv * Dh) if fused == "attn.qkv_proj" else (F, F)
    name, start = f"blocks.{m.group(1)}.{fused}.{m.group(3)}", sum(sizes[:j])
    if fused == "attn.qkv_proj" and j == 0 and config.attn_gate == "elementwise":
        gate = f"blocks.{m.group(1)}.attn.gate_proj.{m.group(3)}"
        return ([(name, h * Dh, 2 * h * Dh, (2 * h + 1) * Dh, sum(sizes)) for h in range(H)]
                + [(gate, h * Dh, (2 * h + 1) * Dh, (2 * h + 2) * Dh, H * Dh) for h in range(H)])
    return [(name, start, 0, sizes[j], sum(sizes))]


def hf_tensors_to_logitlab(items, config: ModelConfig):
    """(Hugging Face name, tensor) pairs, already cleaned (clean_hf_state), -> (logitlab name,
    tensor) pairs, one at a time, so a loader can read, convert and drop each tensor in turn.

    GPT-2 Conv1D weights are transposed (c_attn is qkv_proj's rows as they stand); llama-layout
    q/k/v and gate/up are held until their last part arrives and then joined into the fused
    projection (row order q, k, v and gate, up). A fused projection with a part missing at the
    end raises ValueError naming it."""
    import torch

    layout = key_layout(config)
    pending: dict[str, dict[int, object]] = {}  # fused logitlab name -> {part index: tensor}
    moe_pending: dict[str, dict] = {}           # an MoE layer's per-expert parts (keymap_moe)
    arch = hf_architecture(config) if config.is_moe else None
    for key, tensor in items:
        moe = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key) if arch else None
        if moe and is_moe_key(moe.group(2)):
            yield from moe_from_hf(moe.group(1), moe.group(2), tensor, config, arch, moe_pending)
            continue
        mla = mla_name_from_hf(key) if config.is_mla else None    # multi-head latent attention: a table
        if mla is not None:
            yield mla, tensor
            continue
        module, leaf = _split_key(key)
        name = hf_key_to_logitlab(key, layout)
        if name is None:  # llama layout: one part of qkv_proj or gate_up_proj
            i, sub = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module).groups()
            fused, j, n = _LLAMA_PART[sub]
            if sub == "self_attn.q_proj" and config.attn_gate == "elementwise":
                tensor, gate = _split_gated_q(tensor, config)
                yield f"blocks.{i}.attn.gate_proj.{leaf}", gate
            name = f"blocks.{i}.{fused}.{leaf}"
            parts = pending.setdefault(name, {})
            parts[j] = tensor
            if len(parts) == n:
                del pending[name]
                yield name, torch.cat([parts.pop(k) for k in range(n)], dim=0)
            continue
        conv1d = layout == "gpt2" and leaf == "weight" and module.rsplit(".", 1)[-1] in _GPT2_CONV1D
        yield name, (tensor.t().contiguous() if conv1d else tensor)
    if moe_pending:
        raise ValueError(f"checkpoint lacks expert tensors needed for {sorted(moe_pending)[0]!r}")
    if pending:
        name = sorted(pending)[0]                       # blocks.{i}.{fused}.{leaf}
        _, i, rest = name.split(".", 2)
        fused, leaf = rest.rsplit(".", 1)
        lacking = [f"model.layers.{i}.{part}.{leaf}" for j, part in enumerate(_LLAMA_FUSED[fused])
                   if j not in pending[name]]
        raise ValueError(f"checkpoint lacks {', '.join(map(repr, lacking))}, needed with the rest of "
                         f"{name!r}")


def _split_gated_q(tensor, config: ModelConfig):
    """Qwen3.5's q_proj rows hold, head by head, Dh query rows then Dh gate rows:
    (2*H*Dh, ...) -> (q rows (H*Dh, ...), gate rows (H*Dh, ...))."""
    H, Dh = config.n_heads, config.head_dim
    pairs = tensor.reshape(H, 2, Dh, *tensor.shape[1:])           # (H, [q, gate], Dh, ...)
    return (pairs[:, 0].reshape(H * Dh, *tensor.shape[1:]).contiguous(),
            pairs[:, 1].reshape(H * Dh, *tensor.shape[1:]).contiguous())


def _join_gated_q(q, gate, config: ModelConfig):
    """Inverse of _split_gated_q: q, gate (H*Dh, ...) -> Qwen3.5's q_proj (2*H*Dh, ...)."""
    import torch

    H, Dh = config.n_heads, config.head_dim
    rest = q.shape[1:]
    return torch.stack((q.reshape(H, Dh, *rest), gate.reshape(H, Dh, *rest)), dim=1).reshape(2 * H * Dh, *rest)


def state_dict_from_hf(hf_state: dict, config: ModelConfig) -> dict:
    """Hugging Face tensors -> logitlab state dict (GPT-2 Conv1D weights transposed, q/k/v and
    gate/up joined into the fused projections); see clean_hf_state for what is dropped."""
    return dict(hf_tensors_to_logitlab(clean_hf_state(hf_state, config).items(), config))


def state_dict_to_hf(state: dict, config: ModelConfig, expert_layout: str = "per_expert") -> dict:
    """logitlab state dict -> Hugging Face tensors; inverse of state_dict_from_hf. The vocabulary
    padding rows are cut off; a tied head is written once, as the embedding (lm_head omitted);
    the fused projections are split into llama-layout q/k/v and gate/up; an MoE layer's experts
    are written one tensor per expert, or with expert_layout="fused" stacked (keymap_moe.py)."""
    layout = key_layout(config)
    arch = hf_architecture(config) if config.is_moe else None
    V, Dh = config.vocab_size, config.head_dim
    fused_rows = {"attn.qkv_proj": (config.n_heads * Dh, config.n_kv_heads * Dh, config.n_kv_heads * Dh),
                  "mlp.gate_up_proj": (config.d_ff, config.d_ff)}
    inverse_top = {v: k for k, v in (_GPT2_TOP if layout == "gpt2" else _LLAMA_TOP).items()}
    inverse_block = {v: k for k, v in (_GPT2_BLOCK if layout == "gpt2" else _LLAMA_BLOCK).items()}
    block_prefix = "transformer.h." if layout == "gpt2" else "model.layers."
    out = {}
    for key, tensor in state.items():
        if key == "lm_head.weight" and config.tie_embeddings:
            continue
        module, leaf = _split_key(key)
        if module in ("tok_emb", "lm_head"):
            tensor = tensor[:V]
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
        if m is None:
            out[f"{inverse_top[module]}.{leaf}"] = tensor.contiguous()
            continue
        i, sub = m.groups()
        if arch and sub.startswith("mlp.") and config.mlp_kinds[int(i)] == "moe":
            moe = moe_to_hf(i, f"{sub[4:]}.{leaf}", tensor, config, arch, expert_layout)
            out.update({k: v.contiguous() for k, v in moe.items()})
            continue
        if sub == "attn.gate_proj":                                # joined into q_proj with the queries
            continue
        if config.is_mla and mla_name_to_hf(i, sub, leaf):
            out[mla_name_to_hf(i, sub, leaf)] = tensor.contiguous()
            continue
        if sub.split(".")[0] == "linear_attn":
            out[f"{block_prefix}{i}.{sub}.{leaf}"] = tensor.contiguous()
            continue
        if layout == "llama" and sub in _LLAMA_FUSED:
            for part, rows in zip(_LLAMA_FUSED[sub], tensor.split(fused_rows[sub], dim=0), strict=True):
                if part == "self_attn.q_proj" and config.attn_gate == "elementwise":
                    rows = _join_gated_q(rows, state[f"blocks.{i}.attn.gate_proj.{leaf}"], config)
                out[f"{block_prefix}{i}.{part}.{leaf}"] = rows.contiguous()
            continue
        if sub not in inverse_block:
            raise ValueError(f"logitlab tensor {key!r} has no Hugging Face {layout}-layout name")
        hf_module = inverse_block[sub]
        if layout == "gpt2" and leaf == "weight" and hf_module.rsplit(".", 1)[-1] in _GPT2_CONV1D:
            tensor = tensor.t()
        out[f"{block_prefix}{i}.{hf_module}.{leaf}"] = tensor.contiguous()
    return out
