"""The compiled decode step: a generation loop's decode step through torch.compile, built for one
model and kept until its weights change.

Generation never imports this module: the caller builds the step here and hands it to
generate.generate / generate.stream as `step=` (the CLI does so for --compile). The step it
compiles is passed in too (generate.loop.decode_step, the eager reference it must equal), so
this module reads nothing of generation. What it changes outside a call: two global compiler
flags read while tracing (inductor's `freezing` for a frozen step, dynamo's `specialize_float`),
set only for the duration of each guarded call and restored after (CompiledStep); and, once a
step with the C++ GEMM template pinned runs, a filter in inductor's list of choice filters, which
passes every choice through unchanged except inside template_pinned.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import threading
import weakref
from typing import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (weights key, step)

# torch.compile(isolate_recompiles=True) (recent torch releases) keeps each compiled step's graphs
# apart from every other's; only then is skipping the guards on the model's modules safe, since
# nothing else could tell two models' graphs apart. Older torch keeps the guards.
_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def _guard_options() -> dict:
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} if _ISOLATE else {}


_AUTOTUNE = (None, True, False, "timed", "template")


def _autotune_mode(model, autotune: bool | str | None, freezing: bool) -> str | None:
    """-> "timed", "template" or None (aten's products): what `autotune` asks for this model.

    None: "template" for bf16/fp16 weights in a frozen step, nothing for float32 (the measurements
    are in _compile_options). True is "timed"; False is None."""
    if autotune is None:
        low = next(model.parameters()).dtype != torch.float32
        return ("template" if freezing else "timed") if low else None
    return {True: "timed", False: None}.get(autotune, autotune)


def _compile_options(model, autotune: bool | str | None = None, freeze: bool | None = None) -> dict:
    """Inductor options for the decode step of `model`, chosen by its device and dtype.

    On a CPU a decode step is ~40 small kernels around the matrix products, so cpp_wrapper (the
    compiled graph calls its kernels from C++ rather than Python) saves per-kernel overhead, and
    freezing turns the weights into graph constants, which inductor prepacks for a packed GEMM
    (MKL's or oneDNN's): aten's products with a few rows run far below the memory bandwidth on
    unpacked weights (docs/benchmarks.md has the step times). autotune (max_autotune) also times
    inductor's C++ GEMM template against aten's products per matrix shape and keeps the fastest
    ("timed", or True); "template" takes the template for every product it can serve without
    timing anything, aten's product for the rest (the template serves a product only with a
    frozen weight); None: "template" for bf16 and fp16 weights in a frozen step, nothing for
    float32. Pinned rather than timed: where the picks were recorded (an AVX-512 BF16 CPU, an
    AVX2 one) the timing took the template for every product of the blocks (on the AVX2 one for
    the LM head too), and the pinned step ran at the timed step's speed within noise (0.94-1.20x;
    0.99x over ten rounds) while its cold first call took 15-25 s less (34-38 s against 49-60 s;
    28-35 s against 48-56 s, where gpt-fast compiled with its own options took 24-33 s): timing a
    candidate means compiling its C++ first (docs/benchmarks.md). Measured on three CPUs
    (docs/benchmarks.md, "Decode against gpt-fast" and the performance notes): for bf16 the
    template's AMX kernels made a small Llama's step 1.75x faster on a CPU with AMX, and on an
    AVX-512 BF16 CPU without AMX the step ran at 346-503 tok/s against 265-284 without autotuning
    (most of a cold bf16 compile's extra time there is the timing itself: each candidate's C++ is
    compiled to be timed). For float32 two CPUs disagree: with AMX the autotuned step ran at 0.83x
    the speed of MKL's packed GEMM alone (small Llama, batch 1 and 8) at twice the compile time (42
    s vs 21 s); without AMX it was 1.08x (small Llama, batch 1) to 1.27x (tiny, batch 8) faster. A
    trick not proven faster is not the default, so float32 keeps the packed GEMM, which also
    picks the same kernels at every compile (autotune's pick is timed, and can change between
    compiles on a loaded machine); autotune=True asks for it. The costs of freezing: the packed
    copy of each weight held while the compiled step lives, which is why compiled steps are kept
    per model and rebuilt when a parameter changes (`compiled_decode_step`), and no reuse of
    inductor's on-disk cache for a graph holding any weight packed for oneDNN (such weights cannot
    be saved into it): every float32 step, and on some CPUs a bf16 one (measured on an AVX-512
    BF16 CPU without AMX, not on an AVX2 one), is compiled again in every new process
    (docs/benchmarks.md has the times); freeze=False trades the packed GEMM's speed for that.
    freeze None: on for a CPU.

    A frozen step's compiled graph is keyed in inductor's caches (in memory and on disk) by its
    frozen weights' shapes, not their values, yet may hold constants derived from the values (a
    GEMM template's repacked weights): the same architecture with other weights, in this process
    or a later one, would be served those stale constants. The options therefore carry a digest of
    the weights into the cache key (_WeightsDigest). Guards on the model's modules are skipped (a
    decode step checks several per parameter): the per-model key stands in for them.
    """
    if autotune not in _AUTOTUNE:
        raise ValueError(f"autotune must be one of {_AUTOTUNE}, not {autotune!r}")
    first = next(model.parameters())
    options = _guard_options()
    if first.device.type == "cpu":
        options.update(cpp_wrapper=True, freezing=freeze is not False)
        mode = _autotune_mode(model, autotune, options["freezing"])
        if options["freezing"]:   # the mode goes into the cache key: a pinned step is not a timed one
            options["post_grad_custom_post_pass"] = _WeightsDigest(model, mode or "")
        if mode:
            options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN",
                           autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False)
    return options


# Set by template_pinned, around the calls of a step compiled with autotune "template"; the choice
# filter below reads it, so every other compile in the process times its choices as it would.
_PIN_TEMPLATE = threading.local()


def _template_where_it_applies(choices: list) -> list:
    """A filter on the kernels inductor's max-autotune chooses from for one product: while a
    "template" step compiles, the C++ GEMM template's choices alone where there are any (then
    nothing is timed: one choice is taken as it is), every choice otherwise."""
    if not getattr(_PIN_TEMPLATE, "on", False):
        return choices
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller

    def kernel(choice):   # inductor wraps a choice whose weights it repacks (DataProcessorChoiceCallerWrapper)
        while (inner := getattr(choice, "_wrapped", None)) is not None:
            choice = inner
        return choice

    templates = [c for c in choices if isinstance(kernel(c), CppTemplateCaller)]
    return templates or choices


@contextlib.contextmanager
def template_pinned(on: bool = True):
    """While inside (this thread), the products inductor compiles with max-autotune take its C++
    GEMM template untimed wherever it is offered (_template_where_it_applies); CompiledStep enters
    it around the calls of a step compiled with autotune "template", and a torch.compile of other
    code compiled with _compile_options' options can too. on=False: as outside."""
    previous = getattr(_PIN_TEMPLATE, "on", False)
    _PIN_TEMPLATE.on = on and (_FILTER_INSTALLED or _install_template_filter())
    try:
        yield
    finally:
        _PIN_TEMPLATE.on = previous


