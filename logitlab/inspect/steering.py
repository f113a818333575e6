"""Steering: a direction in the residual stream, found from contrastive prompts and added while the
model runs (activation addition: Turner et al. 2023; contrastive activation addition: Rimsky et al.
2024).

The direction is a difference of means: the residual stream after block `layer` (hook point
blocks.{layer}.resid_post), averaged over the positions of each prompt and then over the prompts of
each set,

    v = mean_{p in positive} mean_t h_p[t]  -  mean_{p in negative} mean_t h_p[t]       (D,)

and steering adds scale * v to that hook point at every position of every forward (the prompt and
each decoded token) while the `steer(...)` block lasts. It is a hook, so generate, chat and serve
run it unchanged, with or without a KV cache. A direction is saved as one safetensors tensor
"direction" (D,) with the layer and the model's d_model in the file's metadata.

Shapes: T positions, D d_model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from logitlab.model.hooks import add_hooks, run_with_cache


@dataclass(frozen=True)
class Steering:
    """A direction (D,) float32 to add after block `layer`, `scale` times."""

    direction: torch.Tensor
    layer: int
    scale: float = 1.0

    def __post_init__(self):
        if not isinstance(self.direction, torch.Tensor) or self.direction.ndim != 1:
            raise ValueError(f"a steering direction is one vector (D,), got {getattr(self.direction, 'shape', None)}")
        if not bool(torch.isfinite(self.direction).all()):
            raise ValueError("the steering direction holds NaN or inf")
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"steering layer must be an integer >= 0, got {self.layer!r}")
        if not isinstance(self.scale, (int, float)) or not abs(self.scale) < float("inf"):
            raise ValueError(f"steering scale must be a finite number, got {self.scale!r}")


def _check_layer(model, layer: int) -> None:
    L = model.config.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"steering layer {layer!r} is outside the model's blocks 0..{L - 1}")


def mean_residual(model, prompts: Sequence[Sequence[int]], layer: int) -> torch.Tensor:
    """(D,) float32: blocks.{layer}.resid_post averaged over each prompt's positions, then over prompts."""
    _check_layer(model, layer)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("a steering direction needs at least one prompt in each set, each of at least one token")
    name = f"blocks.{layer}.resid_post"
    means = [run_with_cache(model, list(p), [name])[1][name][0].float().mean(dim=0) for p in prompts]   # (D,) each
    return torch.stack(means).mean(dim=0)


def steering_direction(model, positive: Sequence[Sequence[int]], negative: Sequence[Sequence[int]],
                       layer: int) -> torch.Tensor:
    """The difference of means (D,) float32 between two sets of prompts (lists of token ids) at the
    residual stream after block `layer`."""
    return mean_residual(model, positive, layer) - mean_residual(model, negative, layer)


def add_steering(model, steering: Steering) -> Callable[[], None]:
    """Add scale * v to blocks.{layer}.resid_post at every position of every forward from now on,
    until the returned function is called (a served model's steering); prefer `with steer(...)`."""
    _check_layer(model, steering.layer)
    D = model.config.d_model
    if steering.direction.shape != (D,):
        raise ValueError(f"the steering direction has {steering.direction.shape[0]} numbers; this model's "
                         f"d_model is {D}")
    add = (steering.scale * steering.direction.float()).to(next(model.parameters()).device)

    def fn(h: torch.Tensor, name: str) -> torch.Tensor:
        return h + add.to(h.dtype)                                 # (B, T, D) + (D,)
    return add_hooks(model, {f"blocks.{steering.layer}.resid_post": fn})


@contextmanager
def steer(model, steering: Steering):
    """`with steer(model, Steering(v, layer, scale)):` every forward inside adds scale * v to
    blocks.{layer}.resid_post at every position; removed on the way out, error or not."""
    remove = add_steering(model, steering)
    try:
        yield model
    finally:
        remove()


def save_steering(path, direction: torch.Tensor, layer: int, *, overwrite: bool = False) -> Path:
    """Write `direction` (D,) and its layer to a safetensors file, atomically; an existing file is
    refused unless overwrite."""
    from safetensors.torch import save

    from logitlab.io.files import atomic_write_bytes

    Steering(direction, layer)                                    # the checks
    path = Path(path)
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists; choose another name or pass overwrite=True")
    meta = {"layer": str(layer), "d_model": str(direction.shape[0]), "format": "logitlab-steering"}
    return atomic_write_bytes(path, save({"direction": direction.detach().float().contiguous().cpu()}, metadata=meta))


def load_steering(path, scale: float = 1.0, layer: int | None = None) -> Steering:
    """A Steering from a file save_steering wrote; `layer` overrides the file's."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"steering file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, keys = f.metadata() or {}, list(f.keys())
            direction = f.get_tensor("direction") if "direction" in keys else None
    except Exception as e:                                         # noqa: BLE001  (a file that is not safetensors)
        raise ValueError(f"{path} is not a safetensors file: {e}") from None
    if direction is None or meta.get("format") != "logitlab-steering" or not meta.get("layer", "").isdigit():
        raise ValueError(f"{path} is not a steering file (a tensor 'direction' and metadata format="
                         f"logitlab-steering, layer; inspect --steer-save writes one)")
    return Steering(direction.float(), int(meta["layer"]) if layer is None else layer, scale)
