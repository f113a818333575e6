"""`logitlab train` on torchrun's ranks: the parallel flags parse, and a resume on another number of
ranks infers the data-parallel dimensions of the run's mesh (cli/launched.py)."""

from __future__ import annotations

import argparse

import pytest

from logitlab.cli.launched import fit_resumed_mesh
from logitlab.cli.main import build_parser
from logitlab.train.config import TrainConfig


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(resume="runs/a", **given)


def test_parallel_flags_parse_into_the_train_config():
    args = build_parser().parse_args(["train", "--tp", "2", "--pp", "2", "--dp-shard", "2", "--pp-schedule",
                                      "interleaved_1f1b", "--virtual-stages", "3", "--dist-timeout", "45"])
    cfg = TrainConfig(**{k: getattr(args, k) for k in ("tp", "pp", "dp_shard", "pp_schedule", "virtual_stages",
                                                        "dist_timeout")})
    plan = cfg.parallel_plan().resolve(8)
    assert (plan.parallel, plan.virtual_stages, cfg.dist_timeout) == ("fsdp", 3, 45.0)
    assert build_parser().parse_args(["train", "--parallel", "auto"]).parallel == "auto"


def test_a_resume_on_another_world_size_infers_the_data_parallel_dimensions():
    run = TrainConfig(tp=2, dp_shard=2)                          # started on 4 ranks
    args = _args()
    fitted = fit_resumed_mesh(args, run, 2)                      # resumed on 2: --dp-shard takes what is left
    assert (fitted.tp, fitted.dp_shard, args.dp_shard) == (2, -1, -1)
    assert fitted.parallel_plan().resolve(2).shape == (1, 1, 1, 2)
    hsdp = TrainConfig(dp_replicate=2, dp_shard=2)               # HSDP on 4 ranks, resumed on 3: FSDP over 3
    args = _args()
    fitted = fit_resumed_mesh(args, hsdp, 3)
    assert (fitted.dp_replicate, fitted.dp_shard, args.dp_replicate, args.dp_shard) == (1, -1, 1, -1)
    assert fit_resumed_mesh(_args(), hsdp, 4) is hsdp           # it fits: the run's own layout
    assert fit_resumed_mesh(_args(), hsdp, 6).parallel_plan().resolve(6).shape == (1, 2, 3, 1)


def test_a_resume_keeps_the_mesh_flags_given_and_names_what_cannot_be_inferred():
    run = TrainConfig(tp=2, dp_shard=2)
    given = _args(dp_shard=2)                                     # the user's choice is theirs to get right
    assert fit_resumed_mesh(given, run, 2) is run
    with pytest.raises(ValueError, match=r"--resume runs/a: the run's layout --tp 2 --pp 2 needs a multiple of 4 "
                                         r"ranks, and this job has 2; give --tp and --pp that fit"):
        fit_resumed_mesh(_args(), TrainConfig(tp=2, pp=2, dp_shard=2), 2)
