"""Field types of the package's config dataclasses: configs are read from JSON, so each field is
checked against its declared type, and an error names the field and the value.

fields.py owns check_field_types, conform, describe_type and config_from_dict, which every
frozen config of the package shares (ModelConfig and RopeScaling in config.py, the trainer's
configs); config.py re-exports them. It imports nothing of logitlab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Literal


def config_from_dict(cls: type, data: dict, name: str | None = None):
    """Build the config dataclass `cls` from a dict (the inverse of dataclasses.asdict); a value
    that is not a dict, or unknown keys, are an error naming them and the known fields. `name`
    (the field the dict was read from, e.g. "rope_scaling") leads the message; default the class."""
    what = name or cls.__name__
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected an object of {cls.__name__} fields, got {_shown(data)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {what} field(s) {unknown}; known fields: {sorted(names)}")
    return cls(**data)


# ------------------------------------------------------------------------------------------
# Field types. Configs are read from JSON, so every field is checked against its declared type
# (the dataclass annotations are the one source): a "false" string is not a bool, 1.0 is not an int.
# ------------------------------------------------------------------------------------------

_BAD = object()  # _conform: the value does not have the type
_PLURAL = {int: "integers", float: "finite numbers", str: "strings", bool: "booleans"}
_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
          type(None): "null", dict: "an object", list: "a list"}


def check_field_types(config, prefix: str = "") -> None:
    """Check every field of the dataclass instance `config` against its annotation, the way a
    value read from JSON must match it: `bool` takes only true/false; `int` an int that is not a
    bool; `float` an int or float (not a bool), finite; `Literal[...]` one of its values;
    `X | None` also None; `tuple[X, ...]` a tuple or list of X; a dataclass an instance or a dict
    of its fields. A mismatch is a ValueError naming prefix + field, the value and the type.
    Values are normalised in place (frozen dataclasses too): an int in a float field becomes a
    float, a list in a tuple field a tuple, a dict in a dataclass field that dataclass."""
    hints = _type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out = conform(value, hints[f.name], prefix + f.name)
        if out is not value:
            object.__setattr__(config, f.name, out)


def conform(value, tp, name: str):
    """`value` as a field of type `tp` holds it (see check_field_types); ValueError naming `name`,
    the value and the expected type when it does not have that type."""
    out = _conform(value, tp, name)
    if out is not _BAD:
        return out
    if typing.get_origin(tp) is Literal:
        raise ValueError(f"{name} must be one of {typing.get_args(tp)}, got {_shown(value)}")
    raise ValueError(f"{name}: expected {describe_type(tp)}, got {_shown(value)}")


def describe_type(tp) -> str:
    """A field type in JSON words, for messages: `int | None` -> 'an integer or null'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        parts = [describe_type(a) for a in args]
        return " or ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + " or " + parts[-1]
    if origin in (tuple, list) and args and (origin is list or args[-1] is Ellipsis):
        return f"a list of {_PLURAL.get(args[0]) or 'items each ' + describe_type(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} items ({', '.join(describe_type(a) for a in args)})"
    if dataclasses.is_dataclass(tp):
        return f"an object ({', '.join(f.name for f in dataclasses.fields(tp))})"
    return _NAMES.get(tp) or getattr(tp, "__name__", str(tp))


def _conform(value, tp, name: str):
    """`value` normalised to the field type `tp` (see check_field_types), or _BAD."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return value if any(type(value) is type(a) and value == a for a in args) else _BAD
    if origin in (typing.Union, types.UnionType):
        return next((out for out in (_conform(value, a, name) for a in args) if out is not _BAD), _BAD)
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return _BAD
        kinds = args if origin is tuple and args[-1:] != (Ellipsis,) else args[:1] * len(value)
        if len(kinds) != len(value):
            return _BAD
        out = [_conform(v, k, f"{name}[{i}]") for i, (v, k) in enumerate(zip(value, kinds))]
        return _BAD if any(o is _BAD for o in out) else origin(out)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return config_from_dict(tp, value, name)
        return value if isinstance(value, tp) else _BAD
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _BAD
        try:
            value = float(value)
        except OverflowError:  # an int beyond float range
            return _BAD
        return value if math.isfinite(value) else _BAD
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _BAD
    if tp is type(None):
        return value if value is None else _BAD
    if not isinstance(tp, type):  # an annotation this checker does not know: not checked
        return value
    return value if isinstance(value, tp) else _BAD


@functools.cache
def _type_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
