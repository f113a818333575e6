"""The bounds of every size a model config may hold (config.py checks them first).

limits.py owns one table: SIZE_LIMITS, far above any published model, so that a config read from
an untrusted file is refused by name before anything is built or allocated.
"""

from __future__ import annotations

# Upper bounds of every size a config may hold, far above any published model (the largest have
# vocabularies of 262,144, contexts of 10M positions, widths of 16,384 and 126 layers). A config read
# from an untrusted file is refused by these before anything is built or allocated; what a config
# within them costs is then estimated (model/memory.py) against the memory the machine has.
SIZE_LIMITS = {"vocab_size": 2**24, "context_length": 2**24, "d_model": 2**17, "n_layers": 10_000, "n_heads": 2**12,
               "n_kv_heads": 2**12, "head_dim": 2**17, "d_ff": 2**20, "vocab_pad_multiple": 2**16, "moe_d_ff": 2**20,
               "sliding_window": 2**24, "linear_n_k_heads": 2**12, "linear_n_v_heads": 2**12, "n_experts": 2**14,
               "linear_k_head_dim": 2**17, "linear_v_head_dim": 2**17, "linear_conv_kernel": 2**12,
               "original_context_length": 2**24, "n_experts_per_token": 2**14, "shared_expert_d_ff": 2**20,
               "kv_lora_rank": 2**17, "q_lora_rank": 2**17, "qk_rope_head_dim": 2**17, "qk_nope_head_dim": 2**17,
               "v_head_dim": 2**17, "n_expert_groups": 2**14, "topk_groups": 2**14}


def check_size_limits(config, prefix: str = "") -> None:
    """ValueError naming the first field of `config` whose integer value passes SIZE_LIMITS."""
    for name, limit in SIZE_LIMITS.items():
        value = getattr(config, name, None)
        if isinstance(value, int) and value > limit:
            raise ValueError(f"{prefix}{name} = {value} is beyond logitlab's bound of {limit} (far above any "
                             "published model); refused before anything is allocated")