_FILTER_INSTALLED = False   # set once the filter is in inductor's list: template_pinned, entered
                            # every decode step of a pinned step, then skips the imports below


def _install_template_filter() -> bool:
    """Adds _template_where_it_applies to inductor's choice filters (once; a no-op after). -> False
    where this torch has no such hook: the step is then timed as with autotune "timed"."""
    global _FILTER_INSTALLED
    try:   # select_algorithm first: imported alone, cpp_template_kernel's imports go round in a circle
        import torch._inductor.select_algorithm as select_algorithm
        from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller  # noqa: F401
    except ImportError:
        return False
    selector = select_algorithm.get_algorithm_selector_cache()
    if not hasattr(selector, "preprocessing_fns"):
        return False
    if _template_where_it_applies not in selector.preprocessing_fns:
        selector.add_preprocessing_fn(_template_where_it_applies)
    _FILTER_INSTALLED = True
    return True


class _WeightsDigest(CustomGraphPass):
    """A graph pass that changes nothing: inductor puts a custom pass's uuid() into the key of its
    caches, and this one's is a hash of the model's parameter and buffer values (blake2b over their
    bytes, about a second per GB), so a frozen graph is reused only for the very same weights."""

    def __init__(self, model, tag: str = ""):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{tag};".encode())
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
        self._uuid = "logitlab-weights-" + digest.hexdigest()

    def __call__(self, graph) -> None:
        pass

    def uuid(self) -> str:
        return self._uuid


