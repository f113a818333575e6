"""A chat template is a program that comes with a model directory: the Jinja sandbox that runs it,
with a bound on what it may cost.

chat.py renders conversations; this module owns the environment a template runs in. jinja2's
ImmutableSandboxedEnvironment already keeps a template away from Python's internals (no attribute
that starts with an underscore, no unsafe callable, no change to a list or dict). It bounds no
cost: `{{ 'x' * 4000000000 }}` asks for 4 GB at once, two loops over range(100000) run 10**10
steps, and a macro that calls itself ends in Python's RecursionError. `BoundedEnvironment` adds
the bounds of `TemplateLimits`, checked while the template runs:

  - size: the characters that output statements write in one render (inside macros and
    `{% set %}` blocks too, so nothing piles up out of sight; a macro's text counts again where
    its caller writes it), and the size of every value an operator, call or filter makes. An
    operation whose result would pass it is refused before it runs: a sequence repeated, a large
    power, a format string with wide fields, replace, join, indent, a container printed whole;
  - loops: the steps of all loops of one render, and range()'s length;
  - calls: how deeply calls nest (a macro that calls itself without end);
  - time: a deadline, checked at every loop step, output, call, filter and operator, so a
    template overruns it by at most one operation on values within the size bound.

It also refuses, when compiling, what a chat template never needs: {% include %}, {% import %},
{% from %} and {% extends %} (there is no other template to load), and it has no `lipsum`
global, no `pprint` filter, and `sum` adds numbers only (a sum of lists takes quadratic time).

How: the parsed template is rewritten before it is compiled (jinja2 compiles a node tree as
readily as text): each loop's iterable goes through a counting iterator, each output expression
through a counter and each `~` through a size check, three filters of this environment. The
environment intercepts the operators * ** + % and every call (jinja2's `intercepted_binops` and
`call`) and wraps every filter. The budget of the render under way is kept per thread, so one
compiled template renders in several threads at once; outside `render` (when jinja2 folds
constants while compiling) the checks refuse, so nothing is computed before a budget exists.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass

import jinja2
from jinja2 import nodes
from jinja2.runtime import Context, LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

from logitlab.tokenizer.sizes import (
    MAX_INT_BITS,
    binop_size,
    filter_size,
    flat,
    int_bits,
    method_size,
    shallow,
    size_of,
)

# Filters that do not turn their value into text, so a container passed to them is not printed
# whole and need not be measured element by element (the others are: str() of a list prints all).
_STRUCTURAL = frozenset({"abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
                         "int", "items", "last", "length", "list", "map", "max", "min", "random", "reject",
                         "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum",
                         "unique"})
# Filters whose integer arguments are sizes (widths, counts, an indent), which must not pass the size limit.
_SIZED_ARGS = frozenset({"batch", "center", "indent", "slice", "tojson", "truncate", "wordwrap"})
_REFUSED = {nodes.Extends: "{% extends %}", nodes.Include: "{% include %}", nodes.Import: "{% import %}",
            nodes.FromImport: "{% from ... import %}"}


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a chat template may cost."""

    max_output_chars: int = 1 << 21  # 2,097,152 characters written in all, and the size of any one value
    max_loop_steps: int = 1_000_000  # steps of all loops together
    max_range: int = 100_000         # elements of one range()
    max_call_depth: int = 64         # calls nested inside calls (macros, recursive loops)
    max_seconds: float = 2.0         # wall-clock time of one render

    def __post_init__(self) -> None:
        for name in ("max_output_chars", "max_loop_steps", "max_range", "max_call_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        seconds = self.max_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"max_seconds must be a finite number > 0, got {seconds!r}")


class TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A template ran past one of its TemplateLimits, or used what a chat template may not."""


class TemplateRaised(jinja2.exceptions.TemplateRuntimeError):
    """The template refused its input itself, with raise_exception('...')."""


class _Budget:
    """One render's account: output written, loop steps, nesting of calls, the deadline (its
    clock read at every 16th check: a check costs a few hundred nanoseconds, a clock read as much)."""

    def __init__(self, limits: TemplateLimits):
        self.limits, self.limit = limits, limits.max_output_chars
        self.output = self.steps = self.depth = self.ticks = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def tick(self, every: int = 16) -> None:
        self.ticks += 1
        if not self.ticks % every and time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took longer than {self.limits.max_seconds} s (max_seconds)")

    def fits(self, size: int, what: str) -> None:
        """Refuse a value of `size` (made or about to be made by `what`) past the size limit."""
        if size > self.limit:
            raise TemplateLimitError(f"{what} would make a value of up to {size} characters or elements, "
                                     f"more than {self.limit} (max_output_chars)")

    def made(self, value, what: str):
        """Check a value just made (its own length, or an integer's bits) -> the value."""
        if type(value) is str:
            if len(value) > self.limit:
                self.fits(len(value), what)
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"{what} made an integer of {value.bit_length()} bits; at most {MAX_INT_BITS}")
        self.fits(shallow(value), what)
        return value

    def write(self, text: str) -> str:
        self.tick()
        self.output += len(text)
        if self.output > self.limits.max_output_chars:
            raise TemplateLimitError(f"the output passed {self.limits.max_output_chars} characters (max_output_chars)")
        return text

    def step(self, n: int = 1) -> None:
        """Spend n loop steps; a whole loop's at once (n > 1) also reads the clock, since its body
        may run all of them without another check."""
        self.steps += n
        if self.steps > self.limits.max_loop_steps:
            raise TemplateLimitError(f"loops ran past {self.limits.max_loop_steps} steps (max_loop_steps)")
        self.tick(every=1 if n > 1 else 16)

    def check_ints(self, args, what: str) -> None:
        """Integers that are widths, counts or positions are at most the size limit."""
        for a in flat(args):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.limits.max_output_chars:
                raise TemplateLimitError(f"{what} got the integer {a}, more than {self.limits.max_output_chars} "
                                         f"(max_output_chars)")


