"""The training loop in reusable parts: TrainConfig, the loss, evaluation, the loop with its
checkpoints (loop.py), AdamW and its schedule (optim.py), devices, autocast and generator
states (runtime.py), fitting the schedule into a time budget (budget.py).

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "TrainConfig": "loop",
    "TrainResult": "loop",
    "TrainingDiverged": "loop",
    "cross_entropy": "loop",
    "evaluate": "loop",
    "loss_fn": "loop",
    "train": "loop",
}

__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "cross_entropy", "evaluate", "loss_fn", "train"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
