"""Lazy public names for a package (PEP 562), shared by every package's `__init__`.

A package lists its public names and the module each lives in; nothing is imported until a name is
first used, so `import logitlab.model` stays cheap and has no side effects. This module imports
nothing of logitlab, so any stage may use it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable


def lazy_exports(package: str, exports: dict[str, str],
                 public: Iterable[str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`: `exports` maps a public name to the module
    (relative to the package) that defines it; `public` is what `dir()` lists."""
    listed = sorted(public)

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)   # resolved once: later uses skip this hook
        return value

    def __dir__() -> list[str]:
        return list(listed)

    return __getattr__, __dir__