def _numbers_only(args: tuple, kwargs: dict) -> None:
    """The sum filter adds numbers only: a sum of lists or strings takes quadratic time."""
    start = args[1] if len(args) > 1 else kwargs.get("start", 0)
    if isinstance(start, bool) or not isinstance(start, (int, float)):
        raise TemplateLimitError("the filter sum adds numbers only here (join strings; a sum of lists takes "
                                 "quadratic time)")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every cost bounded by `limits` (see the module docstring).
    `filters` and `globals` are added to jinja2's (all filters are wrapped); `options` are
    jinja2's Environment options. Compile with `compile_template`, render with `render`."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: TemplateLimits = TemplateLimits(), *, filters: dict | None = None,
                 globals: dict | None = None, **options):
        super().__init__(**options)
        self.limits, self._local = limits, threading.local()
        self.globals.pop("lipsum", None)
        self.globals.update(globals or {})
        self.globals["range"] = self._range
        self.filters.pop("pprint", None)
        self.filters.update(filters or {})
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(_loop_steps=self._loop_steps, _output=self._output, _concat=self._concat)

    # --- compiling and rendering -----------------------------------------------------------------

    def compile_template(self, source: str) -> jinja2.Template:
        """Parse, refuse what loads other templates, put the counters in, compile. Raises
        jinja2's TemplateSyntaxError, or TemplateLimitError for a refused statement."""
        tree = self.parse(source)
        for kind, what in _REFUSED.items():
            node = next(tree.find_all(kind), None)
            if node is not None:
                raise TemplateLimitError(f"{what} (line {node.lineno}) is not allowed: a chat template cannot "
                                         f"load other templates")
        for loop in list(tree.find_all(nodes.For)):
            loop.iter = self._guarded(loop.iter, "_loop_steps")
        for out in list(tree.find_all(nodes.Output)):
            out.nodes = [self._guarded(child, "_output") for child in out.nodes]
        for concat in list(tree.find_all(nodes.Concat)):
            concat.nodes = [self._guarded(nodes.List(concat.nodes, lineno=concat.lineno), "_concat")]
        return self.from_string(tree)

    def _guarded(self, node: nodes.Expr, name: str) -> nodes.Filter:
        guard = nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)
        guard.set_environment(self)
        return guard

    def render(self, template: jinja2.Template, **variables) -> str:
        """template.render(**variables) within the limits (TemplateLimitError past one)."""
        previous = getattr(self._local, "budget", None)
        self._local.budget = _Budget(self.limits)
        try:
            return template.render(**variables)
        finally:
            self._local.budget = previous

    def budget(self) -> _Budget:
        """The account of the render under way in this thread."""
        budget = getattr(self._local, "budget", None)
        if budget is None:  # e.g. jinja2 folding a constant while compiling: not now, at render time
            raise TemplateLimitError("a bounded template runs only inside BoundedEnvironment.render")
        return budget

    # --- the checks ------------------------------------------------------------------------------

    def call_binop(self, context, operator: str, left, right):
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept cheap
            if len(left) + len(right) <= self.limits.max_output_chars:
                return left + right
        budget = self.budget()
        budget.tick()
        what = f"the operator {operator}"
        bits = int_bits(operator, left, right)
        if bits is not None and bits > MAX_INT_BITS:
            raise TemplateLimitError(f"{what} would make an integer of about {bits} bits; at most {MAX_INT_BITS}")
        size = binop_size(operator, left, right, budget.limit)
        if size is not None:
            budget.fits(size, what)
        return budget.made(self.binop_table[operator](left, right), what)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's own signature)
        budget = __self.budget()
        name = __obj.name if isinstance(__obj, Macro) else getattr(__obj, "__name__", type(__obj).__name__)
        what = f"calling {name}"
        budget.tick()
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(target, "__self__", None)
        if isinstance(owner, (str, bytes)):  # a method of a string: its integers are widths or positions
            budget.check_ints(args + tuple(kwargs.values()), what)
            size = method_size(owner, getattr(target, "__name__", ""), args, kwargs, budget.limit)
            if size is not None:
                budget.fits(size, what)
        if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop: count its steps
            args = (__self._steps(budget, args[0]),) + args[1:]
        budget.depth += 1
        try:
            if budget.depth > budget.limits.max_call_depth:
                raise TemplateLimitError(f"calls nest deeper than {budget.limits.max_call_depth} (max_call_depth): "
                                         f"a macro that calls itself without end?")
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        return budget.made(result, what)

    def _guard_filter(self, name: str, f):
        structural, sized_args = name in _STRUCTURAL, name in _SIZED_ARGS

        @functools.wraps(f)
        def guarded(*args, **kwargs):
            budget, what = self.budget(), f"the filter {name}"
            budget.tick()
            lead = 1 if args and isinstance(args[0], (Context, nodes.EvalContext, jinja2.Environment)) else 0
            value, rest = (args[lead] if len(args) > lead else None), args[lead + 1:]
            if sized_args:
                budget.check_ints(rest + tuple(kwargs.values()), what)
            if name == "join" and not isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
                value = list(value)  # a generator (from map or select) is measured before it is joined
                args = args[:lead] + (value,) + rest
            limit = budget.limit
            if not structural:
                budget.fits(size_of(value, limit), what)
            if name == "sum":
                _numbers_only(rest, kwargs)
            size = filter_size(name, value, rest, kwargs, limit)
            if size is not None:
                budget.fits(size, what)
            return budget.made(f(*args, **kwargs), what)

        return guarded

    def _range(self, *args) -> range:
        r = range(*args)
        if len(r) > self.budget().limits.max_range:
            raise TemplateLimitError(f"range() of {len(r)} elements; at most {self.budget().limits.max_range} "
                                     f"(max_range)")
        return r

    def _loop_steps(self, iterable):
        return self._steps(self.budget(), iterable)

    @staticmethod
    def _steps(budget: _Budget, iterable):
        """A loop's iterable, its steps counted: all at once when it has a length (a `break`
        spends them all the same), else one by one as they are taken."""
        try:
            n = len(iterable)
        except TypeError:
            return BoundedEnvironment._one_by_one(budget, iterable)
        budget.step(n)
        return iterable

    @staticmethod
    def _one_by_one(budget: _Budget, iterable):
        for item in iterable:
            budget.step()
            yield item

    def _output(self, value) -> str:
        budget = self.budget()
        if type(value) is not str:
            budget.fits(size_of(value, budget.limit), "printing a value")
            value = str(value)
        return budget.write(value)

    def _concat(self, parts: list) -> str:
        budget, texts, total = self.budget(), [], 0
        budget.tick()
        for part in parts:
            if not isinstance(part, str):
                budget.fits(total + size_of(part, budget.limit), "the operator ~")
            texts.append(str(part))
            total += len(texts[-1])
            budget.fits(total, "the operator ~")
        return "".join(texts)

    def join_bounded(self, pieces) -> str:
        """Join an iterator of strings, refused as soon as they pass the size limit (for filters
        such as tojson with an indent, whose output can be much larger than their input)."""
        budget, out, total = self.budget(), [], 0
        for piece in pieces:
            total += len(piece)
            budget.fits(total, "joining text")
            out.append(piece)
        return "".join(out)
