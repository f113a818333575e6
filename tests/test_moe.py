"""The mixture-of-experts block: its three forms against each other (values and gradients), each
routing rule and whole block against transformers' modules (Mixtral, Qwen3-MoE, Qwen3.5-MoE,
gpt-oss, DeepSeek-V3), capacity and dropping, the per-layer MLP kinds and the config's checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitlab.model import ModelConfig, Transformer, moe_forms
from logitlab.model.moe import (
    MoE,
    capacity_keep,
    expert_capacity,
    experts_gather,
    experts_grouped,
    experts_loop,
    experts_sorted,
    route,
    set_moe_impl,
)

BASE = dict(vocab_size=61, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, norm="rmsnorm",
            mlp="swiglu", positions="rope", bias=False, n_experts=6, n_experts_per_token=2, moe_d_ff=16)
FORMS = {"loop": experts_loop, "sorted": experts_sorted, "grouped": experts_grouped, "gather": experts_gather}


def _config(**changes) -> ModelConfig:
    return ModelConfig(**{**BASE, **changes})


def _moe(seed=0, **changes) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(_config(**changes))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        if moe.router.correction_bias is not None:
            moe.router.correction_bias.normal_(0.0, 0.3)
    return moe


VARIANTS = [
    {},
    dict(router="topk_softmax", router_bias=True, expert_bias=True, expert_act="clamped_swiglu", swiglu_limit=0.5),
    dict(norm_topk_prob=False, shared_expert_d_ff=12, shared_expert_gate=True),
    dict(router="sigmoid_topk", n_experts=8, n_experts_per_token=3, n_expert_groups=4, topk_groups=2,
         routed_scaling_factor=2.5, shared_expert_d_ff=16),
    dict(capacity_factor=0.6),
    dict(moe_d_ff=48, n_experts=12, n_experts_per_token=3),   # F > D: the weight multiplies the output
]


@pytest.mark.parametrize("grouped_mm", [True, False])
@pytest.mark.parametrize("changes", VARIANTS)
def test_the_forms_agree_in_values_and_gradients(changes, grouped_mm, monkeypatch):
    """Every form against the loop; the grouped form both ways (torch's grouped product and one
    product per group); the sorted form with gradients (runs split) and without (runs sliced)."""
    if not grouped_mm:
        monkeypatch.setattr(moe_forms, "_grouped_mm_fits", lambda rows: False)
    has = hasattr(torch.nn.functional, "grouped_mm")
    assert moe_forms._grouped_mm_fits(torch.zeros(2, 32)) == grouped_mm or not has
    moe = _moe(**changes)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = moe.router(x)
        logits[:, 1] = -30.0                                               # expert 1 gets no rows
        weights, experts = route(logits, moe.config, moe.router.correction_bias)
    keep = capacity_keep(experts, moe.config.n_experts, expert_capacity(moe.config, 13))
    assert not (experts == 1).any()
    grads, outs = {}, {}
    for name, form in FORMS.items():
        xs, ws = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = form(moe.experts, xs, ws, experts, keep)
        out.pow(2).sum().backward()
        outs[name] = out.detach()
        grads[name] = (xs.grad, ws.grad, moe.experts.gate_up_proj.grad.clone(), moe.experts.down_proj.grad.clone())
        moe.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(form(moe.experts, x, weights, experts, keep), outs[name], atol=1e-6, rtol=1e-6)
    for name in ("sorted", "grouped", "gather"):
        torch.testing.assert_close(outs[name], outs["loop"], atol=1e-5, rtol=1e-5)
        for got, want in zip(grads[name], grads["loop"]):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["grouped"], outs["sorted"], atol=1e-6, rtol=1e-6)   # the same products


def _timings(sorted_s: float, grouped_s: float):
    return lambda ex, x, k: {"sorted": sorted_s, "grouped": grouped_s}


def test_auto_takes_the_form_measured_faster(monkeypatch):
    moe, x = _moe(), torch.randn(5, 32)
    monkeypatch.setattr(moe_forms, "measure_forms", _timings(1.0, 0.85))
    assert moe.form(x) == "grouped"
    monkeypatch.setattr(moe_forms, "measure_forms", _timings(1.0, 0.95))
    assert moe.form(x) == "sorted"                                         # a near tie keeps sorted
    monkeypatch.setattr(moe_forms, "measure_forms", _timings(1.0, 2.0))
    assert moe.form(x) == "sorted"
    moe.impl = "loop"
    assert moe.form(x) == "loop"
    moe.impl = "fast"
    with pytest.raises(ValueError, match="MoE impl must be one of"):
        moe.form(x)


def test_auto_times_nothing_while_tracing_counting_or_with_replaced_products(monkeypatch):
    """torch.compile: gather for a handful of tokens (N * K <= E = 6), else grouped; a dispatch
    mode (a FLOP counter, selective checkpointing) and a kernel's products: grouped."""
    from torch.utils.flop_counter import FlopCounterMode

    def refuse(ex, x, k):
        raise AssertionError("nothing may be timed here")

    monkeypatch.setattr(moe_forms, "measure_forms", refuse)
    moe = _moe()
    with FlopCounterMode(display=False):
        assert moe.form(torch.randn(5, 32)) == "grouped"

    class KernelExperts(type(moe.experts)):
        def products(self, rows, counts, ids, stacked=None, scale=None):
            return super().products(rows, counts, ids, stacked, scale)

    moe.experts.__class__ = KernelExperts
    assert moe.form(torch.randn(5, 32)) == "grouped"
    moe.experts.__class__ = KernelExperts.__mro__[1]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert moe.form(torch.randn(3, 32)) == "gather" and moe.form(torch.randn(4, 32)) == "grouped"


