"""Held against TransformerLens (`transformer-lens` from PyPI, a test-only reference): on a GPT-2-shaped
model with random weights, built offline from a local config, logitlab and TransformerLens' bridge
read the same activations at the corresponding hook points (the table in docs/interpretability.md),
and direct logit attribution and activation patching give the same numbers."""

from __future__ import annotations

import pytest
import torch

tl_bridge = pytest.importorskip("transformer_lens.model_bridge", reason="transformer-lens is not installed")
transformers = pytest.importorskip("transformers")

from logitlab.inspect.attribution import direct_logit_attribution  # noqa: E402
from logitlab.inspect.patching import activation_patching, logit_difference  # noqa: E402
from logitlab.model.hooks import run_with_cache  # noqa: E402

pytestmark = pytest.mark.slow                                      # TransformerLens' import alone takes seconds

V, L, H, Dh = 64, 2, 4, 8
PAIRS = {"embed": "hook_embed", "pos_embed": "hook_pos_embed", "resid_pre": "hook_resid_pre",
         "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post", "attn.q": "attn.hook_q",
         "attn.k": "attn.hook_k", "attn.v": "attn.hook_v", "attn.z": "attn.hook_z", "attn.pattern": "attn.hook_pattern",
         "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out", "mlp.pre": "mlp.hook_pre", "mlp.post": "mlp.hook_post"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(logitlab model, TransformerLens bridge, the bridge in compatibility mode), the same weights."""
    from logitlab.io.hf import load_pretrained

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=H * Dh, n_layer=L, n_head=H,
                                     bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():                                          # biases and norms away from their init
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln" in name:
                p.add_(torch.randn_like(p) * 0.2)
    d = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(d)
    ours = load_pretrained(d).eval()
    bridge = tl_bridge.TransformerBridge.boot_transformers(str(d), hf_model=hf)
    return ours, bridge


def ids(seed: int) -> torch.Tensor:
    return torch.randint(1, V, (1, 7), generator=torch.Generator().manual_seed(seed))


def test_activations_agree_at_the_corresponding_hook_points(models):
    ours, bridge = models
    x = ids(1)
    logits, c = run_with_cache(ours, x)
    tl_logits, tl = bridge.run_with_cache(x)
    torch.testing.assert_close(logits, tl_logits.detach(), rtol=1e-5, atol=1e-5)
    for local, theirs in PAIRS.items():
        for i in range(L):
            name = local if local in ("embed", "pos_embed") else f"blocks.{i}.{local}"
            other = theirs if local in ("embed", "pos_embed") else f"blocks.{i}.{theirs}"
            torch.testing.assert_close(c[name], tl[other].detach().reshape(c[name].shape), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(1 / c["final_norm.scale"], tl["ln_final.hook_scale"].detach(), rtol=1e-5, atol=1e-5)


def test_direct_logit_attribution_agrees(models):
    """TransformerLens' decompose_resid + apply_ln_to_stack + logit_attrs (the final norm's scale
    frozen, its weight applied to the unembedding) against ours, component by component."""
    ours, bridge = models
    x = ids(2)
    r = direct_logit_attribution(ours, x[0], 5, 9)
    _, cache = bridge.run_with_cache(x)
    stack, labels = cache.decompose_resid(layer=-1, return_labels=True, mode="all")
    stack = cache.apply_ln_to_stack(stack, layer=-1)[:, 0, -1]     # (C, D) at the last position: centred, / std
    w = ours.final_norm.weight.detach()
    u = (ours.lm_head.weight[5] - ours.lm_head.weight[9]).detach()
    theirs = (stack * w) @ u                                # their logit_attrs with the weight unfolded
    ours_parts = [v for k, v in r.parts.items() if k != "final_norm.bias"]
    assert len(labels) == len(ours_parts)
    torch.testing.assert_close(torch.tensor(ours_parts, dtype=torch.float32), theirs.detach(), rtol=1e-4, atol=1e-5)


def test_activation_patching_agrees(models):
    """A resid_pre sweep through TransformerLens' hooks (one forward per layer and position, its
    run_with_hooks) against activation_patching."""
    ours, bridge = models
    clean, corrupt = ids(3), ids(3).clone()
    corrupt[0, 2] = (corrupt[0, 2] + 7) % V
    metric = logit_difference(5, 9)
    mine = activation_patching(ours, clean[0], corrupt[0], metric, "blocks.*.resid_pre")
    _, clean_cache = bridge.run_with_cache(clean)
    m_clean, m_corrupt = float(metric(bridge(clean))), float(metric(bridge(corrupt)))
    theirs = torch.zeros(L, clean.shape[1], dtype=torch.float64)
    for layer in range(L):
        name = f"blocks.{layer}.hook_resid_pre"
        for pos in range(clean.shape[1]):
            def patch(act, hook, p=pos, n=name):
                act = act.clone()
                act[:, p] = clean_cache[n][:, p]
                return act
            with torch.no_grad():
                m = float(metric(bridge.run_with_hooks(corrupt, fwd_hooks=[(name, patch)])))
            theirs[layer, pos] = (m - m_corrupt) / (m_clean - m_corrupt)
    torch.testing.assert_close(mine.scores, theirs, rtol=1e-4, atol=1e-4)
