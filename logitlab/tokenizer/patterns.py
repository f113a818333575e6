"""Pre-tokenization for the tokenizer stage: split patterns, their fast ASCII lane, safe cut
points and special-token matching.

tokenizer.py (encoding) and bpe_pretokenize.py (training input) both split text with what is
defined here, so training and encoding always see the same pre-tokens.

What a split pattern must do. The pieces are the pattern's whole matches (group 0, as tiktoken
and Hugging Face `tokenizers` take them; capture groups are allowed and ignored), found left to
right. They must cover the text: a character no match takes would be lost from the ids, so
`resolve_pattern` refuses a custom pattern that drops part of any of its probe strings
(`COVERAGE_PROBES`: letters, digits, punctuation, whitespace runs, newlines, non-ASCII, emoji)
or that matches the empty string (tiktoken cannot encode an empty piece), and the splitter
raises if a text still loses characters. The built-in patterns cover every text.

Unicode tables. The `regex` module and tiktoken's regex engine each carry the Unicode tables of
their release, and a newer `regex` knows letters and digits (\\p{L}, \\p{N}) that tiktoken still
treats as unassigned, so the two would split such text differently. The splitter here follows
tiktoken (the fast encoder; Hugging Face `tokenizers` agrees with it, tested on every code
point): code points that tiktoken's engine does not know are matched as an unassigned one
(U+10FFFF), in training as in encoding. The list is asked of the installed tiktoken once per
process (`unknown_to_tiktoken`), the first time non-ASCII text is split. The other direction
cannot be mapped: code points tiktoken knows but an older `regex` release does not would still
split differently (tests/test_tokenizer.py sweeps every code point and names any).
"""

from __future__ import annotations

import array
import re
import sys
from collections.abc import Iterable
from functools import lru_cache

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# GPT-2's pattern after a Digits(individual_digits=true) step, as StarCoder's and SmolLM's
# tokenizer.json have it: each digit (\p{N}) is a piece of its own and GPT-2's pattern splits the
# text between the digits. As one regex (what tiktoken runs): a digit first, then GPT-2's
# alternatives without its digit one, the whitespace lookahead also stopping before a digit (where
# a stretch between digits ends). The reference splitter runs the two steps (`_digits_first`).
GPT2_DIGITS_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
PATTERNS = {"gpt2": GPT2_PATTERN, "cl100k": CL100K_PATTERN, "gpt2_digits": GPT2_DIGITS_PATTERN}

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


# Texts a custom split pattern must cover whole (see the module docstring). The first is the
# example an error message shows most often.
COVERAGE_PROBES = (
    "hello, world!",
    "It's 2024: they'll say \"we've\" done it (50% off) -- $3.14 & x=[1, 22]; #tag @you ~/a_b\\c`^|{}<>?",
    "  two  spaces\tand\ttabs \n\nnew\r\nlines\n\n\n   \x0b\x0c trailing   ",
    "Grüße aus München, ÄÖÜ ß — naïve café «quoted» ¿qué? ¡sí! 1½ €5 ©™ ° µ",
    "中文分词测试，你好世界！日本語のテキスト。한국어 텍스트 Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
    "Emoji: 🎉🚀 👩‍👩‍👧‍👦 🇩🇪 ❤️ e\u0301 \u0301 x\u0308 ①②③ ٣٤٥ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\x00\x01\x1b[0m\x1c\x1f\x7f \xa0\u2028\u2029\u3000\ufeff\ufffd \U0010ffff",
    "x", " ", "\n", "'", "1", "🎉",
)