def test_measure_forms_times_each_shape_once(monkeypatch):
    """One warm-up, then the best of `repeats` timed calls per form, alternating; cached per
    shape, token counts rounded up to a power of two."""
    calls = []
    times = iter(([9.0, 9.0] + [3.0, 2.0, 1.0, 4.0, 2.0, 5.0]) * 2)

    def timed(form, ex, x, weights, experts):
        calls.append((form.__name__, tuple(x.shape), tuple(experts.shape)))
        return next(times)

    monkeypatch.setattr(moe_forms, "MEASURED", {})
    monkeypatch.setattr(moe_forms, "_timed", timed)
    moe = _moe()
    got = moe_forms.measure_forms(moe.experts, torch.randn(5, 32), 2, repeats=3)
    assert got == {"sorted": 1.0, "grouped": 2.0}
    assert [c[0] for c in calls] == ["experts_sorted", "experts_grouped"] * 4
    assert calls[0][1:] == ((8, 32), (8, 2))                               # 5 tokens measured as 8
    assert moe_forms.measure_forms(moe.experts, torch.randn(7, 32), 2, repeats=3) is got and len(calls) == 8
    moe_forms.measure_forms(moe.experts, torch.randn(9, 32), 2, repeats=3)   # 16: measured anew
    assert len(calls) == 16 and len(moe_forms.MEASURED) == 2


def test_measure_forms_runs_the_forms_for_real():
    moe = _moe()
    got = moe_forms.measure_forms(moe.experts, torch.randn(3, 32), 2, repeats=1)
    assert set(got) == {"sorted", "grouped"} and all(0 < s < 10 for s in got.values())


def test_the_loop_is_the_definition():
    """out[t] = sum_k w[t, k] * expert_{e[t, k]}(x[t]), written out token by token."""
    moe = _moe()
    x = torch.randn(5, 32)
    weights, experts = route(moe.router(x), moe.config)
    want = torch.stack([sum(weights[t, k] * moe.experts.expert(int(experts[t, k]), x[t:t + 1])[0]
                            for k in range(2)) for t in range(5)])
    torch.testing.assert_close(experts_loop(moe.experts, x, weights, experts), want)


