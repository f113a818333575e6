"""The training loop in reusable parts: TrainConfig, the loss, evaluation, the loop with its
checkpoints (loop.py), AdamW and its schedule (optim.py), devices, autocast and generator
states (runtime.py), fitting the schedule into a time budget (budget.py)."""

from logitlab.train.loop import (
    TrainConfig,
    TrainingDiverged,
    TrainResult,
    cross_entropy,
    evaluate,
    loss_fn,
    train,
)

__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "cross_entropy", "evaluate", "loss_fn", "train"]
