"""LoRA: a fresh adapter changes nothing, merged equals adapted, unmerge restores, only adapters
train; PEFT loads our adapters on the exported model with the same logits, and ours load PEFT's;
and the tying question: an adapter on a tied head reaches one side only, so apply_lora unties."""

from __future__ import annotations

import pytest
import torch

from logitlab.io.hf import save_pretrained
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer
from logitlab.train.lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    base_model,
    lora_state_dict,
    merge_lora,
    merged_model,
    unmerge_lora,
)
from logitlab.train.lora_peft import load_peft_adapter, save_peft_adapter
from logitlab.train.optim import build_adamw


def tiny(pad: int = 1, tie: bool = True, n_kv_heads: int = 1) -> Transformer:
    cfg = ModelConfig(vocab_size=96, context_length=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=n_kv_heads,
                      d_ff=48, positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=tie,
                      vocab_pad_multiple=pad)
    return Transformer(cfg).eval()


def randomize_b(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


IDS = torch.tensor([[1, 5, 9, 33, 2, 70, 11, 4]])


def test_wrap_merge_unmerge_and_only_adapters_train():
    model = tiny(pad=64)
    with torch.no_grad():
        base = model(IDS)
    names = apply_lora(model, LoRAConfig(r=4, alpha=8, targets="q_proj,v_proj,up_proj,down_proj"))
    assert names == [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv_proj", "mlp.down_proj",
                                                                    "mlp.gate_up_proj")]
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), base, rtol=0, atol=0)           # B = 0: nothing changes yet
    randomize_b(model)
    with torch.no_grad():
        adapted = model(IDS)
        assert (adapted - base).abs().max() > 1e-3
        merged = merged_model(model)(IDS)
        merge_lora(model)
        torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
        unmerge_lora(model)
        torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=1e-5)
    qkv = model.blocks[0].attn.qkv_proj
    assert isinstance(qkv, LoRALinear) and set(qkv.lora_A) == {"q_proj", "v_proj"}
    assert qkv.lora_B["q_proj"].shape == (32, 4) and qkv.lora_B["v_proj"].shape == (16, 4)
    trained = {id(p) for g in build_adamw(model, 1e-3).param_groups for p in g["params"]}
    assert trained == {id(p) for k, p in model.named_parameters() if ".lora_" in k}
    assert set(lora_state_dict(model)) == {k for k, _ in model.named_parameters() if ".lora_" in k}
    # the k rows of the fused projection are left alone
    delta = qkv.delta_weight()
    assert delta[32:48].abs().max() == 0 and delta[:32].abs().max() > 0


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="not among"):
        LoRAConfig(targets=("qkv",))
    with pytest.raises(ValueError, match="rank r"):
        LoRAConfig(r=0)
    with pytest.raises(ValueError, match="unpadded vocabulary"):
        apply_lora(tiny(pad=64), LoRAConfig(targets=("lm_head",)))


def test_tying_does_not_survive_a_lora_on_the_head():
    # Wrapped by hand on a tied model: the update reaches the head only, and merging it writes
    # into the shared Parameter, so the embedding changes too.
    model = tiny()
    emb = model.tok_emb.weight.detach().clone()
    model.lm_head = LoRALinear(model.lm_head, [("lm_head", 0, 96)], r=2, scaling=1.0)
    randomize_b(model)
    assert model.lm_head.weight is model.tok_emb.weight          # the Parameter is still shared...
    effective_head = model.lm_head.weight + model.lm_head.delta_weight()
    assert not torch.equal(effective_head, model.tok_emb.weight)  # ...but the head the model uses is not it
    model.lm_head.merge()
    assert not torch.equal(model.tok_emb.weight, emb)             # merging changed the embedding as well
    # apply_lora unties first (or refuses), so the embedding is never touched
    with pytest.raises(ValueError, match="tied"):
        apply_lora(tiny(), LoRAConfig(targets=("lm_head",), tie="refuse"))
    model = tiny()
    emb = model.tok_emb.weight.detach().clone()
    with torch.no_grad():
        before = model(IDS)
    apply_lora(model, LoRAConfig(r=2, targets=("lm_head", "q_proj")))
    assert not model.config.tie_embeddings and model.lm_head.weight is not model.tok_emb.weight
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), before, rtol=0, atol=0)
    randomize_b(model)
    merge_lora(model)
    assert torch.equal(model.tok_emb.weight, emb)


