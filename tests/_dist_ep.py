"""Expert-parallel training scenarios of a tiny mixture of experts, used by test_parallel_expert.py.

`python tests/_dist_ep.py OUT_DIR SCENARIO...` under torchrun (or alone, rank 0 of 1). Every
scenario trains the same tiny MoE (router losses on, so the balancing loss must be counted over
the global batch) on the same global batches as tests/_dist_nd.py (tests/_dist_worker.py's
data), with a ParallelPlan, and rank 0 writes OUT_DIR/<scenario>.json: the global loss, the
pre-clip gradient norm and the balancing loss per step. `run` with world size 1 is the reference.

"NAME": STEPS steps. "save-NAME": SAVE_AT steps, a sharded checkpoint OUT/dcp_NAME, the rest.
"resume-NAME-from-SRC": layout NAME continues OUT/dcp_SRC for the remaining steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_worker as data  # noqa: E402

from logitlab import parallel  # noqa: E402
from logitlab.parallel.apply import parallelize  # noqa: E402
from logitlab.parallel.mesh import ParallelPlan  # noqa: E402

STEPS = 4
SAVE_AT = 2
SCENARIOS = {
    "ep2": dict(ep=2),                                         # 2 ranks: every rank a whole ep group
    "ep2_zero2": dict(ep=2, parallel="zero2"),                 # 2 ranks: weights kept gathered until backward
    "ep2_ac": dict(ep=2, activation_checkpointing="full"),     # 2 ranks: backward recomputes the all-to-alls
    "fsdp": dict(),                                            # 2 or 4 ranks: the experts FSDP-sharded only
    "ep2_fsdp": dict(ep=2),                                    # 4 ranks: 2 ep groups, experts' FSDP over 2
    "ep4": dict(ep=4),                                         # 4 ranks: one expert per rank
    "ep2_hsdp": dict(ep=2, dp_replicate=2, dp_shard=2),        # 4 ranks: HSDP, ep inside each replica
    "one": dict(),                                             # one process (runner: a resume)
    "ep2_biased": dict(ep=2),                                  # 2 ranks: biased experts, a shared expert
}
# scenario -> the tiny MoE's config changes (default: none)
MODELS = {"ep2_biased": dict(expert_bias=True, router_bias=True, expert_act="clamped_swiglu", router="topk_softmax",
                             shared_expert_d_ff=24, shared_expert_gate=True)}


def tiny_moe(**changes):
    from logitlab.model.transformer import ModelConfig, Transformer

    torch.manual_seed(data.SEED)
    config = ModelConfig(vocab_size=64, context_length=data.T, d_model=32, n_heads=4, n_kv_heads=2,
                         norm="rmsnorm", mlp="swiglu", d_ff=48, positions="rope", bias=False, dropout=0.0,
                         n_layers=2, tie_embeddings=False, n_experts=4, n_experts_per_token=2,
                         router_aux_loss_coef=0.1, router_z_loss_coef=0.01, **changes)
    model = Transformer(config)
    with torch.no_grad():                                      # biases away from zero, so a slip shows
        for name, p in model.named_parameters():
            if name.endswith("_bias") or name.endswith(".bias"):
                p.add_(torch.randn(p.shape) * 0.1)
    return model


def build(name: str, info, reference: bool = False):
    from logitlab.train.moe import RouterLoss

    plan = ParallelPlan() if reference else ParallelPlan(**{"parallel": "fsdp", **SCENARIOS[name]})
    par = parallelize(tiny_moe(**MODELS.get(name, {})), plan, info, seq_len=data.T)
    loss = RouterLoss(par.model, par.model.config, reduce=par.sum_over_dp if info.distributed else None)
    return par, par.build_optimizer(lr=3e-3, weight_decay=0.1), loss


def train(par, optimizer, loss, steps: range) -> dict:
    losses, norms, aux = [], [], []
    for step in steps:
        x, y = data.read_rows(parallel.shard_for_rank(data.global_offsets(step), par.dp))
        local = par.forward_backward(x, y, loss_fn=loss)
        norms.append(par.clip_grad_norm(data.MAX_NORM))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(par.global_loss(local))
        aux.append(par.global_loss(loss.last["aux_loss"]))
    return {"losses": losses, "norms": norms, "aux": aux, "load": loss.last["load"].tolist()}


def run(scenario: str, out: Path, info, reference: bool = False) -> dict:
    """One scenario (its plan; with reference=True a single process with the same model)."""
    from logitlab.parallel.sharded import load_sharded, save_sharded

    if scenario.startswith("resume-"):
        name, _, source = scenario.removeprefix("resume-").partition("-from-")
        par, optimizer, loss = build(name, info, reference)
        meta = load_sharded(out / f"dcp_{source}", par, optimizer)
        return {**train(par, optimizer, loss, range(meta["step"], STEPS)), "resumed_at": meta["step"]}
    save = scenario.startswith("save-")
    name = scenario.removeprefix("save-")
    par, optimizer, loss = build(name, info, reference)
    if not save:
        return train(par, optimizer, loss, range(STEPS))
    first = train(par, optimizer, loss, range(SAVE_AT))
    save_sharded(out / f"dcp_{name}", par, optimizer, step=SAVE_AT, state={"scenario": scenario})
    rest = train(par, optimizer, loss, range(SAVE_AT, STEPS))
    return {k: first[k] + rest[k] if isinstance(first[k], list) and k != "load" else rest[k] for k in first}


def runner(name: str, out: Path, info, resume_from: str | None = None):
    """The main loop (train_parallel: sharded_hooks) with scenario `name`'s layout on OUT/prep
    (tests/_dist_nd.py's corpus), the tiny MoE with the corpus's vocabulary."""
    import dataclasses
    import shutil

    from _dist_nd import SAVE_AT as save_at
    from _dist_nd import runner_config

    from logitlab.model.transformer import Transformer
    from logitlab.train.parallel_run import train_parallel

    model = tiny_moe()
    torch.manual_seed(data.SEED)
    model = Transformer(dataclasses.replace(model.config, vocab_size=320))
    config = runner_config(out, name)
    if resume_from is not None and info.is_main:
        ckpt = f"dcp-{save_at:06d}"
        shutil.copytree(out / f"runner_{resume_from}" / ckpt, Path(config.out_dir) / ckpt)
    plan = ParallelPlan(**{"parallel": "fsdp", **SCENARIOS[name]}) if info.distributed else ParallelPlan()
    return train_parallel(model, config, plan, resume=resume_from is not None, info=info)


def main(argv: list[str]) -> int:
    out, scenarios = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    info = parallel.init_distributed(timeout_s=float(os.environ.get("LOGITLAB_TEST_TIMEOUT_S", "300")))
    try:
        for scenario in scenarios:
            if scenario.startswith("runner-"):
                losses = runner(scenario.removeprefix("runner-"), out, info).losses
                if info.is_main:
                    (out / f"{scenario}.json").write_text(json.dumps({"losses": losses}))
                continue
            result = run(scenario, out, info)
            if info.is_main:
                (out / f"{scenario}.json").write_text(json.dumps({**result, "world_size": info.world_size}))
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
