"""What a config costs before anything is built, and whether this machine has it.

memory.py owns the arithmetic a loader runs before it builds a single module: the exact parameter
count of a ModelConfig from its numbers alone (`parameter_terms`, equal to
accounting.count_parameters, which builds the model on the meta device; the tests check the two
against each other), the bytes of its weights in a dtype, the memory the machine has available
(`available_memory`: Linux's /proc/meminfo and the cgroup's limit, else os.sysconf; a CUDA device's
free memory), sizes as people write them (`parse_size`: "8GB", "512MiB"), and the refusal
(`check_fits`) that names the field that drives the size, its value, the estimate and what would
fit. A million-layer config is refused in microseconds: nothing here iterates over layers.

Shapes: V_padded vocabulary rows, D d_model, H / Hkv heads, Dh head_dim, F d_ff, L layers.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from logitlab.model.config import ModelConfig

GB = 10**9


def _norm(config: ModelConfig, dim: int) -> int:
    if not config.norm_affine:                                     # a parameter-free RMSNorm
        return 0
    return 2 * dim if config.norm == "layernorm" else dim         # LayerNorm: weight and bias


def attention_layer_parameters(config: ModelConfig) -> int:
    """One full or sliding attention mixer: qkv_proj, o_proj, QK-norms, output gate, sinks."""
    c = config
    if c.is_mla:    # latent attention: its projections and the norms of its two latents (accounting_mla)
        from logitlab.model.accounting_mla import attention_formula

        return attention_formula(c) + _norm(c, c.kv_lora_rank) + (_norm(c, c.q_lora_rank) if c.q_lora_rank else 0)
    D, H, Hkv, Dh = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    qkv = (H + 2 * Hkv) * Dh
    gates = {"none": 0, "headwise": H, "elementwise": H * Dh}[c.attn_gate]
    qk_norms = 2 * Dh if c.qk_norm and c.norm_affine else 0       # two RMSNorms, parameter-free or not
    return (D * qkv + (qkv if c.qkv_bias else 0) + H * Dh * D + (D if c.bias else 0)
            + qk_norms + D * gates + (gates if c.qkv_bias else 0) + (H if c.attn_sinks else 0))


def linear_layer_parameters(config: ModelConfig) -> int:
    """One Gated DeltaNet mixer: in_proj_qkv (C x D, C = 2·Hk·Dk + Hv·Dv), in_proj_z, in_proj_b,
    in_proj_a, the depthwise conv (C x K), dt_bias, A_log, the gated norm (Dv) and out_proj."""
    c = config
    D, Hv, Dv = c.d_model, c.linear_n_v_heads, c.linear_v_head_dim
    channels = 2 * c.linear_n_k_heads * c.linear_k_head_dim + Hv * Dv
    return D * channels + D * Hv * Dv + 2 * D * Hv + channels * c.linear_conv_kernel + 2 * Hv + Dv + Hv * Dv * D


def mlp_parameters(config: ModelConfig) -> int:
    """SwiGLU: gate_up (2F x D) and down (D x F); GELU: up (F x D) and down; biases when `bias`."""
    c = config
    up = (2 if c.mlp == "swiglu" else 1) * c.d_ff
    return c.d_model * up + c.d_ff * c.d_model + ((up + c.d_model) if c.bias else 0)


def moe_parameters(config: ModelConfig) -> int:
    """One mixture-of-experts MLP: the router (E x D, its bias), E experts of width Fe stacked
    (gate_up E x 2Fe x D, down E x D x Fe, their biases), a shared SwiGLU of width Fs and its gate."""
    c = config
    D, E, Fe, Fs = c.d_model, c.n_experts, c.moe_d_ff, c.shared_expert_d_ff
    router = E * D + (E if c.router_bias else 0)
    experts = E * 3 * D * Fe + (E * (2 * Fe + D) if c.expert_bias else 0)
    shared = (3 * D * Fs + ((2 * Fs + D) if c.bias else 0)) if Fs else 0
    return router + experts + shared + (D if c.shared_expert_gate else 0)


def parameter_terms(config: ModelConfig) -> dict[str, int]:
    """Parameters by the field that drives them, from the numbers alone (no module is built):
    "vocab_size" the embedding table and an untied LM head (V_padded x D each), "context_length"
    learned positions (context x D), "n_layers" every block (mixer, MLP, both norms, a value embedding),
    "final_norm". Their sum is accounting.count_parameters(config).total exactly."""
    c = config
    kinds = c.layer_kinds
    n_linear = kinds.count("linear_attention")
    n_moe = c.mlp_kinds.count("moe")
    # value embeddings: a (V_padded x Hkv·Dh) table and Hkv gates on every attention layer ("all"),
    # or on every other one counted back from the last ("alternate"); counted with the layers
    attention = [kind != "linear_attention" for kind in kinds[::-1]]
    n_value = {"none": 0, "all": sum(attention), "alternate": sum(attention[::2])}[c.value_embeddings]
    values = n_value * (c.padded_vocab_size * c.n_kv_heads * c.head_dim + c.n_kv_heads)
    layers = (c.n_layers * 2 * _norm(c, c.d_model) + (c.n_layers - n_moe) * mlp_parameters(c)
              + (n_moe * moe_parameters(c) if n_moe else 0)
              + (c.n_layers - n_linear) * attention_layer_parameters(c) + n_linear * linear_layer_parameters(c)
              + values)
    return {"vocab_size": c.padded_vocab_size * c.d_model * (1 if c.tie_embeddings else 2),
            "context_length": c.context_length * c.d_model if c.positions == "learned" else 0,
            "n_layers": layers, "final_norm": _norm(c, c.d_model)}


def parameter_count(config: ModelConfig) -> int:
    """The exact number of parameters (a tied head counted once), arithmetically."""
    return sum(parameter_terms(config).values())


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------

def available_memory(device="cpu") -> int | None:
    """Bytes a new allocation can still get on `device`, or None when unknown. CPU: MemAvailable
    of /proc/meminfo (memory free now plus what the kernel can reclaim), lowered to what this
    process's cgroup (a container's limit, memory.max - memory.current) leaves; elsewhere
    os.sysconf's free physical pages. CUDA: torch.cuda.mem_get_info's free bytes."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0]) if torch.cuda.is_available() else None
    if kind != "cpu":
        return None
    found = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    if found:
        return min(found)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None when it has no limit."""
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
        group = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError, StopIteration):
        return None


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(value, name: str = "max_memory") -> int:
    """Bytes from a size as people write it: an integer of bytes, or a number and a unit, "8GB"
    (10**9), "8GiB" or "8G" (2**30), "512MB", "1.5TiB". ValueError naming `name` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?i?b?)\s*", value, re.I) if isinstance(value, str) else None
    if found and found.group(2).lower() in _UNITS and float(found.group(1)) > 0:
        return int(float(found.group(1)) * _UNITS[found.group(2).lower()])
    raise ValueError(f"{name}: expected a size such as 8GB, 512MiB or a number of bytes, got {value!r}")