@pytest.fixture
def peft():
    return pytest.importorskip("peft")


def _hf_logits(base_dir, adapter_dir):
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    with torch.no_grad():
        return hf(input_ids=IDS).logits, hf


@pytest.mark.parametrize("targets", ["q_proj,k_proj,v_proj,o_proj", "all-linear", "v_proj,lm_head"])
def test_peft_loads_our_adapters_with_the_same_logits(tmp_path, peft, targets):
    model = tiny(n_kv_heads=2 if targets == "all-linear" else 1)
    apply_lora(model, LoRAConfig(r=4, alpha=12, targets=targets, rslora=targets == "all-linear"))
    randomize_b(model)
    with torch.no_grad():
        ours = model(IDS)
    plain = base_model(model)  # the adapted model with its adapters taken off, as exported
    save_pretrained(plain, tmp_path / "base")
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    theirs, _ = _hf_logits(tmp_path / "base", tmp_path / "adapter")
    torch.testing.assert_close(theirs[..., :96], ours, atol=1e-4, rtol=1e-4)


def test_a_peft_adapter_trained_elsewhere_loads_onto_logitlab(tmp_path, peft):
    import transformers

    model = tiny()
    save_pretrained(model, tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"],
                             init_lora_weights=False)
    hf = peft.get_peft_model(hf, config).eval()
    hf.save_pretrained(str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = hf(input_ids=IDS).logits
    names = load_peft_adapter(model, tmp_path / "adapter")
    assert "blocks.0.attn.qkv_proj" in names
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), theirs[..., :96], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_trainable_token_rows_move_only_those_rows(tie):
    model = tiny(pad=64, tie=tie)
    apply_lora(model, LoRAConfig(r=2, targets=("v_proj",)))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    from logitlab.train.lora import train_token_rows

    handle = train_token_rows(model, [4, 5])  # both in IDS: looked up and scored
    # AdamW decays matrices: the embedding never (decay_embeddings False), an untied head unless wd = 0
    opt = build_adamw(model, 1e-2, weight_decay=0.1 if tie else 0.0)
    for _ in range(3):
        model(IDS).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for key in ("tok_emb.weight", "lm_head.weight"):
        moved = (after[key] - before[key]).abs().sum(1) > 0
        assert moved.nonzero().flatten().tolist() == [4, 5], key
    key = "blocks.0.attn.qkv_proj.lora_A.v_proj"
    assert not torch.equal(after[key], before[key])
    handle.remove()
    with pytest.raises(ValueError, match="token rows"):
        train_token_rows(model, [96])


def test_shared_tie_adapts_both_sides_and_stays_tied():
    model = tiny()
    apply_lora(model, LoRAConfig(r=2, targets=("lm_head",), tie="shared"))
    assert model.config.tie_embeddings and model.lm_head.weight is model.tok_emb.weight
    randomize_b(model)
    head = model.lm_head
    effective = head.weight + head.delta_weight()                          # (V, D), what the head uses
    with torch.no_grad():
        looked_up = model.tok_emb(IDS)
        torch.testing.assert_close(looked_up[0], effective[IDS[0]], atol=1e-6, rtol=1e-6)
        adapted = model(IDS)
        torch.testing.assert_close(merged_model(model)(IDS), adapted, atol=1e-5, rtol=1e-5)
        merge_lora(model)
        torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=1e-5)
    # gradients reach the one adapter from both uses
    unmerge_lora(model)
    model(IDS).float().logsumexp(-1).mean().backward()
    grad_both = head.lora_B["lm_head"].grad.clone()
    assert grad_both[IDS[0]].abs().sum() > 0
    with pytest.raises(ValueError, match="no PEFT form"):
        save_peft_adapter(model, "unused")
