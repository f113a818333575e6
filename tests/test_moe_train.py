"""Training a mixture of experts: the load-balancing loss against transformers'
load_balancing_loss_func, the z-loss and entropy by hand, the training step's loss and its logged
parts, and the auxiliary-loss-free correction-bias update."""

from __future__ import annotations

import math

import pytest
import torch

from logitlab.model import ModelConfig, Transformer
from logitlab.train.moe import (
    RouterLoss,
    RoutingLog,
    expert_load,
    load_balancing_loss,
    router_entropy,
    router_z_loss,
    update_correction_bias,
)

BASE = dict(vocab_size=61, context_length=32, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, norm="rmsnorm",
            mlp="swiglu", positions="rope", bias=False, n_experts=6, n_experts_per_token=2, moe_d_ff=16)


def _model(seed=0, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**BASE, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5)                                    # routers with opinions
    return model


def _records(model, ids):
    records = []
    model(ids, records=records)
    return records


@pytest.mark.parametrize("masked", [False, True])
def test_pooled_balance_loss_is_transformers_load_balancing_loss_func(masked):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = _model()
    ids = torch.randint(0, 61, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    if masked:
        mask[1, :4] = 0                                                    # left padding
    with torch.no_grad():
        records = _records(model, ids)
    logits = tuple(r["router_logits"] for r in records)
    want = load_balancing_loss_func(logits, 6, 2, mask if masked else None)
    got = load_balancing_loss(records, 6, mask if masked else None, pooled=True)
    torch.testing.assert_close(got, want)
    per_layer = [load_balancing_loss_func((z,), 6, 2, mask if masked else None) for z in logits]
    torch.testing.assert_close(load_balancing_loss(records, 6, mask if masked else None), torch.stack(per_layer).mean())


def test_balance_loss_is_one_when_balanced_and_e_when_collapsed():
    E = 4
    uniform = {"router_logits": torch.zeros(8, E), "experts": torch.arange(8).remainder(E)[:, None]}
    collapsed = {"router_logits": torch.tensor([[30.0, 0, 0, 0]]).repeat(8, 1), "experts": torch.zeros(8, 1).long()}
    assert float(load_balancing_loss([uniform], E)) == pytest.approx(1.0)
    assert float(load_balancing_loss([collapsed], E)) == pytest.approx(E, rel=1e-6)


def test_z_loss_and_entropy_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    record = {"router_logits": logits, "experts": torch.zeros(2, 1).long()}
    lse = torch.logsumexp(logits, -1)
    assert float(router_z_loss([record])) == pytest.approx(float(lse.square().mean()))
    assert float(router_entropy([{"router_logits": torch.zeros(3, 8)}])) == pytest.approx(math.log(8))
    assert expert_load([record, {"experts": torch.tensor([[1, 3]])}], 4).tolist() == [[2, 0, 0, 0], [0, 1, 0, 1]]


def test_router_loss_adds_the_weighted_parts_and_trains_the_router():
    from logitlab.train.loss import cross_entropy

    ids, targets = torch.randint(0, 61, (2, 9)), torch.randint(0, 61, (2, 9))
    plain, weighted = _model(), _model(router_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    loss = RouterLoss(weighted, weighted.config)
    total = loss(ids, targets)
    parts = loss.last
    torch.testing.assert_close(parts["ce_loss"], cross_entropy(plain(ids), targets).detach())
    torch.testing.assert_close(total.detach(), parts["ce_loss"] + 0.5 * parts["aux_loss"] + 0.1 * parts["z_loss"])
    assert parts["load"].shape == (3, 6) and float(parts["load"].sum()) == 3 * 18 * 2
    total.backward()
    RouterLoss(plain, plain.config)(ids, targets).backward()
    router = "blocks.0.mlp.router.weight"
    weighted_grad, plain_grad = (dict(m.named_parameters())[router].grad for m in (weighted, plain))
    assert not torch.allclose(weighted_grad, plain_grad)


def test_routing_log_averages_micro_steps_and_shares_sum_to_one():
    log = RoutingLog()
    assert log.step(None) == {}
    for aux in (1.0, 3.0):
        log.add({"aux_loss": torch.tensor(aux), "load": torch.tensor([[3.0, 1.0], [0.0, 4.0]])})
    record = log.step(None)
    assert record["aux_loss"] == 2.0 and record["expert_share"] == [[0.75, 0.25], [0.0, 1.0]]
    assert log.step(None) == {}                                            # emptied by the step


def test_correction_bias_moves_toward_the_underloaded_experts():
    model = _model(router="sigmoid_topk", n_experts=4, n_experts_per_token=1, mlp_types=("moe", "dense", "moe"),
                   d_ff=24)
    load = torch.tensor([[10.0, 0.0, 2.0, 4.0], [4.0, 4.0, 4.0, 4.0]])
    assert update_correction_bias(model, load, 0.01) == 2
    first = model.blocks[0].mlp.router.correction_bias
    torch.testing.assert_close(first, torch.tensor([-0.01, 0.01, 0.01, 0.0]))     # mean 4: above, below, below, at
    torch.testing.assert_close(model.blocks[2].mlp.router.correction_bias, torch.zeros(4))
    assert "blocks.0.mlp.router.correction_bias" in model.state_dict()       # saved with the checkpoint
    with pytest.raises(ValueError, match="load has 1 rows but the model has 2 MoE layers"):
        update_correction_bias(model, load[:1], 0.01)
    assert update_correction_bias(_model(), torch.ones(3, 6), 0.01) == 0  # softmax routers have no bias


def test_correction_bias_changes_the_choice_not_the_weights():
    model = _model(router="sigmoid_topk", n_experts=4, n_experts_per_token=1, norm_topk_prob=False)
    x = torch.randn(1, 5, 32)
    moe = model.blocks[0].mlp
    before, after = {}, {}
    with torch.no_grad():
        moe(x, record=before)
        moe.router.correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
        moe(x, record=after)
    assert (after["experts"] == 3).all() and not (before["experts"] == 3).all()
    torch.testing.assert_close(after["weights"][:, 0], torch.sigmoid(after["router_logits"][:, 3]))


# --------------------------------------------------------------------------------------------
# The training loop
# --------------------------------------------------------------------------------------------

def _corpus(tmp_path):
    from logitlab.data import tokens as data
    from logitlab.tokenizer.core import Tokenizer

    src = tmp_path / "docs"
    src.mkdir()
    for k in range(8):
        (src / f"{k}.txt").write_text(f"{k}: the quick brown fox jumps over the lazy dog. " * 6)
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])
    data.prepare_corpus([src], tok, tmp_path / "prep", val_fraction=0.1, workers=1)
    return tmp_path / "prep"


