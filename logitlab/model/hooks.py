"""Hook points: every activation of the forward pass has a name, and a function can read or replace
it for one call.

A module that names activations declares them in a class dict `HOOKS` ({local name: what it is, with
its shape}) and passes each one through `tap(self, local_name, tensor)` where it is computed. With no
hook set, `tap` returns its tensor after one attribute test (`_taps` is None, a class attribute), so
the forward is today's forward: the same operations, the same graph under torch.compile, the same
fast kernels. The names are the module's path plus the local name, the same for every family:

    embed, pos_embed                      the token and (learned or sinusoidal) position embeddings
    blocks.{i}.resid_pre                  the residual stream entering block i
    blocks.{i}.attn.q / k / v             per head, after QK-norm and RoPE
    blocks.{i}.attn.scores / pattern      before and after the softmax (the eager path, see below)
    blocks.{i}.attn.z                     per head, what o_proj reads (after the output gate)
    blocks.{i}.attn.latent                multi-head latent attention (mla.py): the cache rows; it has
                                          q, scores, pattern and z too, and no k or v
    blocks.{i}.linear_attn.*              a Gated DeltaNet layer's q, k, v, gates g and beta, state
    blocks.{i}.attn_out                   the token mixer's output, added to the residual stream
    blocks.{i}.resid_mid                  the residual stream after that add
    blocks.{i}.mlp.pre / up / post        the MLP's hidden activations
    blocks.{i}.mlp.router_logits / experts / weights   an MoE layer's routing
    blocks.{i}.mlp_out, blocks.{i}.resid_post
    final_norm.scale                      1 / rms (or 1 / std) of the final norm, per position
    logits

`hook_points(model)` lists them with their shapes (`logitlab inspect MODEL --hooks`). A hook is
`fn(tensor, name) -> None` (a read) or a tensor of the same shape (a write: it replaces the
activation; it is cast to the activation's dtype). `hooks(model, {name: fn})` sets hooks for the
calls inside its `with` block and removes them on the way out, also on an error; `run_with_cache`
runs one forward and returns the chosen activations. SDPA computes no attention scores or weights,
so a layer with a hook on attn.scores or attn.pattern runs the eager reference attention for the
calls made while that hook is set; its other layers keep their path.

Shapes: B batch, T positions, S key/value length, D d_model, V vocab, H heads, Hkv key/value
heads, Dh head_dim, F d_ff, E experts, K experts per token.
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from logitlab.model.norms import LayerNorm, ZeroCenteredRMSNorm

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]
EAGER_ONLY = ("scores", "pattern")            # attention hook points that only the eager path computes


def tap(module, name: str, x: torch.Tensor, shape: tuple | None = None) -> torch.Tensor:
    """x, or what the hooks set on `module` at `name` make of it (each in the order set; a hook that
    returns None only reads). shape: how the hooks see x (a view), when that differs from the layout
    the module computes in (an MoE's (N, E) router logits are shown as (B, T, E))."""
    taps = module._taps
    if taps is None or name not in taps:
        return x
    seen = x if shape is None else x.reshape(shape)
    for full_name, fn in taps[name]:
        out = fn(seen, full_name)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.shape != seen.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"the hook at {full_name} returned {got}; a hook returns None or a tensor of "
                                 f"the activation's shape {tuple(seen.shape)}")
            seen = out.to(seen.dtype)
    return seen if shape is None else seen.reshape(x.shape)


def needs_eager(module) -> bool:
    """Whether a hook on this attention module reads or writes what only the eager path computes."""
    taps = module._taps
    return taps is not None and any(name in taps for name in EAGER_ONLY)


@dataclass(frozen=True)
class HookPoint:
    """One named activation: its full name, the module that computes it and what it is (with shape)."""

    name: str
    module: str
    what: str


def hook_points(model) -> list[HookPoint]:
    """Every hook point of `model` in the order the forward reaches it (the model's own, then each
    block's modules in their order, the MLP's after the mixer's)."""
    found = []
    for path, module in model.named_modules():
        for local, what in getattr(type(module), "HOOKS", {}).items():
            if path == "" and local == "pos_embed" and getattr(module, "pos_emb", None) is None:
                continue                                           # rope, alibi, none: no position table
            found.append(HookPoint(f"{path}.{local}" if path else local, path, what))
    order = {"embed": 0, "pos_embed": 1, "final_norm.scale": 3, "logits": 4}
    block = {"resid_pre": 0, "attn_out": 2, "resid_mid": 3, "mlp_out": 5, "resid_post": 6}

    def key(p: HookPoint):
        parts = p.name.split(".")
        if parts[0] != "blocks" or len(parts) < 3 or not parts[1].isdigit():
            return (order.get(p.name, 2), 0, 0)                    # a module of another shape: before the head
        inner = block.get(parts[2], 1 if parts[2] in ("attn", "linear_attn") else 4)
        return (2, int(parts[1]), inner)
    return sorted(found, key=key)                                  # stable: a module's own order kept


