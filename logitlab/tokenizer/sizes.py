"""Sizes, for the chat-template sandbox's checks (sandbox.py): how big a value is, and how big
the result of an operation would be, computed without making it.

A value's size is what printing it would write, within a small factor: the characters of a
string, or the elements of a container plus the size of each. An operation's size is an upper
bound on its result's, for the operations that can make more than they are given (a sequence
repeated, a power, formatting with field widths, replace, join, indent, ...); for the others
(None) the result is no bigger than what went in, and the sandbox checks it once made.
"""

from __future__ import annotations

import re

MAX_INT_BITS = 1 << 14  # about 4,900 digits; Python will not even print an int past 4,300
_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # str.format taking a width from its arguments: {:{}}


def size_of(value, limit: int) -> int:
    """A value's size: the characters of a string, the elements of a container plus the size of
    each (a shared part counted as often as it appears, as printing it would), 1 for anything
    else. Counting stops once past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
        else:
            total += 1
    return total


def shallow(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 1


def format_size(fmt: str, args: tuple, limit: int) -> int:
    """An upper bound on what `fmt % args` or fmt.format(*args) writes: the format string, what
    the arguments hold, every number in the format string taken as a field width, and, when a
    width comes from the arguments (`%*d`, `{:{}}`), every integer argument too."""
    total = len(fmt) + sum(size_of(a, limit) for a in args)
    total += sum(int(d) if len(d) < 10 else limit + 1 for d in _DIGITS.findall(fmt))
    if "*" in fmt or _NESTED_FIELD.search(fmt):
        total += sum(abs(a) for a in flat(args) if isinstance(a, int))
    return total


def flat(args) -> list:
    """Arguments and, one level down, the items and values of those that are containers."""
    out = []
    for a in args:
        out.append(a)
        if isinstance(a, (list, tuple)):
            out.extend(a)
        elif isinstance(a, dict):
            out.extend(a.values())
    return out


def replace_size(s, old, new, count=-1) -> int:
    """len(s.replace(old, new, count)), computed without making it."""
    hits = len(s) + 1 if not old else s.count(old)
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def int_bits(operator: str, left, right) -> int | None:
    """About how many bits `left operator right` has, for the products and powers of integers,
    whose size is not bounded by their operands' (None for anything else)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return None
    if operator == "*":
        return left.bit_length() + right.bit_length()
    if operator == "**" and right > 0 and abs(left) > 1:
        return left.bit_length() * right
    return None


def binop_size(operator: str, left, right, limit: int) -> int | None:
    """The size of `left operator right` before computing it, for a sequence repeated or joined
    and a string formatted (None: no more than its operands, or integers: int_bits)."""
    if operator == "*" and not (isinstance(left, int) and isinstance(right, int)):
        count, seq = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(count, int) and isinstance(seq, (str, bytes, list, tuple)):
            return max(count, 0) * len(seq)
    elif operator == "+" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
        return len(left) + len(right)
    elif operator == "%" and isinstance(left, str):
        return format_size(left, right if isinstance(right, tuple) else (right,), limit)
    return None


def method_size(owner, name: str, args: tuple, kwargs: dict, limit: int) -> int | None:
    """The size a str or bytes method would make, for the methods that can make more than they
    are given (None for the others)."""
    if name in ("format", "format_map"):
        values = tuple(args) + tuple(kwargs.values())
        return format_size(owner if isinstance(owner, str) else "", values, limit)
    if name == "join" and args:
        return size_of(args[0], limit) + shallow(args[0]) * len(owner)
    if name == "replace" and len(args) >= 2:
        return replace_size(owner, *args[:3])
    if name == "expandtabs":
        tab = (args or (kwargs.get("tabsize", 8),))[0]
        return len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0)
    if name == "translate" and args and isinstance(args[0], dict):
        longest = max((shallow(v) for v in args[0].values() if v is not None), default=1)
        return len(owner) * max(longest, 1)
    return None


def filter_size(name: str, value, args: tuple, kwargs: dict, limit: int) -> int | None:
    """The size a filter would make, for the filters that can make more than they are given."""
    if name == "replace" and len(args) >= 2:
        return replace_size(str(value), *(str(a) for a in args[:2]), *args[2:3])
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        per_line = width if isinstance(width, int) else len(str(width))
        text = str(value)
        return len(text) + (text.count("\n") + 1) * max(per_line, 0)
    if name == "join":
        sep = args[0] if args else kwargs.get("d", "")
        return size_of(value, limit) + shallow(value) * len(str(sep))
    if name == "wordwrap":
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        return len(str(value)) * (1 + len(str(wrap)))
    if name == "format":
        return format_size(str(value), tuple(args) + tuple(kwargs.values()), limit)
    return None
