"""The training recipe's model options, each a typed ModelConfig field off by default: ReLU² MLPs,
logit soft-capping, value embeddings, zero-initialised output projections, parameter-free RMSNorm;
their parameter accounting and their refusal where a Hugging Face checkpoint cannot hold them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from logitlab.model import accounting as acc
from logitlab.model.cache import KVCache
from logitlab.model.keymap import hf_architecture
from logitlab.model.transformer import ModelConfig, Transformer

BASE = dict(vocab_size=61, context_length=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, norm="rmsnorm",
            positions="rope", mlp="swiglu", bias=False, tie_embeddings=False, vocab_pad_multiple=8)


def _model(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**BASE, **kw}))


def _ids(B: int = 2, T: int = 16) -> torch.Tensor:
    return torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(5))


def test_every_recipe_option_is_off_by_default():
    c = ModelConfig()
    assert (c.mlp, c.logit_softcap, c.value_embeddings, c.zero_init_output, c.norm_affine) == \
        ("gelu", None, "none", False, True)
    assert set(_model().state_dict()) == set(_model(zero_init_output=False).state_dict())


def test_relu2_mlp_is_relu_squared_with_gelus_keys():
    model = _model(mlp="relu2", d_ff=None)
    assert model.config.d_ff == 4 * 32                                    # 4·D, as GELU
    mlp = model.blocks[0].mlp
    assert {k for k in model.state_dict() if k.startswith("blocks.0.mlp.")} == \
        {"blocks.0.mlp.up_proj.weight", "blocks.0.mlp.down_proj.weight"}
    x = torch.randn(2, 5, 32)
    expected = F.linear(torch.clamp(F.linear(x, mlp.up_proj.weight), min=0) ** 2, mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), expected)


def test_logit_softcap_is_c_tanh_of_the_uncapped_logits_and_adds_no_parameter():
    plain, capped = _model(), _model(logit_softcap=2.0)
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        plain.lm_head.weight.mul_(30.0)                                     # logits beyond the cap
        capped.lm_head.weight.mul_(30.0)
    z, y = plain(_ids()), capped(_ids())
    torch.testing.assert_close(y, 2.0 * torch.tanh(z / 2.0))
    assert float(y.abs().max()) <= 2.0 < float(z.abs().max())
    assert acc.count_parameters(capped.config).total == acc.count_parameters(plain.config).total
    with pytest.raises(ValueError, match="logit_softcap must be > 0"):
        ModelConfig(**{**BASE, "logit_softcap": 0.0})


@pytest.mark.parametrize("kind, layers", [("all", (0, 1, 2)), ("alternate", (0, 2))])
def test_value_embeddings_layers_keys_and_accounting(kind, layers):
    model = _model(value_embeddings=kind)
    assert model.config.value_embedding_layers == layers                   # alternate: the last layer has one
    keys = {k for k in model.state_dict() if k.startswith("value_embeds.")}
    assert keys == {f"value_embeds.{i}.{n}" for i in layers for n in ("embed.weight", "gate")}
    assert model.value_embeds["0"].embed.weight.shape == (64, 2 * 8)      # (V_padded, Hkv*Dh)
    count = acc.count_parameters(model)
    assert count.value_embeddings == len(layers) * (64 * 16 + 2)
    assert count.total == sum(p.numel() for p in model.parameters())
    formula = acc.formula_count(model.config)
    assert count.total == formula.total + sum(acc.explain_difference(model.config, count).values())
    assert acc.explain_difference(model.config, count)["value-embedding gates"] == 2 * len(layers)


def test_value_embeddings_add_the_gated_table_to_the_values():
    """With every table at zero the model is the one without value embeddings; a gate g scales its
    layer's table by 2·sigmoid(g) (1 at the zero init)."""
    plain, ve = _model(), _model(value_embeddings="all")
    ve.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        for table in ve.value_embeds.values():
            table.embed.weight.zero_()
    torch.testing.assert_close(ve(_ids()), plain(_ids()))
    table = ve.value_embeds["1"]
    ids = _ids()
    with torch.no_grad():
        table.embed.weight.normal_()
        table.gate.fill_(math.log(3.0))                                    # 2·sigmoid(log 3) = 1.5
    got = table(ids)                                                        # (B, Hkv, T, Dh)
    expected = 1.5 * table.embed.weight[ids].view(2, 16, 2, 8).transpose(1, 2)
    torch.testing.assert_close(got, expected)
    assert float((ve(ids) - plain(ids)).abs().max()) > 1e-3                # layer 1's values moved


