"""The tuned lens beside the logit lens, the bits each misses of the final distribution, and early exit.

The logit lens (core.lens_logits) reads hidden state l (0: the embeddings, l: block l's output)
through the final norm and the LM head as if the model stopped there. The tuned lens (Belrose et
al. 2023, "Eliciting Latent Predictions from Transformers with the Tuned Lens") first applies an
affine translator per layer, h -> h + A_l h + b_l (A_l, b_l start at zero: it starts as the logit
lens), trained on the model's own text to minimise KL(final || lens_l), the bits by which the lens's
distribution misses the model's final one. The model stays frozen: only the translators learn.

Early exit: at each position, the first layer whose lens top-1 equals the model's own top-1; a
model that stopped there would have predicted the same token.

Shapes: N windows, T positions, D d_model, V vocab, L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class TunedLens(nn.Module):
    """One affine translator (D -> D, zero at the start) per hidden state 0..L-1."""

    def __init__(self, d_model: int, n_layers: int):
        super().__init__()
        self.translators = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(n_layers))
        for t in self.translators:
            nn.init.zeros_(t.weight)
            nn.init.zeros_(t.bias)

    def forward(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """h (..., D) -> h + A_l h + b_l."""
        return h + self.translators[layer](h)


def _windows(model, windows) -> torch.Tensor:
    x = torch.as_tensor(windows, dtype=torch.long)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.numel() == 0:
        raise ValueError(f"token windows are (N, T) ids, got shape {tuple(x.shape)}")
    return x.to(next(model.parameters()).device)


def _hidden_and_final(model, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """-> (hidden states 0..L-1, each (N, T, D); the model's log-probabilities (N, T, V) float32)."""
    with torch.no_grad():
        logits, hidden = model.forward_with_hidden(x)
    return hidden[:-1], F.log_softmax(logits.float(), dim=-1)


def _kl_bits(final_logp: torch.Tensor, lens_logits: torch.Tensor) -> torch.Tensor:
    """KL(final || lens) in bits per position: (N, T, V), (N, T, V) -> (N, T)."""
    lens_logp = F.log_softmax(lens_logits.float(), dim=-1)
    return (final_logp.exp() * (final_logp - lens_logp)).sum(-1) / math.log(2)


def train_tuned_lens(model, windows, steps: int = 200, lr: float = 1e-3, batch_size: int = 8,
                     seed: int = 0) -> TunedLens:
    """Fit a TunedLens to `windows` ((N, T) token ids of the model's own text) with Adam, `steps`
    batches of `batch_size` windows; the model's parameters are not touched."""
    for name, v, ok in (("steps", steps, 1), ("batch_size", batch_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < ok:
            raise ValueError(f"{name} must be an integer >= {ok}, got {v!r}")
    x = _windows(model, windows)
    device = x.device
    lens = TunedLens(model.config.d_model, model.config.n_layers).to(device)
    params = list(lens.parameters())
    optimizer = torch.optim.Adam(params, lr=lr)
    rng = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randint(0, x.shape[0], (min(batch_size, x.shape[0]),), generator=rng).to(device)
        hidden, final_logp = _hidden_and_final(model, x[pick])
        loss = sum(_kl_bits(final_logp, model.unembed(lens(h, i))).mean() for i, h in enumerate(hidden))
        grads = torch.autograd.grad(loss, params)              # the translators' gradients only
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    return lens.eval()


@dataclass
class LensBits:
    """Mean KL(final || lens) in bits per layer 0..L-1, for the logit lens and the tuned lens."""

    logit_lens: list[float]
    tuned_lens: list[float] | None


def lens_bits(model, windows, lens: TunedLens | None = None) -> LensBits:
    """Bits of KL to the model's final distribution at each layer, averaged over every position of
    `windows` ((N, T) ids), for the logit lens and (given one) the tuned lens."""
    x = _windows(model, windows)
    hidden, final_logp = _hidden_and_final(model, x)
    with torch.no_grad():
        plain = [float(_kl_bits(final_logp, model.unembed(h)).mean()) for h in hidden]
        tuned = None if lens is None else [float(_kl_bits(final_logp, model.unembed(lens(h, i))).mean())
                                           for i, h in enumerate(hidden)]
    return LensBits(plain, tuned)


@dataclass
class EarlyExit:
    """exit_layer: per position, the first layer 0..L whose lens top-1 equals the model's (L: only the
    full model); share: per layer 0..L, the share of positions that could exit there first;
    cumulative: the share that could exit at that layer or before."""

    exit_layer: list[int]
    share: list[float]
    cumulative: list[float]


def early_exit(model, ids: Sequence[int], lens: TunedLens | None = None) -> EarlyExit:
    """Early exit over one text, read through the logit lens (or `lens`, a TunedLens)."""
    x = _windows(model, ids)[:1]
    hidden, final_logp = _hidden_and_final(model, x)
    with torch.no_grad():
        tops = [model.unembed(h if lens is None else lens(h, i))[0].argmax(-1) for i, h in enumerate(hidden)]
    tops.append(final_logp[0].argmax(-1))                        # layer L: the model itself, (T,)
    same = torch.stack([t == tops[-1] for t in tops])            # (L+1, T)
    first = same.int().argmax(dim=0).tolist()                    # the first True; row L is all True
    L1, T = same.shape
    share = [sum(1 for f in first if f == layer) / T for layer in range(L1)]
    cumulative = [sum(share[:layer + 1]) for layer in range(L1)]
    return EarlyExit(first, share, cumulative)


def save_tuned_lens(lens: TunedLens, path, *, overwrite: bool = False) -> Path:
    """The translators as one safetensors file (translators.{l}.weight / .bias), written atomically."""
    from safetensors.torch import save

    from logitlab.io.files import atomic_write_bytes

    path = Path(path)
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists; choose another name or pass overwrite=True")
    tensors = {k: v.detach().cpu().contiguous() for k, v in lens.state_dict().items()}
    meta = {"format": "logitlab-tuned-lens", "n_layers": str(len(lens.translators))}
    return atomic_write_bytes(path, save(tensors, metadata=meta))


def load_tuned_lens(path, model) -> TunedLens:
    """A TunedLens for `model` from a file save_tuned_lens wrote."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tuned lens file {path} does not exist")
    lens = TunedLens(model.config.d_model, model.config.n_layers)
    try:
        lens.load_state_dict(load_file(str(path)))
    except Exception as e:                                         # noqa: BLE001  (wrong keys or shapes)
        raise ValueError(f"{path} is not a tuned lens for this model (L={model.config.n_layers}, "
                         f"D={model.config.d_model}): {str(e).splitlines()[0]}") from None
    return lens.to(next(model.parameters()).device).eval()
