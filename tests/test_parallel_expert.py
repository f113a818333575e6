"""Expert parallelism on CPU with gloo: a tiny mixture of experts with its experts spread over
an `ep` mesh dimension (all-to-all dispatch), alone and under FSDP2 / HSDP, must train like one
process (losses, gradient norms, the balancing loss of the global batch), and its sharded
checkpoints must resume on another expert-parallel degree and in one process.

The single-process pieces (the plan's checks, the mesh, the dispatch's bookkeeping) run by
default; every torchrun launch is marked slow (a 2-rank launch takes 20-40 s on 2 busy cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import _dist
import _dist_ep as ep
import pytest
import torch

from logitlab import parallel
from logitlab.parallel.mesh import ParallelPlan

TOL = 1e-5


def launch(out: Path, nproc: int, scenarios) -> dict:
    _dist.torchrun(nproc, str(Path(ep.__file__)), str(out), *scenarios)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in scenarios}


@pytest.fixture(scope="module")
def info():
    info = parallel.init_distributed()
    assert info.world_size == 1
    return info


@pytest.fixture(scope="module")
def reference(info, tmp_path_factory) -> dict:
    return ep.run("fsdp", tmp_path_factory.mktemp("ep_ref"), info, reference=True)


def _close(a, b, tol: float = TOL) -> None:
    assert len(a) == len(b) and len(a) > 0, (a, b)
    diffs = [abs(x - y) for x, y in zip(a, b)]
    assert max(diffs) <= tol, f"max difference {max(diffs):.3g} > {tol}: {a} vs {b}"


def _matches(result: dict, ref: dict) -> None:
    n = len(result["losses"])
    for key in ("losses", "norms", "aux"):
        _close(result[key], ref[key][-n:])
    assert result["load"] == ref["load"]                                  # the global batch's expert load
    assert len(set(ref["losses"])) == len(ref["losses"]) and min(ref["norms"]) > 0   # it trains


def test_plan_checks_the_expert_parallel_degree():
    assert ParallelPlan(ep=2, parallel="fsdp").resolve(4).dp_shard == 4
    with pytest.raises(ValueError, match=r"ep \(--ep\) must be a positive integer"):
        ParallelPlan(ep=0)
    with pytest.raises(ValueError, match="--ep 3 must divide --dp-shard 4"):
        ParallelPlan(ep=3, parallel="fsdp").resolve(4)
    with pytest.raises(ValueError, match="composes with FSDP2"):
        ParallelPlan(ep=2, parallel="ddp").resolve(2)
    with pytest.raises(ValueError, match="not yet with tensor or pipeline"):
        ParallelPlan(ep=2, tp=2, parallel="fsdp").resolve(4)


def test_expert_parallel_needs_experts_that_divide():
    from logitlab.model.transformer import ModelConfig
    from logitlab.parallel.expert import check_expert_parallel

    moe = ep.tiny_moe().config
    check_expert_parallel(moe, 4)
    with pytest.raises(ValueError, match=r"n_experts \(4\) must be divisible by ep"):
        check_expert_parallel(moe, 3)
    dense = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_heads=4, n_layers=1)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_expert_parallel(dense, 2)


def test_sort_by_expert_cuts_the_rows_by_destination_rank():
    """The dispatch's bookkeeping: the sorted assignments of ranks' experts are contiguous, so
    counts.view(ep, El) gives every destination's rows, and `token` finds each row's token."""
    from logitlab.model.moe import sort_by_expert

    g = torch.Generator().manual_seed(0)
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])     # (N 7, K 2)
    keep = torch.rand(7, 2, generator=g) > 0.2
    used, counts, ids, token = sort_by_expert(experts, keep, 4)
    assert counts.tolist() == [int(((experts == e) & keep).sum()) for e in range(4)]
    assert ids.tolist() == sorted(ids.tolist()) and len(used) == int(keep.sum())
    assert torch.equal(experts.reshape(-1)[used], ids) and torch.equal(token, used // 2)
    send = counts.view(2, 2).sum(1).tolist()                              # rows for ranks 0, 1 of ep 2
    assert (ids[:send[0]] < 2).all() and (ids[send[0]:] >= 2).all()


@pytest.mark.slow
def test_two_ranks_expert_parallel_match_one_process_and_reshard(tmp_path, reference, info):
    from logitlab.parallel.sharded import read_model_state

    results = launch(tmp_path, 2, ("save-ep2", "fsdp", "ep2_zero2", "ep2_ac", "resume-fsdp-from-ep2", "ep2_biased"))
    for name, result in results.items():
        assert result["world_size"] == 2
        _matches(result, ep.run(name, tmp_path, info, reference=True) if name in ep.MODELS else reference)
    assert results["resume-fsdp-from-ep2"]["resumed_at"] == ep.SAVE_AT       # ep 2 -> ep 1 (FSDP only)
    resumed = ep.run("resume-fsdp-from-ep2", tmp_path, info, reference=True)  # ep 2 -> one process
    _matches(resumed, reference)
    meta, state = read_model_state(tmp_path / "dcp_ep2")                   # the model's keys and shapes
    expected = ep.tiny_moe().state_dict()
    assert meta["layout"]["ep"] == 2 and set(state) == set(expected)
    assert all(state[k].shape == expected[k].shape for k in expected)
    _exports_to_hf(tmp_path, state)


def _exports_to_hf(tmp_path: Path, state: dict) -> None:
    """The expert-parallel checkpoint's weights as a Hugging Face directory transformers loads,
    with the logits of the same weights in one process."""
    transformers = pytest.importorskip("transformers")
    from logitlab.train.parallel_run import export_sharded_to_hf

    export_sharded_to_hf(tmp_path / "dcp_ep2", tmp_path / "hf")
    model = ep.tiny_moe()
    model.load_state_dict(state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model.eval()(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_four_ranks_expert_parallel_with_fsdp_and_hsdp_match_and_reshard(tmp_path, reference):
    scenarios = ("save-ep2_fsdp", "ep4", "ep2_hsdp", "resume-ep4-from-ep2_fsdp")
    for name, result in launch(tmp_path, 4, scenarios).items():
        assert result["world_size"] == 4
        _matches(result, reference)


@pytest.mark.slow
def test_expert_parallel_through_the_main_loop_matches_one_process(tmp_path, info):
    """train_parallel (the main loop, sharded_hooks) with --ep 2 on 2 ranks: one process's losses
    and validation losses with the router's losses in the step, their parts logged, sharded
    checkpoints that resume in one process."""
    import _dist_nd as nd

    nd.prepare_corpus(tmp_path / "prep")
    launch(tmp_path, 2, ("runner-ep2",))
    ref = ep.runner("fsdp", tmp_path, info)                     # one process
    got = json.loads((tmp_path / "runner-ep2.json").read_text())["losses"]
    _close(got, ref.losses)
    records = [json.loads(line) for line in (tmp_path / "runner_ep2" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == nd.STEPS and all("aux_loss" in r and len(r["expert_share"]) == 2 for r in steps)
    ref_val = [json.loads(line)["val_loss"] for line in (tmp_path / "runner_fsdp" / "metrics.jsonl").read_text()
               .splitlines() if "val_loss" in json.loads(line)]
    _close([r["val_loss"] for r in records if "val_loss" in r], ref_val)
    resumed = ep.runner("one", tmp_path, info, resume_from="ep2")   # --ep 2's checkpoint -> one process
    _close(resumed.losses, ref.losses[nd.SAVE_AT:])


def test_expert_parallel_refuses_experts_that_carry_adapters():
    """LoRA's experts (or a kernel's) override how the experts multiply: spreading them would drop it."""
    from logitlab.parallel.expert import apply_expert_parallel
    from logitlab.train.lora import LoRAConfig, apply_lora

    class TwoRanks:                                                        # the mesh's size is all it reads first
        def size(self):
            return 2

    model = ep.tiny_moe()
    apply_lora(model, LoRAConfig(targets="experts.down_proj"))
    with pytest.raises(ValueError, match="spreads plain experts; these are LoRAExperts"):
        apply_expert_parallel(model, TwoRanks())