def test_value_embeddings_decode_with_a_cache_equals_the_full_forward():
    model = _model(value_embeddings="alternate").eval()
    with torch.no_grad():
        for table in model.value_embeds.values():
            table.gate.fill_(0.7)
    ids = _ids(2, 12)
    full = model(ids)
    cache = KVCache(n_layers=3, batch_size=2, n_kv_heads=2, max_len=16, head_dim=8)
    steps = [model(ids[:, :8], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_value_embeddings_under_bf16_autocast_keep_the_values_dtype():
    model = _model(value_embeddings="all")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(_ids())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_zero_init_output_makes_every_block_the_identity():
    model = _model(zero_init_output=True, tie_embeddings=True)
    assert all(float(b.attn.o_proj.weight.abs().max()) == 0 and float(b.mlp.down_proj.weight.abs().max()) == 0
               for b in model.blocks)
    assert float(model.blocks[0].attn.qkv_proj.weight.std()) > 0.01       # the rest as before
    ids = _ids()
    torch.testing.assert_close(model(ids), model.unembed(model.tok_emb(ids)))


def test_parameter_free_rmsnorm_has_no_weights_and_normalises():
    model = _model(norm_affine=False, qk_norm=True)
    assert not [k for k in model.state_dict() if "norm" in k]
    x = torch.randn(3, 32) * 5
    torch.testing.assert_close(model.final_norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(_ids()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="norm_affine=False .* needs norm='rmsnorm'"):
        ModelConfig(**{**BASE, "norm": "layernorm", "norm_affine": False})
    assert acc.count_parameters(model).norms == 0


@pytest.mark.parametrize("field, value", [("mlp", "relu2"), ("logit_softcap", 15.0),
                                          ("value_embeddings", "alternate"), ("norm_affine", False)])
def test_options_a_hugging_face_checkpoint_cannot_hold_are_refused_by_name(field, value):
    llama = {**BASE, "vocab_pad_multiple": 1}
    assert hf_architecture(ModelConfig(**llama)) == "LlamaForCausalLM"
    assert hf_architecture(ModelConfig(**llama, zero_init_output=True)) == "LlamaForCausalLM"   # only the init
    with pytest.raises(ValueError, match=field):
        hf_architecture(ModelConfig(**{**llama, field: value}))


@pytest.mark.slow
def test_recipe_model_trains_forward_and_backward_compiled_equals_eager():
    """All options together: eager and torch.compile agree on the loss and every gradient."""
    from logitlab.train.loss import loss_fn

    kw = dict(mlp="relu2", logit_softcap=15.0, value_embeddings="alternate", zero_init_output=True,
              norm_affine=False, qk_norm=True)
    a, b = _model(**kw), _model(**kw)
    ids = _ids()
    targets = torch.roll(ids, -1, dims=1)
    eager, compiled = loss_fn(a, False), loss_fn(b, True)
    la, lb = eager(ids, targets), compiled(ids, targets)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_params_shows_the_value_embeddings_row(tmp_path, capsys, monkeypatch):
    import json

    from logitlab import cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps(ModelConfig(**{**BASE, "value_embeddings": "alternate"}).to_dict()))
    monkeypatch.setenv("COLUMNS", "200")                                    # the row's label on one line
    assert cli.main(["params", str(path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "value embeddings" in line)
    assert "2,052" in row                                                   # 2 x (64 x 16 + 2)
