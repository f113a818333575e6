"""N-D parallelism on CPU with gloo: ZeRO-1/2/3, tensor + sequence parallel, pipeline schedules,
2-D and 3-D meshes, and sharded (DCP) checkpoints must train exactly like one process.

Every multi-rank scenario of tests/_dist_nd.py trains the same tiny model on the same global
batches; the single-process reference runs here with the same code. One 2-rank torchrun launch
is in the default set (the planner against measured per-rank memory, TP + SP, 1F1B, a
sharded checkpoint resumed in one process); the others are marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import _dist_nd as nd
import pytest

from logitlab import parallel
from logitlab.parallel import planner

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
LAUNCH_TIMEOUT_S = 600   # bounds a hang only
DEFAULT_2 = ("memory-ddp", "memory-zero1", "memory-zero2", "memory-fsdp", "tp_sp", "pp_1f1b", "save-tp")
SLOW_2 = ("tp", "tp_qknorm", "pp_gpipe", "save-pp_interleaved", "fsdp_ac_full", "fsdp_ac_selective", "save-zero1",
          "resume-zero2-from-zero1", "resume-zero1-from-pp_interleaved")
SLOW_4 = ("tp_fsdp", "pp_fsdp", "hsdp", "memory-zero2_4", "save-tp_fsdp", "resume-hsdp-from-tp_fsdp")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def launch(out: Path, nproc: int, scenarios, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """torchrun tests/_dist_nd.py on nproc CPU ranks; past the timeout its whole session is killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc_per_node", str(nproc), str(Path(nd.__file__)), str(out), *scenarios]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"torchrun ran past {LAUNCH_TIMEOUT_S} s:\n{stderr[-4000:]}") from None
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


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


@pytest.mark.parametrize("scenario", DEFAULT_2)
def test_two_ranks_match_one_process(two, reference, scenario):
    _matches(two[1][scenario], reference[_kind(scenario)])


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair_directly(out: Path, scenario: str) -> tuple[list[subprocess.Popen], str]:
    """Two ranks started with torchrun's variables but no agent (which would tear the survivor
    down itself), so the survivor's own reaction is tested. -> (processes, rank 0's stderr)."""
    port, procs = str(_free_port()), []
    for rank in (0, 1):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOGITLAB_TEST_TIMEOUT_S": "3600"}
        procs.append(subprocess.Popen([sys.executable, str(Path(nd.__file__)), str(out), scenario], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    try:
        _, err = procs[0].communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return procs, err


@pytest.mark.slow
def test_killed_rank_stops_a_tensor_parallel_job_with_a_clear_error(tmp_path):
    procs, err = _run_pair_directly(tmp_path, "die-tp_sp")
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
    assert (tmp_path / "runner_tp_sp" / "metrics.jsonl").read_text().count("\n") == nd.STEPS
    nd.main_loop("zero2", tmp_path, info)                # the main loop, one process, then ZeRO-2 on 2 ranks
    loop = [[json.loads(line)["loss"] for line in (tmp_path / f"runner_{name}" / "metrics.jsonl").read_text()
             .splitlines() if "loss" in json.loads(line)] for name in ("loop_none", "loop_zero2")]
    _close(loop[1], loop[0])
