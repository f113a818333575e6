"""Pre-tokenization for the tokenizer stage: split patterns, their fast ASCII lane, safe cut
points and special-token matching.

tokenizer.py (encoding) and bpe_pretokenize.py (training input) both split text with what is
defined here, so training and encoding always see the same pre-tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PATTERNS = {"gpt2": GPT2_PATTERN, "cl100k": CL100K_PATTERN}

# The same two patterns for pure-ASCII text, spelled for the standard `re` module, which runs
# them about twice as fast as `regex`. On ASCII, \p{L} is [A-Za-z], \p{N} is [0-9] and `regex`'s
# \s is [\t\n\v\f\r ] (`re`'s \s would add \x1c-\x1f, hence the explicit classes).
_W, _NW = r"[\t\n\x0b\x0c\r ]", r"[^\t\n\x0b\x0c\r ]"
ASCII_PATTERNS = {
    GPT2_PATTERN: rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\t\n\x0b\x0c\r A-Za-z0-9]+"""
                  rf"""|{_W}+(?!{_NW})|{_W}+""",
    CL100K_PATTERN: rf"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{{1,3}}"""
                    rf"""| ?[^\t\n\x0b\x0c\r A-Za-z0-9]+[\r\n]*|{_W}*[\r\n]+|{_W}+(?!{_NW})|{_W}+""",
}

# A position no pre-token of the GPT-2 or cl100k pattern crosses, and where the text before it
# splits the same way when it ends there: before a single space between two non-spaces, or after
# a single newline between two non-spaces. (After "\n\n" is not safe: at the end of a string,
# GPT-2's \s+(?!\S) takes "\n\n" whole.) Used to cut long text into independent pieces
# (encode_iterable, parallel training).
SAFE_CUT = regex.compile(r"(?r)(?<=\S) (?=\S)|(?<=\S\n)(?=\S)")
_SAFE_CUT_FORWARD = regex.compile(SAFE_CUT.pattern[4:])
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def resolve_pattern(pattern: str) -> str:
    """A pattern name ("gpt2", "cl100k") or a regex -> the regex (compiled once to check it)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be 'gpt2', 'cl100k' or a non-empty regex, got {pattern!r}")
    text = PATTERNS.get(pattern, pattern)
    try:
        regex.compile(text)
    except regex.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regex: {exc}") from exc
    return text


def pretokenizer(pattern: str):
    """text -> list of pre-tokens for a resolved pattern (ASCII text takes the `re` fast lane)."""
    full = regex.compile(pattern).findall
    ascii_pattern = ASCII_PATTERNS.get(pattern)
    if ascii_pattern is None:
        return full
    fast = re.compile(ascii_pattern).findall

    def split(text: str) -> list[str]:
        if text.isascii():
            return fast(text)
        if len(text) - len(text.encode("ascii", "ignore")) > len(text) >> 8:
            return full(text)  # dense non-ASCII: one `regex` pass
        # Sparse non-ASCII (e.g. source code with a few accents): cut each non-ASCII stretch out
        # at SAFE_CUT points so the ASCII around it still takes the fast lane.
        out: list[str] = []
        pos, n = 0, len(text)
        while pos < n:
            m = _NON_ASCII.search(text, pos)
            if m is None:
                out += fast(text[pos:])
                break
            cut = SAFE_CUT.search(text, pos, m.start())
            start = cut.start() if cut is not None else pos
            if start > pos:
                out += fast(text[pos:start])
            after = _SAFE_CUT_FORWARD.search(text, m.end())
            end = after.start() if after is not None else n
            out += full(text[start:end])
            pos = end
        return out

    return split


def pattern_name(pattern: str) -> str | None:
    """The name of a built-in pattern ("gpt2", "cl100k"), or None for a custom regex."""
    for name, text in PATTERNS.items():
        if pattern in (name, text):
            return name
    return None


def special_regex(specials: Iterable[str]) -> regex.Pattern | None:
    """Alternation of escaped special tokens, longest first, so the longest one wins at a position."""
    items = sorted(set(specials), key=lambda s: (-len(s), s))
    if not items:
        return None
    return regex.compile("|".join(regex.escape(s) for s in items))


def check_special_tokens(specials: Iterable[str]) -> list[str]:
    out = []
    for s in specials:
        if not isinstance(s, str) or s == "":
            raise ValueError(f"special tokens must be non-empty strings, got {s!r}")
        if s not in out:
            out.append(s)
    return out


def find_safe_cut(buf: str, special_re: regex.Pattern | None, longest_special: int = 0) -> int:
    """The last SAFE_CUT position in `buf` outside every special-token match (0: none).

    Only positions at least `longest_special` characters before the end are taken: a special
    token that straddles such a cut lies wholly inside `buf`, so it is seen even when more text
    follows."""
    end = len(buf) - longest_special + 1 if longest_special else len(buf)
    while end > 0:
        m = SAFE_CUT.search(buf, 0, end)
        if m is None:
            return 0
        cut, inside = m.start(), None
        if special_re is not None:
            lo, hi = max(0, cut - longest_special), min(len(buf), cut + longest_special)
            for s in special_re.finditer(buf, lo, hi):
                if s.start() < cut < s.end():
                    inside = s.start()
        if inside is None:
            return cut
        end = inside
    return 0