# --------------------------------------------------------------------------------------------
# Capacity
# --------------------------------------------------------------------------------------------

def test_capacity_keeps_the_first_assignments_of_each_expert_in_token_order():
    experts = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])
    keep = capacity_keep(experts, 3, 2)
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, False]]
    assert capacity_keep(experts, 3, None) is None


def test_dropped_share_is_recorded_and_a_large_capacity_drops_nothing():
    x = torch.randn(1, 16, 32)
    tight, loose, dropless = _moe(capacity_factor=0.5), _moe(capacity_factor=100.0), _moe()
    records = [{}, {}, {}]
    outs = [m(x, record=r) for m, r in zip((tight, loose, dropless), records)]
    assert 0.4 <= float(records[0]["dropped"]) < 1.0                     # at most half the slots exist
    assert float(records[1]["dropped"]) == 0.0 == float(records[2]["dropped"])
    torch.testing.assert_close(outs[1], outs[2])
    assert not torch.allclose(outs[0], outs[2])
    for name in ("router_logits", "experts", "weights"):
        assert records[2][name].shape[0] == 16


# --------------------------------------------------------------------------------------------
# Routing and whole blocks against transformers
# --------------------------------------------------------------------------------------------

def _load(ours: MoE, theirs_state: dict, mapping: dict) -> None:
    with torch.no_grad():
        for our_name, value in mapping.items():
            dict(ours.named_parameters(), **dict(ours.named_buffers()))[our_name].copy_(
                value if isinstance(value, torch.Tensor) else theirs_state[value])


def _shared(state: dict, prefix: str) -> dict:
    return {"shared.gate_up_proj.weight": torch.cat([state[f"{prefix}.gate_proj.weight"],
                                                     state[f"{prefix}.up_proj.weight"]]),
            "shared.down_proj.weight": f"{prefix}.down_proj.weight"}


def _check_block(ours: MoE, theirs, atol=1e-6) -> None:
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(x)
        want = want[0] if isinstance(want, tuple) else want
        for impl in ("loop", "sorted", "grouped", "gather"):
            ours.impl = impl
            torch.testing.assert_close(ours(x), want, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_block_matches(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    theirs = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6,
                                                   num_experts_per_tok=2, norm_topk_prob=norm)).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    ours = _moe(norm_topk_prob=norm)
    s = theirs.state_dict()
    _load(ours, s, {"router.weight": "gate.weight", "experts.gate_up_proj": "experts.gate_up_proj",
                    "experts.down_proj": "experts.down_proj"})
    _check_block(ours, theirs)


def test_mixtral_block_matches():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    theirs = MixtralSparseMoeBlock(MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=6,
                                                 num_experts_per_tok=2)).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    ours = _moe()
    _load(ours, theirs.state_dict(), {"router.weight": "gate.weight", "experts.gate_up_proj": "experts.gate_up_proj",
                                      "experts.down_proj": "experts.down_proj"})
    _check_block(ours, theirs)


def test_qwen3_5_moe_block_with_gated_shared_expert_matches():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    torch.manual_seed(0)
    theirs = Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(
        hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=12, num_experts=6,
        num_experts_per_tok=2)).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    ours = _moe(shared_expert_d_ff=12, shared_expert_gate=True)
    s = theirs.state_dict()
    _load(ours, s, {"router.weight": "gate.weight", "experts.gate_up_proj": "experts.gate_up_proj",
                    "experts.down_proj": "experts.down_proj", "shared_gate.weight": "shared_expert_gate.weight",
                    **_shared(s, "shared_expert")})
    _check_block(ours, theirs)


