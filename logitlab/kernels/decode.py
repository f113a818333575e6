"""The compiled decode step: a generation loop's decode step through torch.compile, built for one
model and kept until its weights change.

Generation never imports this module: the caller builds the step here and hands it to
generate.generate / generate.stream as `step=` (the CLI does so for --compile). The step it
compiles is passed in too (generate.loop.decode_step, the eager reference it must equal), so
this module reads nothing of generation. What it changes outside a call: inductor's global
`freezing` flag, set only for the duration of each call of a frozen step and restored after.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Callable

import torch

_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (weights key, step)

# torch.compile(isolate_recompiles=True) (recent torch releases) keeps each compiled step's graphs
# apart from every other's; only then is skipping the guards on the model's modules safe, since
# nothing else could tell two models' graphs apart. Older torch keeps the guards.
_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def _guard_options() -> dict:
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} if _ISOLATE else {}


def _compile_options(model) -> dict:
    """Inductor options for the decode step of `model`, chosen by its device.

    On a CPU a decode step is ~40 small kernels around the matrix products, so cpp_wrapper (the
    compiled graph calls its kernels from C++ rather than Python) saves per-kernel overhead, and
    freezing turns the weights into graph constants, which max_autotune lets inductor prepack for
    the product it times fastest per matrix shape (its C++ GEMM template, oneDNN's or MKL's
    packed GEMM, or aten's; the tables it prints are switched off): aten's products with a few
    rows run far below the memory bandwidth on unpacked weights (docs/benchmarks.md has the
    step times). The cost: a longer first compile and a packed copy of each weight held while
    the compiled step lives. Frozen weights are why compiled steps are kept per model and
    rebuilt when a parameter changes (`compiled_decode_step`). Guards on the model's modules are
    skipped (a decode step checks several per parameter): the per-model key stands in for them.
    """
    device = next(model.parameters()).device
    options = _guard_options()
    if device.type == "cpu":
        options.update(cpp_wrapper=True, freezing=True, max_autotune=True,
                       max_autotune_gemm_backends="CPP,ATEN", autotune_num_choices_displayed=0,
                       max_autotune_report_choices_stats=False)
    return options


def _weights_key(model) -> tuple:
    """Changes when any parameter is replaced, moved, cast or written in place, or the attention
    implementation is switched."""
    return (getattr(model, "attn_impl", None),
            *((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters()))


class CompiledStep:
    """A decode step compiled for one model: call it as decode_step (every guard checked), or
    through `trusted` inside a decode loop once its arguments are known to fit (see there)."""

    def __init__(self, fn: Callable, freezing: bool):
        self._fn, self._freezing = fn, freezing

    def __call__(self, model, token, cache, positions=None, attn_mask=None, greedy=False):
        if not self._freezing:
            return self._fn(model, token, cache, positions, attn_mask, greedy)
        # torch.compile(options=...) hands its options to inductor only, but dynamo decides while
        # tracing, from inductor's global flag, whether parameters become graph constants: they
        # are graph inputs otherwise, and inductor then finds nothing to freeze (no prepacked
        # weights, aten's products). A call traces only when no compiled graph fits, so the flag
        # is set around each call and restored after it.
        import torch._inductor.config as inductor_config

        before, inductor_config.freezing = inductor_config.freezing, True
        try:
            return self._fn(model, token, cache, positions, attn_mask, greedy)
        finally:
            inductor_config.freezing = before

    def trusted(self, model, token, cache, positions=None, attn_mask=None, greedy=False):
        """The same step with dynamo's guards skipped, except those telling this step's
        compiled graphs apart (shape, dtype and device of every tensor argument, which are most
        of a graph lookup's cost).

        Only for a call whose arguments differ from the previous call's, which checked every
        guard, in cache.length (one more) and in tensor values alone: the same model, cache
        object, shapes, dtypes, greedy flag and global state. Dynamo tries the graph that call
        ran first, and its remaining guards bound cache.length (below max_len and the context
        length, above 1), which a loop whose cache holds every position it writes keeps."""
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self._fn(model, token, cache, positions, attn_mask, greedy)


def compiled_decode_step(model=None, backend: str = "inductor", *, step: Callable) -> Callable:
    """`step` (generate.loop.decode_step, or a function with its signature) through torch.compile,
    as one graph (fullgraph: a graph break is an error) with dynamic shapes (the cache length
    grows every step, so one graph serves every step). -> a callable with decode_step's signature,
    for generate(..., step=...).

    With a model, the compiled step (a CompiledStep) is built for that model (see
    _compile_options) and kept until its weights change; the first call compiles (slow on a
    CPU), later calls reuse it. backend="aot_eager" traces the same graph without
    inductor (fast; for tests). Without a model: one generic compiled step (default options)
    shared by every model."""
    if model is None:
        return _generic_compiled_step(step, backend)
    key = (_weights_key(model), backend, step)
    held = _COMPILED.get(model)
    if held is not None and held[0] == key:
        return held[1]
    options = _compile_options(model) if backend == "inductor" else _guard_options()

    def traced(model, token, cache, positions, attn_mask, greedy):
        return step(model, token, cache, positions, attn_mask, greedy)

    isolate = {"isolate_recompiles": True} if _ISOLATE else {}   # this model's graphs only
    fn = torch.compile(traced, dynamic=True, fullgraph=True, backend=backend, options=options, **isolate)
    compiled = CompiledStep(fn, freezing=bool(options.get("freezing")))
    _COMPILED[model] = (key, compiled)
    return compiled


@functools.lru_cache(maxsize=None)
def _generic_compiled_step(step: Callable, backend: str) -> Callable:
    return torch.compile(step, dynamic=True, fullgraph=True, backend=backend)
