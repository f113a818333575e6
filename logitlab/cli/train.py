"""Subcommands of the training stage: train, plot, export (registered by main.py; plot runs from
cli/data.py, which also registers prepare).

This module turns flags and TOML into TrainConfig / ModelConfig, draws progress bars and tables,
and strings the library calls together; the work itself lives in logitlab.train, logitlab.data and
logitlab.io. `logitlab demo` (cli/demo.py) strings these same pieces together.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from logitlab.cli import common as cli
from logitlab.cli import export
from logitlab.cli.data import (  # noqa: F401  (_prepare, _train_tokenizer, plot_run: also demo's)
    EOT,
    _add_data_flags,
    _prepare,
    _train_tokenizer,
    cmd_plot,
    plot_run,
)
from logitlab.cli.extend import EXTEND_MAY_CHANGE, extend_run, show_extension
from logitlab.cli.launched import env_world_size, fit_resumed_mesh
from logitlab.cli.progress import LiveProgress
from logitlab.cli.train_budget import PlanView, few_steps_warning, fit_time_budget, given

# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------

def exit_code(result) -> int:
    """0 for a finished run (or one stopped by its time limit); 128 + the signal's number for a
    run stopped by SIGINT (130) or SIGTERM (143), as a shell reports them, so scripts can tell;
    1 for a rank that stopped because its launcher (torchrun's agent) died."""
    if result.stopped == "launcher":
        return 1
    return 128 + (result.signal or 2) if result.stopped == "signal" else 0


def _run_training(model, train_cfg, tokenizer, con, progress: bool, resume: bool, parallel=None,
                  lock: bool = True, time_fit=None):
    """train() with the CLI's view: the live bar in a terminal, elsewhere (a pipe, a log) its lines
    and a status line now and then (train.progress.TextProgress); a time fit's plans (PlanView)."""
    from logitlab.train.loop import train
    from logitlab.train.progress import TextProgress, chain
    from logitlab.train.timefit import FEW_STEPS

    live, plans = LiveProgress(con, progress), PlanView(con)
    status = TextProgress(con.file, status_only=True) if progress and not (con.is_terminal or con.quiet) else None
    try:
        result = train(model, train_cfg, tokenizer=tokenizer, resume=resume, parallel=parallel, lock=lock,
                       progress=chain(live, status, plans), time_fit=time_fit)
    finally:
        live.close()
    if result.stopped == "time":
        con.print(f"[yellow]time limit reached at step {result.step} of {plans.steps or train_cfg.steps}[/yellow]")
        if time_fit is not None and result.step < FEW_STEPS and not plans.warned:
            con.print(f"[yellow]warning: {few_steps_warning(result.step)}[/yellow]")
    if result.stopped == "signal":
        con.print(f"[yellow]stopped by a signal at step {result.step}; checkpoint {result.checkpoint}[/yellow]")
    elif result.stopped == "launcher":
        con.print(f"[yellow]the launcher (torchrun) died: stopped at step {result.step}; checkpoint "
                  f"{result.checkpoint} (continue with --resume)[/yellow]")
    else:
        # no step ran (a resumed run that had already finished): no loss to show
        loss = f", loss {result.last_loss:.4f}" if result.last_loss is not None else ""
        val = f", val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        con.print(f"done: {result.step} steps{loss}{val}; checkpoint {result.checkpoint}")
    return result


# --------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------

def _model_config(args, table: dict, tokenizer):
    from logitlab.model.families import get_preset
    from logitlab.model.transformer import ModelConfig

    if getattr(args, "rope_scaling_spec", None):
        raise ValueError("--rope-scaling extends a trained run: use it with --resume RUN_DIR and a longer "
                         "--context-length (a new run sets rope_scaling in its TOML [model.rope_scaling] table)")
    # no preset and no [model] table: the CPU-sized "tiny" preset rather than GPT-2's 124M defaults
    preset = args.preset or table.get("preset") or (None if "model" in table else "tiny")
    base = _underived(get_preset(preset)) if preset else {}
    merged = {**base, **_recipe(args, table).model, **table.get("model", {})}
    if tokenizer is not None:
        merged["vocab_size"] = tokenizer.vocab_size
    cfg = cli.build_config(ModelConfig, args, merged)
    if tokenizer is not None and cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size ({cfg.vocab_size}) is smaller than the tokenizer's ({tokenizer.vocab_size})")
    return cfg


def _experts_line(model) -> str:
    """For a mixture of experts: its experts and the parameters a token uses."""
    c = model.config
    if not c.is_moe:
        return ""
    from logitlab.model.accounting import count_parameters

    active = count_parameters(model).active
    return (f"; {c.n_experts} experts, {c.n_experts_per_token} per token: {active / 1e6:.2f} M active "
            f"(balancing loss x {c.router_aux_loss_coef:g}, z-loss x {c.router_z_loss_coef:g})")


def _underived(cfg) -> dict:
    from logitlab.model.families import underived_fields

    return underived_fields(cfg)


def cmd_train(args) -> int:
    """One process, or one rank of a torchrun job (RANK/WORLD_SIZE set): then rank 0 trains the
    tokenizer and prepares the data while the others wait, and only rank 0 prints and writes."""
    import os

    from logitlab.train.loop import TrainConfig, parallel_hooks

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return _train_one(args, cli.console(), None)
    from logitlab import parallel as P

    if args.resume and (Path(args.resume) / "run.json").is_file():
        table = {"train": _read_run(args.resume)["train"]}
    else:
        table = cli.read_toml(args.config) if args.config else {}
    cfg = cli.build_config(TrainConfig, args, _train_table(args, table))
    if args.resume:
        cfg = fit_resumed_mesh(args, cfg, env_world_size())
    # the layout's hooks (train.layouts.parallel_hooks): DDP / FSDP2, an N-D data-parallel mesh, or
    # tensor / pipeline parallel and ZeRO-1 (and any resume of a sharded checkpoint) with sharded checkpoints
    hooks = parallel_hooks(cfg, run_dir=args.resume, resume=bool(args.resume))
    con = cli.console() if hooks.main else _quiet_console()
    if hooks.layout:
        con.print(f"layout: {hooks.layout} (export one with `logitlab export RUN_DIR/dcp-STEP --out DIR`)")
    try:
        with P.rank_failure_guard():
            return _train_one(args, con, hooks)
    finally:
        P.destroy()


def _quiet_console():
    from rich.console import Console

    return Console(quiet=True)


def _train_one(args, con, hooks) -> int:
    """Validate every setting, then (holding the run directory's lock on the writing process)
    train or resume."""
    from logitlab.io.files import RunLock
    from logitlab.train.loop import TrainConfig

    main = hooks is None or hooks.main
    if args.resume:
        run = _resume_configs(args)
        out = Path(args.resume)
    else:
        table = cli.read_toml(args.config) if args.config else {}
        # every config error is reported before anything is written (the vocabulary size comes later)
        train_cfg = cli.build_config(TrainConfig, args, _train_table(args, table))
        _model_config(args, table, None)
        out = Path(train_cfg.out_dir)
        _check_sources(args, train_cfg)
    with RunLock(out) if main else contextlib.nullcontext():
        if args.resume:
            return _resume(args, run, con, hooks)
        return _start(args, table, train_cfg, con, hooks)


# What the command line chooses where the library leaves a process-wide setting off: a user who
# runs `logitlab train` owns the process (TrainConfig.keep_freed_memory; --keep-freed-memory off).
CLI_TRAIN_DEFAULTS = {"keep_freed_memory": "auto"}


def _recipe(args, table: dict):
    """--recipe NAME (or the TOML's recipe key): train.recipes.Recipe, its fields beneath the TOML's and
    the flags (an empty one without)."""
    from logitlab.train.recipes import Recipe, get_recipe

    name = getattr(args, "recipe", None) or table.get("recipe")
    return get_recipe(name) if name else Recipe("none")


def _train_table(args, table: dict) -> dict:
    """TrainConfig fields before the flags: the CLI's defaults, the recipe's, the TOML's [train] table."""
    return {**CLI_TRAIN_DEFAULTS, **_recipe(args, table).train, **table.get("train", {})}


# Settings that may change when a run resumes: how long it runs, how often it evaluates, saves and
# logs, and how fast (device, compile, matmul and allocator modes). Everything else would make the
# resumed run a different run, so a flag that changes it is refused. --steps moves the end of the
# cosine schedule with the run's end.
RESUME_MAY_CHANGE = ("steps", "eval_every", "eval_tokens", "eval_at_start", "save_every", "keep_last", "log_every",
                     "time_limit_s", "tensorboard", "device", "compile", "bf16_matmul", "keep_freed_memory",
                     "attention_kernel",
                     # the layout: a checkpoint loads into any mesh (train.layouts.parallel_hooks)
                     "tp", "pp", "ep", "dp_shard", "dp_replicate", "parallel", "sequence_parallel",
                     "activation_checkpointing", "pp_schedule", "virtual_stages", "dist_timeout")


def _read_run(run_dir) -> dict:
    from logitlab.io.files import read_json

    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no run.json there (not a run directory)")
    run = read_json(path, "run file")
    if not isinstance(run, dict) or not isinstance(run.get("train"), dict) or not isinstance(run.get("model"), dict):
        raise ValueError(f"{path}: not a logitlab run file (expected the objects \"train\" and \"model\")")
    return run


def _resume_configs(args) -> dict:
    """run.json of the run, and the typed flags checked against it: only RESUME_MAY_CHANGE may
    differ; a model, data or tokenizer flag that conflicts is an error listing them all."""
    import dataclasses

    from logitlab.model.transformer import ModelConfig
    from logitlab.train.loop import TrainConfig

    run = _read_run(args.resume)
    extending = extend_run(args, run)   # --context-length/--rope-scaling: run["model"] is the extended model
    conflicts = []
    for name in (f.name for f in dataclasses.fields(ModelConfig)):
        if extending and name == "context_length":
            continue
        if hasattr(args, name) and getattr(args, name) != run["model"].get(name):
            conflicts.append(f"--{name.replace('_', '-')} {getattr(args, name)} (the run has {run['model'].get(name)})")
    for name in (f.name for f in dataclasses.fields(TrainConfig)):
        if name in RESUME_MAY_CHANGE or name == "out_dir" or not hasattr(args, name):
            continue
        if extending and name in EXTEND_MAY_CHANGE:
            continue
        value = getattr(args, name)
        value = tuple(value) if isinstance(value, list) else value
        if value != run["train"].get(name):
            conflicts.append(f"--{name.replace('_', '-')} {value} (the run has {run['train'].get(name)})")
    for flag in ("config", "preset", "recipe", "tokenizer", "data"):
        if getattr(args, flag, None):
            conflicts.append(f"--{flag} (the run keeps its own)")
    if conflicts:
        may = ", ".join("--" + n.replace("_", "-") for n in RESUME_MAY_CHANGE)
        raise ValueError(f"--resume {args.resume}: these flags conflict with the run: {'; '.join(conflicts)}. "
                         f"A resumed run may change only {may}")
    return run


def _resume(args, run: dict, con, hooks) -> int:
    import torch

    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.tokenizer.core import Tokenizer
    from logitlab.train.loop import TrainConfig

    train_cfg = cli.build_config(TrainConfig, args, run["train"], out_dir=str(args.resume))
    model_cfg = ModelConfig.from_dict(run["model"])
    tok_file = Path(args.resume) / "tokenizer.logitlab.json"
    tokenizer = Tokenizer.load(tok_file) if tok_file.is_file() else None
    torch.manual_seed(train_cfg.seed)
    result = _run_training(Transformer(model_cfg), train_cfg, tokenizer, con, args.progress, True, hooks, lock=False)
    show_extension(Path(args.resume), con, result)
    return exit_code(result)


def _check_sources(args, train_cfg) -> None:
    """Missing data files and a token directory without a manifest are named before anything is written."""
    from logitlab.data.tokens import read_manifest, resolve_sources

    if args.data:
        resolve_sources(args.data)
    if train_cfg.data_dir:
        read_manifest(train_cfg.data_dir)


def _start(args, table: dict, train_cfg, con, hooks) -> int:
    import torch

    from logitlab.model.transformer import Transformer
    from logitlab.tokenizer.core import Tokenizer
    from logitlab.train.loop import check_new_run_dir

    main = hooks is None or hooks.main
    tokenizer_path = args.tokenizer or table.get("tokenizer")
    out = Path(train_cfg.out_dir)
    check_new_run_dir(out)
    if train_cfg.data_dir:
        tokenizer_path = tokenizer_path or Path(train_cfg.data_dir) / "tokenizer.logitlab.json"
    prepared = out / "data"
    if main:
        tokenizer = Tokenizer.load(tokenizer_path) if tokenizer_path else None
        if tokenizer is None:
            tokenizer = _train_tokenizer(args.data, args.tokenizer_vocab, args.tokenizer_bytes, con,
                                         args.text_field, args.column)
        if not train_cfg.data_dir:
            _prepare(args, tokenizer, prepared, con)
    if hooks is not None:
        hooks.barrier()  # the other ranks read what rank 0 prepared
        if not main:
            tokenizer = Tokenizer.load(tokenizer_path or prepared / "tokenizer.logitlab.json")
    if not train_cfg.data_dir:
        train_cfg = dataclasses.replace(train_cfg, data_dir=str(prepared))
    model_cfg = _model_config(args, table, tokenizer)
    torch.manual_seed(train_cfg.seed)
    model = Transformer(model_cfg)
    n = sum(p.numel() for p in model.parameters())
    con.print(f"model: {n / 1e6:.2f} M parameters, L={model_cfg.n_layers} D={model_cfg.d_model} "
              f"H={model_cfg.n_heads} V={model_cfg.vocab_size} T={train_cfg.seq_len or model_cfg.context_length}"
              + _experts_line(model))
    train_cfg, time_fit = fit_time_budget(args, table, train_cfg.for_model(model), model, con, hooks)
    con.print(f"learning rate {train_cfg.lr:g}" + ("" if given(args, table, "lr") else
              " (the default for a model of this size: 3e-3 under 50 M parameters, else 3e-4)"))
    result = _run_training(model, train_cfg, tokenizer, con, args.progress, False, hooks, lock=False,
                           time_fit=time_fit)
    return exit_code(result)


# --------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------

_EXAMPLES = {
    "train": "examples:\n  logitlab train --data tinyshakespeare.txt --steps 2000 --out runs/a\n"
             "  logitlab train --data-dir data/ --preset tiny --d-model 256 --lr 1e-3\n"
             "  logitlab train --config run.toml --lr 3e-4\n  logitlab train --resume runs/a --steps 4000",
    "plot": "example:\n  logitlab plot runs/a            # writes runs/a/loss.png",
}


def _subparser(subparsers, name: str, summary: str, description: str):

    return subparsers.add_parser(name, help=summary, description=description, epilog=_EXAMPLES[name],
                                 formatter_class=cli.ExamplesFormatter)


def _model_help_defaults() -> dict:
    """What train's model flags default to: the tiny preset's fields (V: the tokenizer's)."""
    from logitlab.model.families import get_preset

    shown = dict(_underived(get_preset("tiny")))
    shown["vocab_size"] = "the tokenizer's"
    return shown


def register(subparsers) -> None:
    """Add train, plot and export to `subparsers` (prepare is cli/data.py's)."""
    from logitlab.model.config import ModelConfig
    from logitlab.train.config import TrainConfig

    p = _subparser(subparsers, "train", "train a model (flags override --config FILE.toml)",
                   "Train a model: trains a tokenizer and prepares --data unless given --tokenizer / "
                   "--data-dir. Settings come from, in increasing priority: defaults, --config FILE.toml, flags.")
    p.add_argument("--config", help="TOML file: [train] and [model] tables, optional preset/tokenizer keys "
                   "(default: none)")
    p.add_argument("--preset", help="model preset name (logitlab.families; model flags override its fields) "
                   "(default: tiny, unless the TOML has a [model] table)")
    p.add_argument("--recipe", help="training recipe (logitlab.train.recipes: speedrun = Muon, WSD, ReLU², QK-norm, "
                   "value embeddings, soft-capping...); the TOML and flags override its fields (default: none)")
    p.add_argument("--tokenizer", help="tokenizer file (default: the data dir's, or train one)")
    p.add_argument("--tokenizer-vocab", type=int, default=4096,
                   help="vocab size when training a tokenizer (default: 4096)")
    p.add_argument("--tokenizer-bytes", type=int, default=2_000_000,
                   help="characters of text used to train it (default: 2000000)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its latest checkpoint (default: "
                   "a new run)")
    p.add_argument("--rope-scaling", dest="rope_scaling_spec", metavar="KIND[:FACTOR]",
                   help="with --resume and a longer --context-length: extend the trained model and fine-tune it "
                   "there, RoPE scaled by KIND (none, linear, ntk, dynamic, yarn) with FACTOR (when omitted: "
                   "new length / old); weights and optimizer state carry over (default: none)")
    cli.add_progress_flag(p)
    _add_data_flags(p)
    cli.add_config_flags(p, TrainConfig, shown_defaults=CLI_TRAIN_DEFAULTS, renamed={"out_dir": "--out"})
    # attention is not a flag: `train` is next-token prediction, which needs causal attention (an
    # encoder trains with the masked-LM objective in Python: docs/lessons/encoder-and-decoder.md)
    cli.add_config_flags(p, ModelConfig, shown_defaults=_model_help_defaults(), skip=("attention",),
                         description="Defaults shown are the tiny preset's (the model without --preset or a "
                         "[model] table); another preset sets its own, and a flag overrides either.")
    p.set_defaults(func=cmd_train)

    p = _subparser(subparsers, "plot", "PNG of train/val loss, learning rate and grad norm",
                   "Plot a run's metrics.jsonl: train/validation loss, learning rate and gradient norm.")
    p.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
    p.add_argument("--out", help="PNG path (default: RUN_DIR/loss.png)")
    p.set_defaults(func=cmd_plot)

    export.register(subparsers)