def test_gpt_oss_block_with_biases_and_clamped_swiglu_matches():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(0)
    theirs = GptOssMLP(GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=6,
                                    num_experts_per_tok=2, swiglu_limit=0.7)).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    ours = _moe(router="topk_softmax", router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
                swiglu_limit=0.7)
    s = theirs.state_dict()
    gate_up = s["experts.gate_up_proj"].transpose(1, 2)                    # (E, 2F, D), rows g0 u0 g1 u1 ...
    gate_up_bias = s["experts.gate_up_proj_bias"]
    _load(ours, s, {"router.weight": "router.weight", "router.bias": "router.bias",
                    "experts.gate_up_proj": torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1),
                    "experts.gate_up_bias": torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], 1),
                    "experts.down_proj": s["experts.down_proj"].transpose(1, 2),
                    "experts.down_bias": "experts.down_proj_bias"})
    _check_block(ours, theirs)


@pytest.mark.parametrize("groups, best", [(4, 2), (1, 1), (8, 3)])
def test_deepseek_v3_group_limited_sigmoid_routing_matches(groups, best):
    """DeepSeek-V3's router (sigmoid scores, the correction bias for the choice only, group-limited,
    renormalised and scaled by 2.5) and block (an ungated shared expert), at module level."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    E = 16 if groups == 8 else 8
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=E,
                                            num_experts_per_tok=3, n_group=groups, topk_group=best,
                                            n_shared_experts=1, routed_scaling_factor=2.5)).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    theirs.gate.e_score_correction_bias.normal_(0.0, 0.5)                # moves the choice, not the weights
    ours = _moe(router="sigmoid_topk", n_experts=E, n_experts_per_token=3, n_expert_groups=groups,
                topk_groups=best, routed_scaling_factor=2.5, shared_expert_d_ff=16)
    s = theirs.state_dict()
    _load(ours, s, {"router.weight": "gate.weight", "router.correction_bias": "gate.e_score_correction_bias",
                    "experts.gate_up_proj": "experts.gate_up_proj", "experts.down_proj": "experts.down_proj",
                    **_shared(s, "shared_experts")})
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, their_w, their_e = theirs.gate(x)
        our_w, our_e = route(ours.router(x), ours.config, ours.router.correction_bias)
    order_t, order_o = their_e.argsort(-1), our_e.argsort(-1)             # the same set, any order
    assert torch.equal(their_e.gather(-1, order_t), our_e.gather(-1, order_o))
    torch.testing.assert_close(our_w.gather(-1, order_o), their_w.gather(-1, order_t))
    _check_block(ours, theirs, atol=2e-5)


# --------------------------------------------------------------------------------------------
# In the model: per-layer MLP kinds, keys, config checks
# --------------------------------------------------------------------------------------------

def test_mlp_types_choose_dense_or_moe_per_layer_and_the_keys_follow():
    c = _config(n_layers=3, mlp_types=("dense", "moe", "moe"), d_ff=40)
    keys = Transformer(c).state_dict()
    assert keys["blocks.0.mlp.gate_up_proj.weight"].shape == (80, 32)
    assert keys["blocks.1.mlp.experts.gate_up_proj"].shape == (6, 32, 32)
    assert keys["blocks.2.mlp.router.weight"].shape == (6, 32)
    assert not any(k.startswith("blocks.0.mlp.router") for k in keys)
    assert _config(mlp_types=("moe", "moe")).mlp_types is None           # the default, stored as such
    assert c.mlp_kinds == ("dense", "moe", "moe") and c.is_moe and not ModelConfig().is_moe


def test_model_forms_agree_and_records_come_per_moe_layer():
    torch.manual_seed(0)
    model = Transformer(_config(n_layers=3, mlp_types=("moe", "dense", "moe"), d_ff=24)).eval()
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        want = model(ids)
        for impl in ("loop", "gather"):
            set_moe_impl(model, impl)
            torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=1e-5)
        records = []
        model._run(ids, None, None, None, records=records)
    assert [r["layer"] for r in records] == [0, 2] and records[0]["router_logits"].shape == (18, 6)
    with pytest.raises(ValueError, match="MoE impl must be one of"):
        set_moe_impl(model, "fast")


@pytest.mark.parametrize("changes, message", [
    (dict(n_experts_per_token=7), "n_experts_per_token must be in \\[1, n_experts=6\\]"),
    (dict(n_experts_per_token=None), "n_experts_per_token must be in"),
    (dict(mlp="gelu"), "needs mlp='swiglu'"),
    (dict(mlp_types=("moe",)), "mlp_types has 1 entries but n_layers is 2"),
    (dict(n_expert_groups=2), "group-limited routing needs router='sigmoid_topk'"),
    (dict(router="sigmoid_topk", n_expert_groups=4), "must split into n_expert_groups"),
    (dict(router="sigmoid_topk", n_expert_groups=3, topk_groups=1, n_experts_per_token=3), "hold the"),
    (dict(shared_expert_gate=True), "needs a shared expert"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(router="top1"), "router must be one of"),
    (dict(n_experts=0, n_experts_per_token=None, moe_d_ff=None, shared_expert_d_ff=8),
     "shared_expert_d_ff=8 is set but n_experts is 0"),
    (dict(n_experts=0, moe_d_ff=None), "n_experts_per_token=2 is set but n_experts is 0"),
])
def test_config_checks_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_config_round_trips_through_its_dict():
    c = _config(mlp_types=("dense", "moe"), router="sigmoid_topk", n_expert_groups=3, topk_groups=2)
    again = ModelConfig.from_dict(c.to_dict())
    assert again == c and again.mlp_types == ("dense", "moe")
    assert dataclasses.replace(c, n_layers=2).moe_d_ff == 16


@pytest.mark.slow
def test_compiled_decode_step_is_one_graph_through_the_gather_form():
    """fullgraph: the grouped form's host-side counts would break the graph; a decode step of one
    token per row takes the gather form under torch.compile, with the same tokens as eager."""
    from logitlab.generate import SampleConfig, generate
    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import compiled_decode_step

    torch.manual_seed(0)
    model = Transformer(_config(vocab_size=64, n_experts=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    cfg = SampleConfig(max_new_tokens=8, temperature=0)
    want = generate(model, [[1, 2, 3, 4], [5, 6, 7, 8]], cfg).tokens
    step = compiled_decode_step(model, "aot_eager", step=decode_step)
    assert generate(model, [[1, 2, 3, 4], [5, 6, 7, 8]], cfg, step=step).tokens == want
    assert len(set(want[0])) > 1


def test_tensor_parallel_refuses_experts_by_name():
    from logitlab.parallel.tensor import check_tensor_parallel

    with pytest.raises(ValueError, match="does not split mixture-of-experts layers \\(n_experts=6\\)"):
        check_tensor_parallel(_config(vocab_size=64), 2)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_an_moe_model_keeps_its_gradients(mode, monkeypatch):
    """"auto" times nothing inside a selectively checkpointed block (its recompute replays the
    products the first forward ran) and keeps its choice for the recompute of a full one."""
    import copy

    from logitlab.parallel.activation import apply_activation_checkpointing

    monkeypatch.setattr(moe_forms, "MEASURED", {})
    torch.manual_seed(0)
    plain = Transformer(_config(n_layers=2))
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain), mode)
    ids = torch.randint(0, 61, (2, 8))                                    # 16 tokens: the shape "auto" would time
    grads = []
    for model in (checkpointed, plain):
        model(ids).logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-5)


def test_the_forms_agree_under_bf16_autocast():
    """Under CPU bf16 autocast the products come out in bf16 and are added to float32 outputs."""
    moe = _moe()
    x = torch.randn(2, 7, 32)
    outs = {}
    for impl in FORMS:
        moe.impl = impl
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[impl] = moe(x)
        assert outs[impl].dtype == torch.float32
    for impl in ("sorted", "grouped", "gather"):
        torch.testing.assert_close(outs[impl], outs["loop"], atol=3e-2, rtol=3e-2)