def _weights_key(model) -> tuple:
    """Changes when any parameter is replaced, moved, cast or written in place, or the attention
    implementation is switched."""
    return (getattr(model, "attn_impl", None),
            *((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters()))


class CompiledStep:
    """A decode step compiled for one model: call it as decode_step (every guard checked), or
    through `trusted` inside a decode loop once its arguments are known to fit (see there)."""

    def __init__(self, fn: Callable, freezing: bool, pin_template: bool = False):
        self._fn, self._freezing, self._pin = fn, freezing, pin_template

    def __call__(self, model, token, cache, positions=None, attn_mask=None, greedy=False):
        # Two flags read while dynamo traces, set around each call (a call traces only when no
        # compiled graph fits) and restored after it:
        # - torch.compile(options=...) hands its options to inductor only, but dynamo decides,
        #   from inductor's global `freezing` flag, whether parameters become graph constants:
        #   they are graph inputs otherwise, and inductor then finds nothing to freeze (no
        #   prepacked weights, aten's products);
        # - with dynamic=True and the module guards skipped, dynamo traces a module's float
        #   attributes (a norm's eps) as symbolic floats; AOT autograd's tensorify pass then pins
        #   them and restarts the whole trace, a second compile attempt (a quarter of a first
        #   call's time; docs/benchmarks.md). specialize_float makes them the constants they are.
        # And for autotune "template", template_pinned (read by inductor's choice filter).
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        freezing, floats = inductor_config.freezing, dynamo_config.specialize_float
        inductor_config.freezing = freezing or self._freezing
        dynamo_config.specialize_float = True
        try:
            with template_pinned(self._pin):
                return self._fn(model, token, cache, positions, attn_mask, greedy)
        finally:
            inductor_config.freezing, dynamo_config.specialize_float = freezing, floats

    def trusted(self, model, token, cache, positions=None, attn_mask=None, greedy=False):
        """The same step with dynamo's guards skipped, except those telling this step's
        compiled graphs apart (shape, dtype and device of every tensor argument, which are most
        of a graph lookup's cost).

        Only for a call whose arguments differ from the previous call's, which checked every
        guard, in cache.length (one more) and in tensor values alone: the same model, cache
        object, shapes, dtypes, greedy flag and global state. Dynamo tries the graph that call
        ran first, and its remaining guards bound cache.length (below max_len and the context
        length, above 1), which a loop whose cache holds every position it writes keeps."""
        # pinned as in __call__, should a shape guard still fail and compile
        with template_pinned(self._pin), torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self._fn(model, token, cache, positions, attn_mask, greedy)


def compiled_decode_step(model=None, backend: str = "inductor", *, step: Callable,
                         autotune: bool | str | None = None, freeze: bool | None = None) -> Callable:
    """`step` (generate.loop.decode_step, or a function with its signature) through torch.compile,
    as one graph (fullgraph: a graph break is an error) with dynamic shapes (the cache length
    grows every step, so one graph serves every step). -> a callable with decode_step's signature,
    for generate(..., step=...).

    With a model, the compiled step (a CompiledStep) is built for that model (see
    _compile_options) and kept until its weights change; the first call compiles (slow on a
    CPU), later calls reuse it. autotune: inductor's max-autotune over the matrix products ("timed"
    or True: each product's candidates timed; "template": inductor's C++ GEMM template wherever it
    applies, untimed; False: aten's products; None: "template" for bf16/fp16 weights on a CPU,
    False for float32); freeze: the weights as prepacked graph
    constants (None: on a CPU; False: aten's products on the weights as they are, and a compile
    that inductor's on-disk cache can serve to the next process; see _compile_options).
    backend="aot_eager" traces the same graph without inductor (fast; for tests). Without a
    model: one generic compiled step (default options) shared by every model."""
    if model is None:
        return _generic_compiled_step(step, backend)
    key = (_weights_key(model), backend, step, autotune, freeze)
    held = _COMPILED.get(model)
    if held is not None and held[0] == key:
        return held[1]
    options = _compile_options(model, autotune, freeze) if backend == "inductor" else _guard_options()

    def traced(model, token, cache, positions, attn_mask, greedy):
        return step(model, token, cache, positions, attn_mask, greedy)

    isolate = {"isolate_recompiles": True} if _ISOLATE else {}   # this model's graphs only
    fn = torch.compile(traced, dynamic=True, fullgraph=True, backend=backend, options=options, **isolate)
    freezing = bool(options.get("freezing"))
    pin = bool(options.get("max_autotune")) and _autotune_mode(model, autotune, freezing) == "template"
    compiled = CompiledStep(fn, freezing=freezing, pin_template=pin)
    _COMPILED[model] = (key, compiled)
    return compiled


@functools.lru_cache(maxsize=None)
def _generic_compiled_step(step: Callable, backend: str) -> Callable:
    return torch.compile(step, dynamic=True, fullgraph=True, backend=backend)