def resolve(model, names: Iterable[str]) -> dict[str, HookPoint]:
    """Names or fnmatch patterns ("blocks.*.resid_post") -> {name: HookPoint}; ValueError naming an
    unknown name with the closest ones."""
    points = {p.name: p for p in hook_points(model)}
    out = {}
    for pattern in names:
        if not isinstance(pattern, str):
            raise ValueError(f"a hook point name is a string, got {type(pattern).__name__}")
        matched = [pattern] if pattern in points else [n for n in points if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            import difflib

            close = difflib.get_close_matches(pattern, list(points), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"no hook point {pattern!r} in this model{hint} (hook_points(model) lists "
                             f"all {len(points)}: `logitlab inspect MODEL --hooks`)")
        out.update((n, points[n]) for n in matched)
    return out


def _local(point: HookPoint) -> str:
    return point.name[len(point.module) + 1:] if point.module else point.name


def add_hooks(model, fns: Mapping[str, HookFn]) -> Callable[[], None]:
    """Set hooks (as hooks() does) until the returned function is called, which removes exactly
    these; for a hook meant to last as long as the model is used (a served model's steering).
    Prefer `with hooks(...)`, which cannot forget to remove them."""
    added = []

    def remove() -> None:
        for module, local, entry in reversed(added):
            entries = module._taps[local]
            del entries[next(i for i, e in enumerate(entries) if e is entry)]
            if not entries:
                del module._taps[local]
            if not module._taps:
                del module._taps                                   # the class's None again
        added.clear()
    try:
        for pattern, fn in fns.items():
            if not callable(fn):
                raise ValueError(f"the hook for {pattern!r} is not callable: {type(fn).__name__}")
            for name, point in resolve(model, [pattern]).items():
                module = model.get_submodule(point.module)
                if module.__dict__.get("_taps") is None:
                    module._taps = {}
                entry = (name, fn)
                module._taps.setdefault(_local(point), []).append(entry)
                added.append((module, _local(point), entry))
    except BaseException:
        remove()
        raise
    return remove


@contextmanager
def hooks(model, fns: Mapping[str, HookFn]):
    """`with hooks(model, {name: fn, ...}):` the forward calls inside the block run `fn(activation,
    name)` at each named point (names may be fnmatch patterns); every hook is removed on the way out,
    error or not. Hooks nest: an inner block's run after the outer block's at the same point."""
    remove = add_hooks(model, fns)
    try:
        yield model
    finally:
        remove()


def run_with_cache(model, ids, names: Iterable[str] | None = None, *, grad: bool = False, **forward_kwargs):
    """One forward of `ids` ((B, T) or one sequence) -> (logits (B, T, V), {name: activation}) for the
    hook points `names` (names or fnmatch patterns; None: every one). The activations are detached;
    grad=False (default) runs under torch.no_grad(). forward_kwargs go to model.forward (cache,
    positions, attn_mask)."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.ndim == 1:
        ids = ids[None]                                            # (T,) -> (1, T)
    ids = ids.to(next(model.parameters()).device)
    wanted = resolve(model, [p.name for p in hook_points(model)] if names is None else names)
    cache: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, name: str) -> None:
        cache[name] = x.detach()

    with hooks(model, dict.fromkeys(wanted, keep)), torch.set_grad_enabled(grad):
        logits = model(ids, **forward_kwargs)
    return logits, {name: cache[name] for name in wanted if name in cache}


def final_norm(model, h: torch.Tensor) -> torch.Tensor:
    """model.final_norm(h), with its scale (1 / rms, or 1 / std for LayerNorm; (B, T, 1) float32) at
    the hook point final_norm.scale. A hook that only reads leaves the norm's own kernel to run; one
    that writes (direct logit attribution freezes the scale at its value) gets the explicit form."""
    norm = model.final_norm
    taps = model._taps
    if taps is None or "final_norm.scale" not in taps:
        return norm(h)
    x = h.float()
    centred = x - x.mean(dim=-1, keepdim=True) if isinstance(norm, LayerNorm) else x   # LayerNorm centres
    scale = torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + norm.eps)    # (B, T, 1)
    new = tap(model, "final_norm.scale", scale)
    if new is scale:
        return norm(h)
    return apply_norm(norm, centred * new, h.dtype)


def apply_norm(norm, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A norm's weight (and bias) applied to an already normalised (..., D) float32 tensor, in the
    order each norm kind rounds (norms.py): RMSNorm rounds before its weight, the zero-centred one
    after, LayerNorm is float32 throughout where its input is."""
    weight = norm.weight.float()
    if isinstance(norm, LayerNorm):
        return (normed * weight + norm.bias.float()).to(dtype)
    if isinstance(norm, ZeroCenteredRMSNorm):
        return (normed * (1.0 + weight)).to(dtype)
    return norm.weight * normed.to(dtype)
