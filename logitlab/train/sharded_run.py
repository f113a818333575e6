"""The main loop (loop.py) on an N-D layout (logitlab.parallel: tensor/sequence and pipeline
parallelism, the ZeRO stages, hybrid meshes) with sharded checkpoints: what differs from one
process, handed to the loop through ParallelHooks by layouts.sharded_hooks.

NDLayout owns this rank's Parallelized model and does the five things the loop leaves to it:
set the run up (build.build_data's sampler and validation tokens, a seed or a resume, the
model parallelised, AdamW over this rank's shards with the main loop's parameter groups), one
micro-step's forward and backward (a pipeline schedule runs them as one), the loss averaged
over the global batch, the validation pass, and the sharded checkpoint. Every rank draws the
main loop's batches (data.RandomWindows), taking the rows of its data-parallel rank: the TP
ranks and pipeline stages of one replica read the same rows, so a layout sees the same data,
in the same order, as one process.

A checkpoint is RUN/dcp-STEP/ (parallel.sharded.save_sharded: every rank writes its shards,
nothing is gathered, the directory appears at once), with rank 0's generator states (rng.pt)
and the run's metrics (metrics.jsonl) inside, and the loop's state (sampler position,
schedule, configs, validation losses) in logitlab_dcp.json. Like the gathered checkpoints,
the newest `keep_last` and the best by validation loss are kept; older ones are renamed, then
deleted (io.checkpoint.delete_checkpoint). A resume reads the newest, whichever mesh wrote it;
a run whose newest checkpoint is the gathered kind (RUN/ckpt-STEP) continues too (load_gathered:
every rank reads the full tensors and keeps its shards), then writes sharded ones.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from logitlab.data import tokens as data_io
from logitlab.io import checkpoint as ckpt_io
from logitlab.parallel import sharded
from logitlab.parallel.apply import Parallelized, parallelize
from logitlab.parallel.mesh import ParallelPlan
from logitlab.parallel.setup import DistInfo
from logitlab.parallel.tensor import loss_parallel_context, split_fused_projections, split_fused_state
from logitlab.train import runtime
from logitlab.train.build import Run, build_data, check_new_run_dir
from logitlab.train.config import TrainConfig
from logitlab.train.loss import IGNORE_INDEX
from logitlab.train.optim import param_groups

CKPT_PREFIX = "dcp-"
RNG_FILE = "rng.pt"


def list_sharded(run_dir: str | Path) -> list[Path]:
    """Complete RUN/dcp-STEP directories, oldest step first (each appears whole: written atomically)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(p.name[len(CKPT_PREFIX):]), p) for p in run_dir.iterdir() if p.is_dir()
             and p.name.startswith(CKPT_PREFIX) and p.name[len(CKPT_PREFIX):].isdigit()
             and (p / sharded.META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_sharded(run_dir: str | Path) -> Path | None:
    found = list_sharded(run_dir)
    return found[-1] if found else None


def resumes_sharded(run_dir: str | Path) -> bool:
    """Whether a resume of `run_dir` starts from a sharded checkpoint: it has one, and no gathered
    checkpoint (ckpt-STEP) of a later step."""
    newest = latest_sharded(run_dir)
    if newest is None:
        return False
    gathered = ckpt_io.latest_checkpoint(run_dir)
    return gathered is None or int(gathered.name[len(ckpt_io.CKPT_PREFIX):]) <= _step_of(newest)


def _step_of(path: Path) -> int:
    return int(path.name[len(CKPT_PREFIX):])


def read_sharded(path: Path) -> dict:
    """A sharded checkpoint's loop state, generator states and metrics, in load_checkpoint's
    shape: {"state", "rng", "metrics", "path"} (the weights are loaded by NDLayout.setup)."""
    meta = sharded.read_meta(path)
    state = {**meta["state"], "step": meta["step"]}
    rng = ckpt_io.load_torch_file(path / RNG_FILE) if (path / RNG_FILE).is_file() else None
    metrics = ckpt_io._read_jsonl(path / ckpt_io.METRICS_FILE) if (path / ckpt_io.METRICS_FILE).is_file() else []
    return {"state": state, "rng": rng, "metrics": metrics, "path": path}


def remove_stale_sharded(run_dir: Path) -> None:
    """What a killed job left of sharded writes and deletions (`.dcp-*.tmp-*`, `.dcp-*.del-*`).
    Call only while holding the run's lock."""
    if run_dir.is_dir():
        for p in run_dir.glob(f".{CKPT_PREFIX}*"):
            if p.is_dir() and (".tmp-" in p.name or ".del-" in p.name):
                shutil.rmtree(p, ignore_errors=True)


def prune_sharded(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` sharded checkpoints and the best by validation loss."""
    found = list_sharded(run_dir)
    keep = set(found[-keep_last:]) if keep_last > 0 else set()
    scored = [(sharded.read_meta(p)["state"].get("val_loss"), p) for p in found]
    scored = [(loss, p) for loss, p in scored if loss is not None]
    if scored:
        best = min(loss for loss, _ in scored)
        keep.add([p for loss, p in scored if loss == best][-1])   # ties: the later one
    removed = [p for p in found if p not in keep]
    for p in removed:
        ckpt_io.delete_checkpoint(p)
    return removed


def dp_coordinates(plan: ParallelPlan, rank: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel degree) of job rank `rank` under a resolved plan: the
    mesh (pp, dp_replicate, dp_shard, tp) numbers ranks in row-major order, as init_device_mesh does."""
    s = (rank // plan.tp) % plan.dp_shard
    r = (rank // (plan.tp * plan.dp_shard)) % plan.dp_replicate
    return r * plan.dp_shard + s, plan.dp


class NDLayout:
    """This rank's part of an N-D layout, as the main loop's hooks (see the module docstring)."""

    def __init__(self, config: TrainConfig, plan: ParallelPlan, info: DistInfo):
        self.config, self.info = config, info
        self.plan = plan.resolve(info.world_size)
        self.par: Parallelized | None = None
        self.loss = None                  # an MoE's RouterLoss (_router_loss), else the cross-entropy
        if self.plan.pp > 1:
            _check_microbatches(config.batch_size, self.plan)

    # -- the set-up ----------------------------------------------------------------------------
    def setup(self, model, config: TrainConfig, run_dir: Path, hooks, resume: bool, device, amp_dtype,
              tokenizer=None, extra_state: dict | None = None) -> Run:
        """build.setup's counterpart: data, a seed or the newest sharded checkpoint's state, the
        model parallelised, AdamW, then the checkpoint's weights, optimizer and generator states."""
        run = build_data(model, config, run_dir, hooks, device, amp_dtype)
        run.tokenizer, run.extra_state = tokenizer, extra_state
        model.to(device).train()
        loaded = self._read_resume(run, resume)
        run.wrapped = hooks.wrap(model)   # run.model stays the unwrapped Transformer (its config, FLOPs)
        self._router_loss(run, model)
        if (self.par.dp.rank, self.par.dp.world_size) != (hooks.rank, hooks.world_size):
            raise RuntimeError(f"data-parallel coordinates {hooks.rank}/{hooks.world_size} of the hooks differ from "
                               f"the mesh's {self.par.dp.rank}/{self.par.dp.world_size}")
        run.optimizer = self.par.build_optimizer(
            config.lr, config.weight_decay, (config.beta1, config.beta2), config.eps,
            param_groups=lambda m: param_groups(m, config.weight_decay, config.decay_embeddings))
        if loaded is not None:
            if run.last_ckpt.name.startswith(CKPT_PREFIX):
                sharded.load_sharded(run.last_ckpt, self.par, run.optimizer)
            else:                         # a gathered checkpoint: each rank keeps its shards of it
                load_gathered(run.last_ckpt, self.par, run.optimizer)
            if loaded["rng"] is not None:
                runtime.restore_rng_state(loaded["rng"])
        return run

    def _read_resume(self, run: Run, resume: bool) -> dict | None:
        if run.par.main:
            remove_stale_sharded(run.run_dir)
            ckpt_io.remove_stale_temporaries(run.run_dir)
        if not resume:
            check_new_run_dir(run.run_dir)
            if latest_sharded(run.run_dir) is not None:
                raise ValueError(f"{run.run_dir} already holds sharded checkpoints; use --resume {run.run_dir} "
                                 "or another --out")
            runtime.seed_everything(run.config.seed)
            return None
        latest = latest_sharded(run.run_dir) if resumes_sharded(run.run_dir) else ckpt_io.latest_checkpoint(run.run_dir)
        if latest is None:
            raise FileNotFoundError(f"--resume: no checkpoint ({CKPT_PREFIX}STEP or {ckpt_io.CKPT_PREFIX}STEP) "
                                    f"in {run.run_dir}")
        loaded = read_sharded(latest) if latest.name.startswith(CKPT_PREFIX) else ckpt_io.load_checkpoint(latest)
        state = loaded["state"]
        run.step, run.best_val, run.metrics = state["step"], state.get("best_val_loss"), loaded["metrics"]
        was = state["sampler"].get("seq_len")
        if was is not None and was != run.seq_len:
            raise ValueError(f"{latest}: windows of {was} tokens, this resume asks for {run.seq_len}: extending the "
                             "context (--context-length, --rope-scaling) is available for runs with gathered "
                             "ckpt-STEP checkpoints, not yet for sharded dcp-STEP ones")
        run.sampler.load_state_dict(state["sampler"])
        run.count_tokens_from(state)
        run.last_ckpt = latest
        return loaded

    def wrap(self, model):
        self.par = parallelize(model, self.plan, self.info, seq_len=self.config.seq_len or model.config.context_length,
                               mixed_precision=self.config.precision == "bf16")
        return self.par.model

    def _router_loss(self, run: Run, model) -> None:
        """An MoE without pipeline or tensor parallelism: the router's losses join the step's
        (train.moe.RouterLoss), the balancing loss counted over the global batch, and logged."""
        if not model.config.is_moe or self.par.pipelined or self.plan.tp > 1:
            return
        from logitlab.train.moe import RouterLoss, RoutingLog

        self.loss = run.compute_loss = RouterLoss(self.par.model, model.config, reduce=self.par.sum_over_dp)
        run.routing = RoutingLog(self.config.router_bias_update_rate)

    # -- a step --------------------------------------------------------------------------------
    def forward_backward(self, wrapped, x: torch.Tensor, y: torch.Tensor, sync: bool, scale: float):
        return self.par.forward_backward(x, y, sync=sync, scale=scale, loss_fn=self.loss)

    def global_mean(self, value: float | None) -> float:
        """The mean over the global batch of a per-rank value (None or ignored on pipeline ranks
        without the last stage; the TP ranks of a replica hold the same value)."""
        return self.par.global_loss(value)

    def clip(self, wrapped, max_norm: float) -> float:
        return self.par.clip_grad_norm(max_norm)

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, run: Run) -> float:
        """The main loop's validation pass (the same windows, this data-parallel rank's share),
        averaged over the global set of windows."""
        rows = run.config.batch_size // run.par.world_size
        windows = data_io.eval_windows(run.val_tokens, run.seq_len, rows, run.config.eval_tokens,
                                       run.par.rank, run.par.world_size)
        for module in self.par.modules:
            module.eval()
        try:
            total, count = 0.0, 0
            for x, y in windows:
                with runtime.autocast(run.device, run.amp_dtype):
                    t, c = self._eval_pipeline(x, y, rows) if self.par.pipelined else self._eval_batch(x, y)
                total, count = total + t, count + c
        finally:
            for module in self.par.modules:
                module.train()
        total, count = self.global_mean(total), self.global_mean(float(count))
        return total / max(count, 1.0)

    def _eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        model, device = self.par.model, self.info.device
        with loss_parallel_context(getattr(model, "module", model)):
            logits = model(x.to(device))                                   # (b, T, V), maybe sharded on V
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum")
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return float(loss), int((y != IGNORE_INDEX).sum())                # a padding batch counts none

    def _eval_pipeline(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple[float, int]:
        """A forward-only schedule step; the stages were built for `rows` rows per step, so a
        shorter last batch is padded with rows whose targets are IGNORE_INDEX (left out)."""
        b, T = x.shape
        pad = rows - b
        if pad:
            x = torch.cat([x, x[-1:].expand(pad, T)])
            y = torch.cat([y, torch.full((pad, T), IGNORE_INDEX, dtype=y.dtype)])
        schedule, m = self.par.schedule, self.par.schedule._n_microbatches
        indices = {i for i, _ in self.par.stages}
        losses: list[torch.Tensor] = []
        args = (x.to(self.info.device),) if 0 in indices else ()
        last = self.par.n_stages - 1 in indices
        kwargs = {"target": y.to(self.info.device), "losses": losses} if last else {}
        schedule._loss_fn.set_scale(1.0)
        schedule.eval(*args, **kwargs)
        if not last:
            return 0.0, 0
        valid = (y != IGNORE_INDEX).reshape(m, -1).sum(dim=1)               # targets per micro-batch
        total = sum(float(v) / schedule._loss_fn.weight * int(n) for v, n in zip(losses, valid) if n > 0)
        return total, int(valid.sum())

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, run: Run, state: dict) -> Path | None:
        """RUN/dcp-STEP (collective), then the old ones pruned -> its path on the main rank."""
        self._check_finite(run.step)
        extra = {}
        if run.par.main:
            buffer = io.BytesIO()
            torch.save(runtime.capture_rng_state(), buffer)
            extra = {RNG_FILE: buffer.getvalue(),
                     ckpt_io.METRICS_FILE: "".join(json.dumps(m) + "\n" for m in run.metrics).encode()}
        path = sharded.save_sharded(run.run_dir / f"{CKPT_PREFIX}{run.step:06d}", self.par, run.optimizer,
                                    step=run.step, state=state, extra_files=extra)
        if not run.par.main:
            return None
        prune_sharded(run.run_dir, run.config.keep_last)
        return path

    def _check_finite(self, step: int) -> None:
        """Every rank's shards are checked, and all ranks agree, before any rank writes."""
        bad = torch.zeros((), dtype=torch.float64, device=self.info.device)
        for p in self.par.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if p.is_floating_point() and not bool(torch.isfinite(local).all()):
                bad += 1
        if dist.is_initialized():
            dist.all_reduce(bad)
        if float(bad) > 0 or not math.isfinite(float(bad)):
            raise ckpt_io.NonFiniteError(f"the weights hold NaN or inf values ({int(float(bad))} tensor shards); "
                                         f"step {step} was not saved")


def _check_microbatches(batch_size: int, plan: ParallelPlan) -> None:
    """Each data-parallel replica's rows of a micro-step must cut into the schedule's micro-batches."""
    m = plan.microbatches()
    if batch_size % (plan.dp * m):
        raise ValueError(f"--pp {plan.pp}: each of the {plan.dp} data-parallel replicas gets {batch_size / plan.dp:g} "
                         f"rows of --batch-size {batch_size}, which do not cut into {m} equal pipeline micro-batches "
                         f"(2 x --pp x --virtual-stages); use a --batch-size that is a multiple of {plan.dp * m}, "
                         "or a layout with fewer data-parallel replicas (a resume keeps the run's --batch-size)")


def _numbered_names(config, n_params: int) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The parameter names behind a gathered optimizer.pt's numbers 0..n-1: optim.param_groups'
    order over the fused Transformer (one process, DDP, FSDP) or over the split one (nd_hooks'
    layouts), told apart by the count. -> (the names, the fused model's parameters on the meta device)."""
    from logitlab.model.transformer import Transformer

    with torch.device("meta"):
        fused, split = Transformer(config), split_fused_projections(Transformer(config))
    for model in (fused, split):
        names = {id(p): name for name, p in model.named_parameters()}
        order = [names[id(p)] for g in param_groups(model, 0.1) for p in g["params"]]
        if len(order) == n_params:
            return order, dict(fused.named_parameters())
    raise ValueError(f"the optimizer state numbers {n_params} parameters; the model has {len(order)}")


def load_gathered(path: Path, par: Parallelized, optimizer) -> None:
    """A gathered checkpoint (RUN/ckpt-STEP: full weights with fused projections, torch.optim's
    numbered state) into this layout: every rank reads the full tensors and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if optimizer is not getattr(optimizer, "optim", optimizer):
        raise ValueError(f"{path}: a gathered checkpoint does not resume into ZeRO-1's partitioned optimizer; "
                         "resume it with --parallel ddp or fsdp")
    config, holder = sharded.par_config(par), sharded._model_of(par)
    weights = split_fused_state(ckpt_io.load_model_state(path), config)
    if config.tie_embeddings:
        weights.setdefault("lm_head.weight", weights["tok_emb.weight"])
    keys = list(get_model_state_dict(holder))   # one order on every rank: each key is a collective
    if set(keys) - set(weights):
        raise ValueError(f"{path}: weights missing for this model: {sorted(set(keys) - set(weights))[:5]}")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(holder, {k: weights[k] for k in keys}, options=options)
    saved = ckpt_io.load_optimizer_state(path)
    names, shapes = _numbered_names(config, sum(len(g["params"]) for g in saved["param_groups"]))
    parts = {n: [k for k in split_fused_state({n: shapes[n]}, config) if k in keys] if n in shapes else
             ([n] if n in keys else []) for n in names}
    state: dict = {}
    for i, name in enumerate(names):   # a fused row block -> its parts; "step" copied (AdamW advances it in place)
        for key, value in saved["state"].get(i, {}).items():
            pieces = split_fused_state({name: value}, config) if getattr(value, "ndim", 0) > 0 else \
                {part: value.clone() if isinstance(value, torch.Tensor) else value for part in parts[name]}
            for part, piece in pieces.items():
                if part in keys:
                    state.setdefault(part, {})[key] = piece
    # the hyperparameters are the checkpoint's; how AdamW runs (fused, foreach: not on DTensors) is this optimizer's
    impl = {k: optimizer.param_groups[0][k] for k in ("fused", "foreach", "capturable", "differentiable")
            if k in optimizer.param_groups[0]}
    groups = [{**g, **impl, "params": [p for i in g["params"] for p in parts[names[i]]]} for g in saved["param_groups"]]
    set_optimizer_state_dict(holder, optimizer, {"state": state, "param_groups": groups}, options=options)
