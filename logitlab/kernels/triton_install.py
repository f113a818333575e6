"""Install the Triton FlashAttention kernel (kernels.triton_attention) into a built model, from
outside, and take it out again.

    handle = install(model)          # every Attention of the model now attends by the kernel
    handle.modules                   # how many attention modules were switched
    handle.remove()                  # the model's classes exactly as they were

install swaps the class of each logitlab.model.attention.Attention to FlashAttentionModule, a
subclass that overrides only `_attend` (q, k, v -> out): parameters, state-dict keys, hooks,
the projections, RoPE, the cache and the output gate stay the module's own. The kernel takes
the "sdpa" route; these calls keep the route they had, because the kernel has no form of them:
- need_weights (the weights are returned only by the eager reference) and impl="eager";
- attention sinks (an extra softmax column; eager, as before);
- an explicit boolean mask: padding rows of a batch, a sliding-window layer, a chunk after a
  cache with padding (SDPA with that mask). A plain causal call (no cache, or a cache filled
  from position 0 in one call) and a decode step (T = 1, no mask) take the kernel.
The installed model must give the plain model's logits and gradients
(tests/triton/test_triton_install.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from logitlab.kernels.triton_attention import MAX_HEAD_DIM, MIN_HEAD_DIM, flash_attention
from logitlab.kernels.triton_common import INTERPRET
from logitlab.model.attention import Attention


class FlashAttentionModule(Attention):
    """Attention whose "sdpa" route runs the Triton FlashAttention kernel (see the module docstring)."""

    def _attend(self, q, k, v, mask, is_causal, impl, need_weights):
        """q (B, H, T, Dh), k, v (B, Hkv, S, Dh) -> (out (B, H, T, Dh), weights or None)."""
        if need_weights or impl == "eager" or self.sinks is not None or mask is not None:
            return super()._attend(q, k, v, mask, is_causal, impl, need_weights)
        return flash_attention(q, k, v, causal=is_causal), None


@dataclass
class Installed:
    """What install did: `modules` attention modules switched; remove() switches them back."""

    modules: int = 0
    _classes: list[tuple[nn.Module, type]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        for module, cls in reversed(self._classes):
            module.__class__ = cls
        self._classes, self.modules = [], 0


def _check_model(model: nn.Module, attentions: list[Attention]) -> None:
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no logitlab Attention module to install the kernel into")
    device = next(model.parameters()).device
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"the Triton attention kernel runs on a CUDA device; this model is on {device}. "
                         "On a CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1 set before "
                         "logitlab.kernels is imported), a correctness check that is far slower than SDPA")
    for module in attentions:
        Dh = module.head_dim
        if not (MIN_HEAD_DIM <= Dh <= MAX_HEAD_DIM and Dh % 8 == 0):
            raise ValueError(f"head_dim {Dh} is not supported by the Triton attention kernel "
                             f"(a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}])")


def install(model: nn.Module) -> Installed:
    """Switch every Attention module of `model` (a built Transformer, or any module holding
    them) to FlashAttentionModule. ValueError, with nothing changed, when the model is not on a
    CUDA device (unless the kernels run in the interpreter), has no attention, or has a head
    dim the kernel does not take. Installing twice switches nothing more. -> Installed."""
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    _check_model(model, attentions)
    handle = Installed()
    for module in attentions:
        if isinstance(module, FlashAttentionModule):
            continue
        handle._classes.append((module, type(module)))
        module.__class__ = FlashAttentionModule
    handle.modules = len(handle._classes)
    return handle