def format_bytes(n: float) -> str:
    """'7.50 GB', '312 MB', '4.1 TB' (powers of 1000, as parse_size's GB)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            value = n / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------------------------
# The refusal
# --------------------------------------------------------------------------------------------

def check_fits(config: ModelConfig, itemsize: int, *, dtype: str, source: str = "config.json",
               names: dict[str, str] | None = None, max_memory=None, device="cpu", need: int | None = None) -> int:
    """The weights' bytes in `dtype` (`itemsize` bytes a value), when they fit in `max_memory`
    (parse_size; default: available_memory(device); no check when that is unknown). Otherwise a
    ValueError naming `source`, the field that drives the size with its value (`names` maps
    ModelConfig fields to the file's own keys, e.g. n_layers -> num_hidden_layers), the estimate,
    the memory there is, and what would fit (the model in bf16). `need`: the bytes when the caller
    counts them better than the config's numbers do (a quantized model's int8 / int4 layers); the
    terms of the message are then scaled to it."""
    budget = parse_size(max_memory) if max_memory is not None else available_memory(device)
    terms = parameter_terms(config)
    estimated = need is None
    need = sum(terms.values()) * itemsize if estimated else need
    if budget is None or need <= budget:
        return need
    where = "allowed by max_memory" if max_memory is not None else "available on this machine"
    fit = ""
    if itemsize > 2 and estimated:
        half = sum(terms.values()) * 2
        fit = f"; in bf16 it would take {format_bytes(half)}" + (
            " (load with dtype='bf16', --dtype bf16)" if half <= budget else ", which does not fit either")
    per_value = need / max(1, sum(terms.values()))         # bytes a parameter, on average
    raise ValueError(f"{source}: the model's weights need about {format_bytes(need)} in {dtype}, but "
                     f"{format_bytes(budget)} is {where}: {_driver(config, terms, per_value, names or {})}{fit}. "
                     "To load it anyway, give max_memory (--max-memory SIZE, e.g. 64GB)")


def _driver(config: ModelConfig, terms: dict[str, int], itemsize: float, names: dict[str, str]) -> str:
    """The largest term in words, with the fields (as the file names them) and values behind it."""
    def field(name: str) -> str:
        return f"{names.get(name, name)} = {getattr(config, name)}"

    c, size = config, lambda n: format_bytes(n * itemsize)  # noqa: E731
    biggest = max(("vocab_size", "context_length", "n_layers"), key=terms.get)
    if biggest == "vocab_size":
        tables = "embedding table" if c.tie_embeddings else "embedding table and LM head"
        return f"{field('vocab_size')} x {field('d_model')} makes the {tables} {size(terms['vocab_size'])}"
    if biggest == "context_length":
        return (f"{field('context_length')} x {field('d_model')} makes the learned position table "
                f"{size(terms['context_length'])}")
    per_layer = math.ceil(terms["n_layers"] / c.n_layers)
    widths = f"{field('n_experts')}, {field('moe_d_ff')}" if c.is_moe else field("d_ff")
    return (f"{field('n_layers')} layers of {size(per_layer)} each ({field('d_model')}, "
            f"{widths}, {field('n_heads')})")