def resolve_pattern(pattern: str) -> str:
    """A pattern name ("gpt2", "cl100k") or a regex -> the regex. A custom regex is compiled and
    checked against COVERAGE_PROBES: it must cover them whole and never match the empty string."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be 'gpt2', 'cl100k' or a non-empty regex, got {pattern!r}")
    text = PATTERNS.get(pattern, pattern)
    try:
        compiled = regex.compile(text)
    except regex.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regex: {exc}") from exc
    if text not in PATTERNS.values():
        _check_covers(compiled)
    return text


def _check_covers(compiled: regex.Pattern) -> None:
    """ValueError unless `compiled` splits every probe into non-empty pieces that cover it."""
    for probe in COVERAGE_PROBES:
        gaps, empty_at = _uncovered(compiled, probe)
        if empty_at is not None:
            raise ValueError(f"split pattern {_show(compiled.pattern)} matches the empty string (at character "
                             f"{empty_at} of {probe!r}); every piece must hold at least one character")
        if gaps:
            raise ValueError(f"split pattern {_show(compiled.pattern)} does not cover the input: it drops "
                             f"{_and([g for _, g in gaps])} from {probe!r}")


def _uncovered(compiled: regex.Pattern, text: str) -> tuple[list[tuple[int, str]], int | None]:
    """((start, stretch) for each stretch of `text` no match takes, left to right; the position of
    the first empty match, or None)."""
    gaps, pos, empty_at = [], 0, None
    for m in compiled.finditer(text):
        if m.start() > pos:
            gaps.append((pos, text[pos:m.start()]))
        if m.end() == m.start() and empty_at is None:
            empty_at = m.start()
        pos = m.end()
    if pos < len(text):
        gaps.append((pos, text[pos:]))
    return gaps, empty_at


def _show(pattern: str) -> str:
    """A pattern quoted as a user typed it (repr only when it holds unprintable characters)."""
    return f"'{pattern}'" if pattern.isprintable() else repr(pattern)


def _and(items: list[str], shown: int = 3) -> str:
    """"'a'", "'a' and 'b'", "'a', 'b' and 'c'", "'a', 'b', 'c' and 4 more"."""
    quoted = [repr(x) for x in items[:shown]]
    if len(items) > shown:
        return ", ".join(quoted) + f" and {len(items) - shown} more"
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def uncovered_error(pattern: str, text: str) -> ValueError:
    """The error for a text that `pattern` does not split whole, naming what it drops and where."""
    masked = _as_tiktoken_sees(text)
    gaps = [(start, text[start:start + len(g)]) for start, g in _uncovered(regex.compile(pattern), masked)[0]]
    if len(text) <= 80:
        where = f"from {text!r}"
    else:
        where = f"from a text of {len(text)} characters (the first at character {gaps[0][0]})"
    return ValueError(f"split pattern {_show(pattern)} does not cover the input: it drops "
                      f"{_and([g for _, g in gaps])} {where}")


# ------------------------------------------------------------------------------ Unicode tables
_UNASSIGNED = "\U0010ffff"  # a noncharacter: unassigned (Cn) in every Unicode version


@lru_cache(maxsize=1)
def unknown_to_tiktoken() -> frozenset[str]:
    """The code points that the installed `regex` release assigns but tiktoken's regex engine
    treats as unassigned (newer Unicode); empty when the two agree.

    Asked of tiktoken itself: an Encoding with the 256 bytes as its only tokens and the pattern
    \\p{Cn}+ returns, as bytes, exactly the characters its engine holds unassigned."""
    import tiktoken

    # Every code point but the surrogates (not valid UTF-8), as one string.
    codes = array.array("I", range(0xD800))
    codes.extend(range(0xE000, 0x110000))
    every = codes.tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")
    assigned = regex.sub(r"[\p{Cn}\p{Co}]+", "", every)  # what `regex` assigns (private use aside)
    probe = tiktoken.Encoding("logitlab-unicode-probe", pat_str=r"\p{Cn}+",
                              mergeable_ranks={bytes([b]): b for b in range(256)}, special_tokens={})
    return frozenset(probe.decode(probe.encode_ordinary(assigned)))


@lru_cache(maxsize=1)
def _unknown_class() -> regex.Pattern:
    """A character class of `unknown_to_tiktoken()`, as ranges of consecutive code points."""
    ranges: list[list[int]] = []  # [first, last] of each run
    for c in sorted(map(ord, unknown_to_tiktoken())):
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return regex.compile("[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges) + "]")


def _regex_split(pattern: str):
    """text -> whole matches of `pattern` (the `regex` module, code points classified as tiktoken
    does: see unknown_to_tiktoken)."""
    compiled = regex.compile(pattern)
    plain = compiled.findall if compiled.groups == 0 else (lambda t: [m.group() for m in compiled.finditer(t)])

    def split(text: str) -> list[str]:
        masked = _as_tiktoken_sees(text)
        if masked is text:
            return plain(text)
        # Same length, so the matches' spans on the masked text are the pieces of the original.
        return [text[m.start():m.end()] for m in compiled.finditer(masked)]

    return split


def _as_tiktoken_sees(text: str) -> str:
    """`text` with each code point tiktoken does not know replaced by an unassigned one (same
    length); `text` itself when there is none."""
    if text.isascii() or unknown_to_tiktoken().isdisjoint(text):  # a set look-up per character
        return text
    return _unknown_class().sub(_UNASSIGNED, text)


# A Digits step's digits: Rust's char::is_numeric (the general categories Nd, Nl and No), asked
# of each code point as it is, so without the masking above (the `regex` module's \p{N} agrees
# with `tokenizers`' Digits on every code point: tests/test_tokenizer_digits.py).
_DIGIT, _ASCII_DIGIT = regex.compile(r"\p{N}"), re.compile(r"[0-9]")


def _digits_first(split):
    """text -> pieces: each digit alone and `split` on the stretches between, as a tokenizer.json
    runs Digits(individual_digits=true) and then its ByteLevel regex on each piece."""
    def pieces(text: str) -> list[str]:
        out, pos = [], 0
        for m in (_ASCII_DIGIT if text.isascii() else _DIGIT).finditer(text):
            if m.start() > pos:
                out += split(text[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(text):
            out += split(text[pos:])
        return out

    return pieces


@lru_cache(maxsize=1)
def digits_unknown_to_tiktoken() -> frozenset[str]:
    """The digits (\\p{N}) that tiktoken's regex engine holds unassigned (newer Unicode): the
    one-regex form of gpt2_digits does not isolate them, so a text holding one is split by the
    two steps (the reference path)."""
    return frozenset(c for c in unknown_to_tiktoken() if _DIGIT.match(c))


def pretokenizer(pattern: str):
    """text -> list of pre-tokens for a resolved pattern (ASCII text takes the `re` fast lane).

    Pieces are whole matches (capture groups ignored). For a custom pattern the split checks that
    the pieces cover the text and raises ValueError naming what it would drop; the built-in
    patterns cover every text by construction (their last alternatives take any letter, digit,
    whitespace or other character). gpt2_digits runs its two steps: digits, then GPT-2's."""
    if pattern == GPT2_DIGITS_PATTERN:
        return _digits_first(pretokenizer(GPT2_PATTERN))
    full = _regex_split(pattern)
    ascii_pattern = ASCII_PATTERNS.get(pattern)
    if ascii_pattern is None:
        def checked(text: str) -> list[str]:
            pieces = full(text)
            if sum(map(len, pieces)) != len(text):
                raise uncovered_error(pattern, text)
            return pieces

        return checked
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
