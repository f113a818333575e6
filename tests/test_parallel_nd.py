"""N-D parallelism on CPU with gloo: ZeRO-1/2/3, tensor + sequence parallel, pipeline schedules,
2-D and 3-D meshes, and sharded (DCP) checkpoints must train exactly like one process.

Every multi-rank scenario of tests/_dist_nd.py trains the same tiny model on the same global
batches; the single-process reference runs here with the same code. One 2-rank torchrun launch
is in the default set (the planner against measured per-rank memory, TP + SP, 1F1B, a
sharded checkpoint resumed in one process); the others are marked slow.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import _dist
import _dist_nd as nd
import pytest

from logitlab import parallel
from logitlab.parallel import planner

TOL = 1e-5
DEFAULT_2 = ("memory-ddp", "memory-zero1", "memory-zero2", "memory-fsdp", "tp_sp", "pp_1f1b", "save-tp")
SLOW_2 = ("tp", "tp_qknorm", "pp_gpipe", "save-pp_interleaved", "fsdp_ac_full", "fsdp_ac_selective", "save-zero1",
          "resume-zero2-from-zero1", "resume-zero1-from-pp_interleaved")
SLOW_4 = ("tp_fsdp", "pp_fsdp", "hsdp", "memory-zero2_4", "save-tp_fsdp", "resume-hsdp-from-tp_fsdp")


def launch(out: Path, nproc: int, scenarios, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """torchrun tests/_dist_nd.py on nproc CPU ranks (tests/_dist.py: a hang is killed)."""
    return _dist.torchrun(nproc, str(Path(nd.__file__)), str(out), *scenarios, expect_ok=expect_ok)


def _results(out: Path, scenarios) -> dict:
    return {name: json.loads((out / f"{name}.json").read_text()) for name in scenarios}


@pytest.fixture(scope="module")
def info():
    info = parallel.init_distributed()
    assert info.world_size == 1
    return info


@pytest.fixture(scope="module")
def reference(info, tmp_path_factory) -> dict:
    """The single-process loss and gradient-norm sequences of each model kind."""
    out = tmp_path_factory.mktemp("ref")
    return {kind: nd.run(name, out, info, reference=True)
            for kind, name in (("untied", "fsdp"), ("tied", "tp"), ("qknorm", "tp_qknorm"))}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("nd2")
    launch(out, 2, DEFAULT_2)
    return out, _results(out, DEFAULT_2)


def _metric(run: Path, key: str) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if key in r]


def _close(a, b, tol: float = TOL) -> None:
    assert len(a) == len(b) and len(a) > 0, (a, b)
    diffs = [abs(x - y) for x, y in zip(a, b)]
    assert max(diffs) <= tol, f"max difference {max(diffs):.3g} > {tol}: {a} vs {b}"


def _matches(result: dict, ref: dict) -> None:
    n = len(result["losses"])
    _close(result["losses"], ref["losses"][-n:])
    _close(result["norms"], ref["norms"][-n:])
    assert len(set(ref["losses"])) == len(ref["losses"]) and min(ref["norms"]) > 0   # it trains


def _kind(scenario: str) -> str:
    return nd.SCENARIOS[scenario.rpartition("-")[2].partition("-from-")[0]][0]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", DEFAULT_2)
def test_two_ranks_match_one_process(two, reference, scenario):
    _matches(two[1][scenario], reference[_kind(scenario)])


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2", "fsdp"])
def test_planner_matches_measured_per_rank_memory(two, stage):
    held = two[1][f"memory-{stage}"]["held"]
    config = nd.tiny_model("untied").config
    plan = planner.plan_rank_memory(config, 2, stage, mixed_precision=False)   # CPU ranks train in fp32
    for kind in ("weights", "gradients", "optimizer"):
        predicted = getattr(plan, kind)
        for rank, measured in enumerate(held):
            # zero1 partitions whole tensors (greedily): within one small tensor of 1/N
            assert abs(measured[kind] - predicted) <= 0.01 * predicted, (stage, kind, rank, measured, predicted)
    if stage != "ddp":  # the shards add up to the whole optimizer state exactly
        assert sum(m["optimizer"] for m in held) == planner.plan_rank_memory(
            config, 1, "ddp", mixed_precision=False).optimizer


@pytest.mark.slow
def test_tensor_parallel_logits_stay_sharded_on_the_vocabulary(two):
    logits = two[1]["tp_sp"]["logits"]
    assert logits["placements"] == ["S(2)"]                     # Shard(dim=2): V
    assert logits["local_shape"] == [8, nd.data.T, 64 // 2]     # (B, T, V / tp) on each rank


@pytest.mark.slow
def test_three_d_mesh_pp_tp_fsdp_on_eight_ranks(tmp_path, reference):
    launch(tmp_path, 8, ("pp_tp_fsdp",))
    _matches(_results(tmp_path, ("pp_tp_fsdp",))["pp_tp_fsdp"], reference["untied"])


def test_sharded_checkpoint_from_tp_resumes_in_one_process(two, reference, info):
    out = two[0]
    result = nd.run("resume-tp-from-tp", out, info, reference=True)
    assert result["resumed_at"] == nd.SAVE_AT
    _matches(result, reference["tied"])
    _close(two[1]["save-tp"]["losses"], reference["tied"]["losses"])


def test_sharded_checkpoint_exports_weights_only(two, info):
    from logitlab.parallel.sharded import read_model_state

    meta, state = read_model_state(two[0] / "dcp_tp")
    assert meta["layout"]["tp"] == 2 and meta["step"] == nd.SAVE_AT
    model = nd.tiny_model("tied")
    expected = set(model.state_dict())
    assert set(state) == expected - {"lm_head.weight"} or set(state) == expected
    model.load_state_dict(state, strict=False)
    assert not any(k.startswith("optim") for k in state)


@pytest.mark.slow
def test_more_two_rank_layouts_match_one_process_and_reshard(tmp_path, reference):
    launch(tmp_path, 2, SLOW_2)
    for name, result in _results(tmp_path, SLOW_2).items():
        _matches(result, reference[_kind(name)])


@pytest.mark.slow
def test_four_rank_meshes_match_and_reshard(tmp_path, reference, info):
    launch(tmp_path, 4, SLOW_4)
    results = _results(tmp_path, SLOW_4)
    for name, result in results.items():
        _matches(result, reference[_kind(name)])
    for rank_held in results["memory-zero2_4"]["held"]:
        assert rank_held["optimizer"] == planner.plan_rank_memory(
            nd.tiny_model("untied").config, 4, "zero2", mixed_precision=False).optimizer
    resumed = nd.run("resume-fsdp-from-tp_fsdp", tmp_path, info, reference=True)   # TP2 x DP2 -> 1 process
    _matches(resumed, reference["untied"])
    launch(tmp_path, 2, ("resume-pp_1f1b-from-tp_fsdp",))                          # -> PP2
    _matches(_results(tmp_path, ("resume-pp_1f1b-from-tp_fsdp",))["resume-pp_1f1b-from-tp_fsdp"],
             reference["untied"])


@pytest.mark.slow
def test_killed_rank_stops_a_tensor_parallel_job_with_a_clear_error(tmp_path):
    procs, _, err = _dist.run_pair(Path(nd.__file__), [str(tmp_path), "die-tp_sp"], timeout_s=3600)
    assert procs[1].returncode == -9 and procs[0].returncode != 0
    assert "RankFailureError: rank 0 of 2" in err and "another rank crashed, was killed" in err, err[-3000:]
    assert "finished without noticing" not in err


def test_state_bytes_follow_the_zero_paper():
    config = nd.tiny_model("untied").config
    psi = 10_000
    rows = {r.parallel: r for r in planner.plan_all_stages(config, 4, n_params=psi, mixed_precision=True)}
    assert (rows["ddp"].weights, rows["ddp"].gradients, rows["ddp"].optimizer) == (2 * psi, 2 * psi, 12 * psi)
    assert (rows["zero1"].weights, rows["zero1"].gradients, rows["zero1"].optimizer) == (2 * psi, 2 * psi, 3 * psi)
    assert (rows["zero2"].gradients, rows["zero2"].optimizer) == (psi // 2, 3 * psi)
    assert (rows["fsdp"].weights, rows["fsdp"].gradients, rows["fsdp"].optimizer) == (psi // 2, psi // 2, 3 * psi)
    assert rows["ddp"].comm == {"all_reduce": 2 * 2 * psi * 3 // 4}
    assert rows["fsdp"].comm["all_gather"] == 2 * rows["fsdp"].comm["reduce_scatter"]
    full = planner.plan_rank_memory(config, 1, micro_batch=2, activation_checkpointing="full")
    none = planner.plan_rank_memory(config, 1, micro_batch=2)
    sel = planner.plan_rank_memory(config, 1, micro_batch=2, activation_checkpointing="selective")
    assert full.activations < sel.activations < none.activations
    with pytest.raises(ValueError, match="parallel must be one of"):
        planner.plan_rank_memory(config, 2, "zero4")
    with pytest.raises(ValueError, match=r"world_size \(6\) must be divisible by tp \(4\)"):
        planner.plan_rank_memory(config, 6, tp=4)


def test_bubble_fraction():
    assert planner.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert planner.bubble_fraction(1, 8) == 0.0
    assert planner.bubble_fraction(4, 4, virtual_stages=2) == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="n_microbatches"):
        planner.bubble_fraction(2, 0)


@pytest.mark.slow
def test_parallel_runner_matches_one_process_and_resumes_on_another_layout(tmp_path, info):
    nd.prepare_corpus(tmp_path / "prep")
    launch(tmp_path, 2, ("runner-tp_sp", "runner-pp_1f1b", "loop-zero2"))
    got = _results(tmp_path, ("runner-tp_sp", "runner-pp_1f1b"))
    ref = nd.runner("fsdp", tmp_path, info)            # one process, the same (untied) model
    _close(got["runner-tp_sp"]["losses"], ref.losses)
    _close(got["runner-pp_1f1b"]["losses"], ref.losses)
    resumed = nd.runner("ddp", tmp_path, info, resume_from="pp_1f1b")   # PP2's checkpoint -> 1 process
    _close(resumed.losses, ref.losses[nd.SAVE_AT:])
    records = [json.loads(line) for line in (tmp_path / "runner_tp_sp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, nd.STEPS + 1))
    assert [r["step"] for r in records if "val_loss" in r] == [0, nd.STEPS]   # the main loop's evaluations

    def vals(name):
        return [json.loads(line)["val_loss"] for line in (tmp_path / f"runner_{name}" / "metrics.jsonl")
                .read_text().splitlines() if "val_loss" in json.loads(line)]
    _close(vals("tp_sp"), vals("fsdp"))
    _close(vals("pp_1f1b"), vals("fsdp"))    # a forward-only pipeline schedule, padded last batch
    nd.main_loop("zero2", tmp_path, info)                # the main loop, one process, then ZeRO-2 on 2 ranks
    loop = [[json.loads(line)["loss"] for line in (tmp_path / f"runner_{name}" / "metrics.jsonl").read_text()
             .splitlines() if "loss" in json.loads(line)] for name in ("loop_none", "loop_zero2")]
    _close(loop[1], loop[0])


@pytest.mark.slow
def test_tensor_parallel_through_the_main_loop_matches_one_process(tmp_path, info):
    """The main loop with the N-D hooks (train_parallel) on TP 2: one process's data order, losses
    and validation losses, run.json and sharded checkpoints."""
    out = tmp_path
    nd.prepare_corpus(out / "prep")
    launch(out, 2, ("runner-tp",))
    ref = nd.runner("one_tied", out, info)
    _close(_results(out, ("runner-tp",))["runner-tp"]["losses"], ref.losses)
    run = out / "runner_tp"
    _close(_metric(run, "val_loss"), _metric(out / "runner_one_tied", "val_loss"))
    assert json.loads((run / "run.json").read_text())["train"]["steps"] == nd.STEPS
    assert sorted(p.name for p in run.glob("dcp-*")) == [f"dcp-{s:06d}" for s in range(nd.SAVE_AT, nd.STEPS + 1, 2)]
