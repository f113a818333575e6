"""TrainConfig: every setting of a training run (the model's live in ModelConfig), frozen and
validated; each field's help text feeds the CLI's flags."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from logitlab.model.fields import check_field_types, config_from_dict


def _f(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


# The default peak learning rate by model size. Small models train well at a rate ten times
# what GPT-2-sized ones tolerate: on the tiny preset (1 M parameters) one minute of CPU training
# reached a validation loss of 5.45 at 3e-3 and 6.85 at 3e-4.
SMALL_MODEL_PARAMS = 50_000_000
SMALL_MODEL_LR, LARGE_MODEL_LR = 3e-3, 3e-4
DECAY_SHAPES = ("linear", "1-sqrt")
PARALLEL_CHOICES = ("auto", "none", "ddp", "zero1", "zero2", "fsdp")


def default_lr(n_parameters: int) -> float:
    """The peak learning rate a run gets without `lr`: SMALL_MODEL_LR under SMALL_MODEL_PARAMS
    parameters, else LARGE_MODEL_LR."""
    return SMALL_MODEL_LR if n_parameters < SMALL_MODEL_PARAMS else LARGE_MODEL_LR


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run (the model's live in ModelConfig)."""

    data_dir: str | None = _f(None, "prepared token directory (logitlab prepare); default: prepare the stdlib corpus")
    out_dir: str = _f("runs/run", "run directory: checkpoints, metrics.jsonl, plots")
    steps: int = _f(1000, "optimizer steps")
    batch_size: int = _f(16, "sequences per micro-step, summed over all ranks (B)")
    grad_accum: int = _f(1, "micro-steps accumulated per optimizer step")
    seq_len: int | None = _f(None, "tokens per sequence T (default: the model's context_length)")
    lr: float | None = _f(None, "peak learning rate (default: 3e-3 for models under 50 M parameters, as the "
                               "tiny, gpt2-tiny and small presets; 3e-4 from there up, as GPT-2 124M)")
    min_lr: float | None = _f(None, "learning-rate floor of the decay (default: lr / 10 for cosine, 0 for wsd)")
    warmup_steps: int | None = _f(None, "linear warmup steps (default min(100, steps // 10))")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)")
    decay_embeddings: bool = _f(False, "also decay the embedding tables")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    eval_every: int = _f(100, "evaluate every N steps (0 = only at the end)")
    eval_tokens: int = _f(65536, "validation tokens per evaluation (a fixed sequential pass)")
    eval_at_start: bool = _f(True, "also evaluate the untrained model (a step-0 record; about ln V)")
    save_every: int | None = _f(None, "checkpoint every N steps (default eval_every; 0 = only at the end)")
    keep_last: int = _f(2, "checkpoints kept besides the best by validation loss")
    seed: int = _f(1337, "seed of the model init, data order and dropout")
    device: str = _f("auto", "auto, cpu, cuda, cuda:N or mps")
    precision: Literal["auto", "fp32", "bf16"] = _f("auto", "auto = bf16 autocast on capable GPUs, else fp32")
    bf16_matmul: Literal["auto", "native", "fp32"] = _f(
        "auto", "bf16 matrix products and attention on CPU: fp32 = float32 kernels over the bf16-rounded "
        "operands (same values up to summation order), native = bf16 kernels, auto = float32 where it "
        "measures clearly faster (<= 0.9x the time), "
        "measured for the products and for attention apart (kernels.cpu_bf16; the choice goes into metrics.jsonl)")
    keep_freed_memory: Literal["auto", "on", "off"] = _f(
        "off", "CPU: let malloc keep freed tensor memory for reuse rather than page-faulting it in again "
        "every step (glibc; process-wide and permanent, see kernels.allocator.keep_freed_memory); auto = "
        "measured, for compiled fp32 steps: applied after step 3 when the kernel's share of steps 2-3's CPU "
        "time (page faults) is 0.05 or more (kernels.allocator.FaultWatch; the decision goes into metrics.jsonl). "
        "Off unless asked, since it changes the whole process; `logitlab train` asks for auto")
    compile: bool = _f(False, "torch.compile the model")
    attention_kernel: Literal["sdpa", "triton"] = _f(
        "sdpa", "attention on the model's path (sdpa) or logitlab's Triton FlashAttention kernel (triton: "
        "CUDA only, kernels.triton_install)")
    parallel: Literal["auto", "none", "ddp", "zero1", "zero2", "fsdp"] = _f(
        "auto", "under torchrun: data parallel (ddp), ZeRO-1 (optimizer state sharded), ZeRO-2 (+ gradients) "
        "or fully sharded (fsdp, ZeRO-3); none = ignore other ranks; auto (the default) = fsdp when --dp-shard "
        "or --dp-replicate is above 1 or with --tp / --pp, else ddp")
    tp: int = _f(1, "tensor-parallel degree (heads split across ranks; parallel.tensor)")
    pp: int = _f(1, "pipeline-parallel stages (layers split across ranks; parallel.pipeline)")
    dp_shard: int = _f(-1, "data-parallel ranks that shard the model (-1: what the world size leaves)")
    dp_replicate: int = _f(1, "data-parallel replicas of the sharded groups (HSDP when > 1)")
    sequence_parallel: bool = _f(False, "with --tp: norms and residuals sharded along the sequence")
    ep: int = _f(1, "expert-parallel degree of a mixture of experts: each MoE layer's experts spread over ep "
                    "of the --dp-shard ranks, tokens sent to them by all-to-all (parallel.expert; needs fsdp)")
    activation_checkpointing: Literal["none", "selective", "full"] = _f(
        "none", "recompute activations in backward: none, selective (keep matmul and attention outputs) or "
        "full (per block)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = _f("1f1b", "pipeline schedule (with --pp)")
    virtual_stages: int | None = _f(None, "pipeline stages per rank (interleaved_1f1b: 2 or more, default 2; "
                                          "the other schedules: 1)")
    dist_timeout: float = _f(300.0, "under torchrun: seconds a collective waits for the other ranks before the "
                                    "run stops with an error naming this rank and the collective")
    log_every: int = _f(1, "metrics record every N steps")
    time_limit_s: float | None = _f(None, "time budget in seconds: `logitlab train` times a step first and fits "
                                          "the step count (at most --steps when given), warmup and cosine inside "
                                          "it; the run stops (evaluates, saves) after the step that passes it")
    tensorboard: bool = _f(True, "also write TensorBoard events when tensorboard is installed")
    # --- the optimizer and the schedule (train/optim.py, train/muon.py) ---
    optimizer: Literal["adamw", "muon"] = _f(
        "adamw", "adamw, or muon: Muon (momentum orthogonalised by Newton-Schulz) for the 2-D hidden matrices "
        "and AdamW for embeddings, head, gains and biases (MuonAdamW)")
    lr_schedule: Literal["cosine", "wsd"] = _f(
        "cosine", "warmup then cosine decay to min_lr, or wsd: warmup, constant, then a decay to min_lr over "
        "the last decay_fraction of the steps (a run stopped in its constant phase continues with more --steps)")
    decay_fraction: float = _f(0.2, "wsd: share of the steps spent decaying")
    decay_shape: Literal["linear", "1-sqrt"] = _f("linear", "wsd: linear or 1-sqrt decay")
    embedding_lr: float | None = _f(None, "peak learning rate of the embedding tables (default lr)")
    head_lr: float | None = _f(None, "peak learning rate of an untied LM head (default lr)")
    matrix_lr: float | None = _f(None, "peak learning rate of the hidden matrices (default: lr for adamw, "
                                       "0.02 for muon, in spectral norm per step)")
    muon_momentum: float = _f(0.95, "muon: momentum of the matrices (Nesterov)")
    muon_ns: Literal["quintic", "polar_express"] = _f(
        "quintic", "muon: orthogonalisation polynomial, quintic (Jordan et al.) or polar_express (Amsel et al.)")
    muon_ns_steps: int = _f(5, "muon: Newton-Schulz iterations")
    muon_weight_decay: float = _f(0.0, "muon: decoupled weight decay of the matrices")
    router_bias_update_rate: float = _f(
        0.0, "MoE with router=sigmoid_topk: after each step move each expert's selection bias by this toward "
        "balance (auxiliary-loss-free balancing, DeepSeek-V3 used 0.001; train.moe.update_correction_bias)")

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL_CHOICES:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL_CHOICES)}, got {self.parallel!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision must be 'auto', 'fp32' or 'bf16', got {self.precision!r}")
        if self.keep_freed_memory not in ("auto", "on", "off"):
            raise ValueError(f"keep_freed_memory must be 'auto', 'on' or 'off', got {self.keep_freed_memory!r}")
        check_field_types(self)  # then types: a string "3e-4" for lr is named, and every float is finite
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", min(100, self.steps // 10))
        self._check_ranges()

    @property
    def data_parallel(self) -> str:
        """`parallel` with "auto" decided: fsdp when the layout shards (dp_shard or dp_replicate
        above 1) or cuts the model (tp, pp, ep: plain DDP cannot be combined with them), else ddp."""
        if self.parallel != "auto":
            return self.parallel
        sharded = self.dp_shard > 1 or self.dp_replicate > 1 or self.tp > 1 or self.pp > 1 or self.ep > 1
        return "fsdp" if sharded else "ddp"

    @property
    def pipeline_virtual_stages(self) -> int:
        """virtual_stages decided: 2 for interleaved_1f1b unless set, else 1."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.pp_schedule == "interleaved_1f1b" else 1

    def parallel_plan(self):
        """The layout of this run's ranks (parallel.mesh.ParallelPlan; checked against the world
        size when the ranks start)."""
        from logitlab.parallel.mesh import ParallelPlan

        return ParallelPlan(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, ep=self.ep,
                            parallel=self.data_parallel if self.data_parallel != "none" else "ddp",
                            sequence_parallel=self.sequence_parallel,
                            activation_checkpointing=self.activation_checkpointing, pp_schedule=self.pp_schedule,
                            virtual_stages=self.pipeline_virtual_stages if self.pp > 1 else 1)

    def needs_nd_loop(self) -> bool:
        """Tensor, pipeline or expert parallel, or ZeRO-1: layouts with sharded checkpoints
        (train.layouts.sharded_hooks runs them through the main loop)."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1 or self.data_parallel == "zero1"

    def _check_ranges(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_tokens", "keep_last", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.virtual_stages is not None and (self.virtual_stages < 1 or (
                self.virtual_stages > 1) != (self.pp_schedule == "interleaved_1f1b")):
            raise ValueError(f"virtual_stages ({self.virtual_stages}) must be >= 2 with pp_schedule "
                             f"interleaved_1f1b and 1 with {self.pp_schedule!r}")
        for name in ("time_limit_s", "seq_len", "dist_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (math.inf if self.lr is None else self.lr):
            raise ValueError(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        self._check_recipe()
        if self.router_bias_update_rate < 0:
            raise ValueError(f"router_bias_update_rate must be >= 0, got {self.router_bias_update_rate}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.eps <= 0:
            raise ValueError(f"weight_decay ({self.weight_decay}) and grad_clip ({self.grad_clip}) must be "
                             f">= 0 and eps ({self.eps}) > 0")

    def _check_recipe(self) -> None:
        """The optimizer and schedule settings (optimizer, lr_schedule, their rates and shapes)."""
        for name in ("embedding_lr", "head_lr", "matrix_lr"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.decay_shape not in DECAY_SHAPES:                   # optim.DECAY_SHAPES (torch not imported)
            raise ValueError(f"decay_shape must be one of {DECAY_SHAPES}, got {self.decay_shape!r}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.muon_ns_steps <= 0 or self.muon_weight_decay < 0:
            raise ValueError(f"muon_ns_steps ({self.muon_ns_steps}) must be > 0 and muon_weight_decay "
                             f"({self.muon_weight_decay}) >= 0")
        if self.optimizer == "muon" and self.needs_nd_loop():
            raise ValueError("optimizer='muon' runs with one process, ddp, zero2 and fsdp; not yet with --tp, --pp "
                             "or --parallel zero1 (their optimizers are built by the sharded layouts)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Inverse of to_dict; unknown keys are an error naming them."""
        return config_from_dict(cls, data)

    def for_model(self, model) -> "TrainConfig":
        """This config with `lr` filled in for `model` when it was left to the default (default_lr)."""
        if self.lr is not None:
            return self
        return dataclasses.replace(self, lr=default_lr(sum(p.numel() for p in model.parameters())))

    def schedule(self):
        """The learning-rate schedule: optim.WarmupCosine or optim.WarmupStableDecay (lr_schedule) of
        this config's numbers."""
        from logitlab.train.optim import WarmupCosine, WarmupStableDecay

        if self.lr is None:
            raise ValueError("lr is not set: TrainConfig.for_model(model) chooses the default for a model")
        if self.lr_schedule == "wsd":
            return WarmupStableDecay(self.lr, self.warmup_steps, self.steps, self.min_lr or 0.0,
                                     self.decay_fraction, self.decay_shape)
        min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        return WarmupCosine(self.lr, self.warmup_steps, self.steps, min_lr)


@dataclass(frozen=True)
class SFTConfig:
    """What SFT adds to TrainConfig: the conversations and how they become rows."""

    data: str = field(default="", metadata={"help": "conversations (.jsonl: messages, or prompt/completion)"})
    val_data: str | None = field(default=None, metadata={"help": "held-out conversations (default: a split)"})
    val_fraction: float = field(default=0.1, metadata={"help": "share held out when val_data is not given"})
    train_on: Literal["all", "assistant", "last"] = field(
        default="assistant", metadata={"help": "loss on all tokens, every assistant turn, or the last one"})
    pack: bool = field(default=True, metadata={"help": "pack conversations into rows (False: one per row, padded)"})

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("SFTConfig.data is empty: give a .jsonl file of conversations")
        if self.train_on not in ("all", "assistant", "last"):          # data.sft.TRAIN_ON
            raise ValueError(f"train_on must be one of ('all', 'assistant', 'last'), got {self.train_on!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
