"""LoRA on mixture-of-experts models: attention projections as for dense models, the experts'
stacked tensors per expert (train/lora_moe.py), merge / unmerge, and PEFT round trips both ways
with transformers' Qwen3-MoE (PEFT's target_parameters for the experts)."""

from __future__ import annotations

import pytest
import torch

from logitlab.io.hf import load_pretrained
from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.train.lora import LoRAConfig, apply_lora, base_model, merge_lora, merged_model, unmerge_lora
from logitlab.train.lora_moe import LoRAExperts
from logitlab.train.lora_peft import load_peft_adapter, save_peft_adapter

V = 97
IDS = torch.tensor([[1, 5, 9, 33, 2, 70, 11, 4, 60, 13]])


def tiny_moe(mlp_types=None) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40,
                      positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False,
                      n_experts=4, n_experts_per_token=2, moe_d_ff=16, mlp_types=mlp_types)
    return Transformer(cfg).eval()


def randomize_b(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def test_experts_adapters_start_at_zero_merge_and_only_adapters_train():
    model = tiny_moe(mlp_types=("dense", "moe"))
    with torch.no_grad():
        base = model(IDS)
    names = apply_lora(model, LoRAConfig(r=2, alpha=6, targets="q_proj,down_proj,experts.gate_up_proj,"
                                                                  "experts.down_proj"))
    assert names == ["blocks.0.attn.qkv_proj", "blocks.0.mlp.down_proj", "blocks.1.attn.qkv_proj",
                     "blocks.1.mlp.experts"]                              # down_proj: the dense layer only
    experts = model.blocks[1].mlp.experts
    assert isinstance(experts, LoRAExperts) and experts.lora_A["gate_up_proj"].shape == (4, 2, 32)
    assert experts.lora_B["down_proj"].shape == (4, 32, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), base, rtol=0, atol=0)
    randomize_b(model)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_" in n for n in trainable)
    with torch.no_grad():
        adapted = model(IDS)
        assert (adapted - base).abs().max() > 1e-3
        for impl in ("loop", "gather"):                                  # every form reads stacked()
            model.blocks[1].mlp.impl = impl
            torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=1e-5)
        model.blocks[1].mlp.impl = "grouped"
        torch.testing.assert_close(merged_model(model)(IDS), adapted, atol=1e-5, rtol=1e-5)
        merge_lora(model)
        torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(base_model(model)(IDS), base, atol=1e-5, rtol=1e-5)
        unmerge_lora(model)
        torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=1e-5)
    loss = model(IDS).float().logsumexp(-1).mean()
    loss.backward()
    assert experts.lora_A["gate_up_proj"].grad.abs().sum() > 0 and experts.gate_up_proj.grad is None


def test_bad_moe_targets_are_named():
    with pytest.raises(ValueError, match="every layer of this model is a mixture of experts"):
        apply_lora(tiny_moe(), LoRAConfig(targets="gate_proj"))
    with pytest.raises(ValueError, match="need a mixture of experts"):
        apply_lora(Transformer(ModelConfig(vocab_size=V, context_length=16, d_model=32, n_heads=4, n_layers=1)),
                   LoRAConfig(targets="experts.down_proj"))
    with pytest.raises(ValueError, match="dropout"):
        apply_lora(tiny_moe(), LoRAConfig(targets="experts.down_proj", dropout=0.1))
    with pytest.raises(ValueError, match="not among"):
        LoRAConfig(targets="experts.up_proj")
    apply_lora(tiny_moe(), LoRAConfig(targets="all-linear"))   # attention only: nothing dense to adapt


def _qwen3_moe(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "base")
    return transformers, load_pretrained(tmp_path / "base").eval()


def _peft_logits(transformers, peft, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        return hf(input_ids=IDS).logits


@pytest.mark.parametrize("targets", ["q_proj,v_proj,experts.gate_up_proj,experts.down_proj",
                                     "o_proj,experts.down_proj"])
def test_peft_loads_our_moe_adapters_with_the_same_logits(tmp_path, targets):
    peft = pytest.importorskip("peft")
    transformers, model = _qwen3_moe(tmp_path)
    with torch.no_grad():
        plain = model(IDS)
    apply_lora(model, LoRAConfig(r=3, alpha=6, targets=targets))
    randomize_b(model)
    with torch.no_grad():
        ours = model(IDS)
    assert (ours - plain).abs().max() > 1e-3
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    torch.testing.assert_close(_peft_logits(transformers, peft, tmp_path), ours, atol=1e-4, rtol=1e-4)


def test_a_peft_moe_adapter_trained_elsewhere_loads_onto_logitlab(tmp_path):
    peft = pytest.importorskip("peft")
    transformers, model = _qwen3_moe(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["k_proj"], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    hf = peft.get_peft_model(hf, config).eval()
    hf.save_pretrained(str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = hf(input_ids=IDS).logits
        plain = model(IDS)
    names = load_peft_adapter(model, tmp_path / "adapter")
    assert "blocks.0.mlp.experts" in names and "blocks.1.attn.qkv_proj" in names
    with torch.no_grad():
        assert (model(IDS) - plain).abs().max() > 1e-3
        torch.testing.assert_close(model(IDS), theirs, atol=1e-4, rtol=1e-4)
