"""The config.json of public checkpoints, as published on the Hugging Face hub: facts, abridged to the
fields that decide the architecture (dropouts, `use_cache`, `transformers_version` and the like left
out). The parity tests (test_published_models.py) build each model with transformers from exactly
these values, but 2 layers, and docs/models.md lists the same ids.

Where the values were read: nothing here is downloaded by the tests. Each entry names its sources,
public repositories and pages that quote the file (most of them with the hub's raw URL,
https://huggingface.co/ORG/NAME/raw/main/config.json), and an entry was written only where two or
more sources agree on every field kept.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

BYTE_LEVEL = "byte-level BPE"
BYTE_LEVEL_NFC = "byte-level BPE, NFC normalizer"
SENTENCEPIECE = "SentencePiece-style BPE (byte fallback)"


@dataclass(frozen=True)
class Published:
    repo_id: str
    config: dict
    source: str
    tokenizer: str
    refused: str | None = None      # for a config logitlab cannot run: a regex of the error it gives
    tokenizer_note: str | None = None  # what logitlab does with this tokenizer, when not plain support
    fast: bool = False              # the parity check runs in the default test run (else: pytest -m slow)
    layers: tuple = field(default=())  # Qwen3.5: the 2 layer kinds checked (one of each)
    totals: tuple = field(default=())  # mixtures of experts: (total, active) parameters as published (30.5B / 3.3B)

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]


GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "bos_token_id": 50256,
        "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
        "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}

QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
             "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
             "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
             "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
             "use_sliding_window": False, "vocab_size": 151936}

QWEN3_5_08B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": True,
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "attention_bias": False, "attn_output_gate": True, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-06, "full_attention_interval": 4,
        "max_position_embeddings": 262144, "tie_word_embeddings": True, "eos_token_id": 248044,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
}

LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
              "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
              "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
              "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
              "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256}

MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
              "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
              "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000}

TINYLLAMA = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
             "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
             "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
             "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
             "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
             "vocab_size": 32000}

SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 0,
                "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
                "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
                "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9,
                "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16", "vocab_size": 49152}

QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151643,
              "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
              "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
              "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936}

# Not supported (the tests assert the error): mixtures of experts and Gemma 2
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 128,
                 "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "num_attention_heads": 32, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "attention_bias": False, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                 "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
                 "vocab_size": 151936}

MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
                "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_experts_per_tok": 2,
                "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                "vocab_size": 32000}

GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304, "head_dim": 256,
             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 8192,
             "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
             "vocab_size": 256000}

DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
               "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
               "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
               "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
               "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
               "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
               "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]},
               "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                       "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                       "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
               "topk_method": "noaux_tc", "tie_word_embeddings": False, "v_head_dim": 128, "vocab_size": 129280}

_QUOTED = "quoted with the hub's raw URL in several public repositories"
PUBLISHED = [
    Published("gpt2", GPT2, f"huggingface.co/openai-community/gpt2 config.json, {_QUOTED}", BYTE_LEVEL),
    Published("Qwen/Qwen3-0.6B", QWEN3_06B, f"huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json, {_QUOTED} "
              "(model-card dumps, a KV-cache course, config tables)", BYTE_LEVEL_NFC),
    Published("Qwen/Qwen3.5-0.8B", QWEN3_5_08B, "its config.json as two independent parsers' test fixtures quote "
              "it (text_config and rope_parameters identical in both)", BYTE_LEVEL_NFC,
              layers=("linear_attention", "full_attention")),
    Published("meta-llama/Llama-3.2-1B", LLAMA32_1B, "config.json of meta-llama/Llama-3.2-1B(-Instruct) as "
              "quoted in public model-block benchmarks and configs (commit 4e20de36 of the Instruct)", BYTE_LEVEL,
              tokenizer_note="its post-processor's <|begin_of_text|> is the tokenizer's BOS token: "
              "encode(text, add_bos=True) puts it first (tests/test_tokenizer_bos.py)"),
    Published("mistralai/Mistral-7B-v0.1", MISTRAL_7B, f"huggingface.co/mistralai/Mistral-7B-v0.1/resolve/main/"
              f"config.json, {_QUOTED}", SENTENCEPIECE),
    Published("TinyLlama/TinyLlama-1.1B-Chat-v1.0", TINYLLAMA, "config.json at revision fe8a4ea1 as pinned by a "
              "public verification script, and the same fields in others' fixtures", SENTENCEPIECE),
    Published("HuggingFaceTB/SmolLM2-135M", SMOLLM2_135M, "config.json as printed by transformers after "
              "from_pretrained and quoted in several reimplementations (max_position_embeddings 8192, "
              "rope_theta 100000)", BYTE_LEVEL + " (Digits pre-tokenizer)", fast=True,
              tokenizer_note="pattern gpt2_digits (Digits before ByteLevel); its vocabulary lacks 21 of the 256 "
              "byte tokens, which are dropped from the text as tokenizers drops them (tests/test_tokenizer_digits.py)"),
    Published("Qwen/Qwen2.5-0.5B", QWEN25_05B, f"huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json, {_QUOTED}",
              BYTE_LEVEL_NFC),
    Published("Qwen/Qwen3-30B-A3B", QWEN3_30B_A3B, "its config.json's architecture fields as quoted in public "
              "MoE test fixtures; context, RoPE base and norm epsilon as in the Qwen3 family's dense configs "
              "quoted above and in public serving-engine fixtures", BYTE_LEVEL_NFC,
              totals=(30_532_122_624, 3_353_032_704)),
    Published("mistralai/Mixtral-8x7B-v0.1", MIXTRAL_8X7B, "its config.json's architecture fields as quoted in "
              "public MoE test fixtures and benchmarks; context, RoPE base and epsilon as in its model card's "
              "config", SENTENCEPIECE, totals=(46_702_792_704, 12_879_925_248)),
    Published("deepseek-ai/DeepSeek-V3", DEEPSEEK_V3, "its config.json's fields as quoted in public repositories "
              "(annotated parameter listings, the weights' own documentation of the FP8 quantization_config); "
              "without that quantization_config it is the deepseek-v3 preset (tests/test_mla_hf.py)",
              BYTE_LEVEL + " (several Split steps)",
              refused=r"quantized \(quantization_config\.quant_method='fp8'\).*dequantize them first"),
    Published("google/gemma-2-2b", GEMMA2_2B, "its config.json's fields as quoted in public parsers' fixtures "
              "(hidden 2304, 8 / 4 heads, soft-capping 50 / 30)", SENTENCEPIECE,
              refused=r"unsupported architecture 'Gemma2ForCausalLM'"),
]
BY_ID = {p.repo_id: p for p in PUBLISHED}


def published_config(repo_id: str) -> dict:
    """A fresh copy of the published config.json of `repo_id`."""
    return copy.deepcopy(BY_ID[repo_id].config)


def two_layer_config(repo_id: str) -> dict:
    """The published config.json with 2 layers and every other field as published (Qwen3.5: its
    text_config with one Gated DeltaNet and one full-attention layer, so both kinds are checked; a
    mixture of experts: every width as published, but one expert more than a token uses, so the
    router still chooses and the model fits in memory)."""
    config = published_config(repo_id)
    if "n_layer" in config:
        config["n_layer"] = 2
    elif "text_config" in config:
        text = config["text_config"]
        text["num_hidden_layers"], text["layer_types"] = 2, list(BY_ID[repo_id].layers)
    else:
        config["num_hidden_layers"] = 2
    for experts in ("num_experts", "num_local_experts"):   # a mixture of experts: one more than a token uses
        if experts in config:
            config[experts] = config["num_experts_per_tok"] + 1
    return config