def _train(data_dir, out, steps, resume=False):
    """A 2-layer sigmoid-routed MoE trained `steps` steps of two micro-steps -> (model, metrics records)."""
    import json

    from logitlab.train.loop import TrainConfig, train

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**BASE, "vocab_size": 257, "n_layers": 2, "router": "sigmoid_topk",
                                       "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.001}))
    cfg = TrainConfig(data_dir=str(data_dir), out_dir=str(out), steps=steps, batch_size=2, grad_accum=2, seq_len=16,
                      lr=3e-3, warmup_steps=1, eval_every=2, eval_tokens=64, device="cpu", precision="fp32",
                      router_bias_update_rate=0.01, tensorboard=False, eval_at_start=False)
    train(model, cfg, resume=resume)
    return model, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_logs_the_routing_and_moves_the_correction_bias(tmp_path):
    model, records = _train(_corpus(tmp_path), tmp_path / "a", 2)
    step = records[0]
    assert {"ce_loss", "aux_loss", "z_loss", "router_entropy", "dropped", "expert_share"} <= set(step)
    assert len(step["expert_share"]) == 2 and abs(sum(step["expert_share"][0]) - 1) < 1e-3
    assert step["loss"] == pytest.approx(step["ce_loss"] + 0.01 * step["aux_loss"] + 0.001 * step["z_loss"], rel=1e-5)
    bias = model.blocks[0].mlp.router.correction_bias
    assert 0 < float(bias.abs().max()) <= 2 * 0.01 + 1e-9                # two steps of +-0.01 (or 0)


@pytest.mark.slow
def test_resume_continues_bit_for_bit_with_the_correction_bias(tmp_path):
    data_dir = _corpus(tmp_path)
    model, _ = _train(data_dir, tmp_path / "a", 4)
    _train(data_dir, tmp_path / "b", 2)
    resumed, _ = _train(data_dir, tmp_path / "b", 4, resume=True)
    torch.testing.assert_close(resumed.blocks[0].mlp.router.correction_bias,
                               model.blocks[0].mlp.router.correction_bias, rtol=0, atol=0)
    torch.testing.assert_close(resumed.blocks[1].mlp.experts.down_proj, model.blocks[1].mlp.experts.down_proj,
                               rtol=0, atol=0)


def test_train_command_trains_moe_tiny_and_says_what_it_routes(tmp_path, capsys):
    import json

    from logitlab import cli
    from logitlab.cli.progress import routing

    (tmp_path / "code.txt").write_text("".join(f"def f_{i}(x):\n    return x * {i}\n\n" for i in range(200)))
    args = ["train", "--preset", "moe-tiny", "--data", str(tmp_path / "code.txt"), "--tokenizer-vocab", "300",
            "--context-length", "32", "--n-layers", "2", "--batch-size", "4", "--steps", "2", "--warmup-steps", "1",
            "--eval-every", "2", "--eval-tokens", "128", "--val-fraction", "0.2", "--workers", "1",
            "--progress", "false", "--device", "cpu", "--router-z-loss-coef", "0.001", "--out", str(tmp_path / "run")]
    assert cli.main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "8 experts, 2 per token:" in out and "M active (balancing loss x 0.01, z-loss x 0.001)" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 2 and len(last["expert_share"]) == 2 and len(last["expert_share"][0]) == 8
    line = routing(last)
    assert line.startswith("; balancing loss ") and "router entropy" in line and "busiest expert" in line
    assert routing({"loss": 1.0}) == ""
