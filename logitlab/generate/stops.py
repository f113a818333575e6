"""Stop strings: where the first of them appears in a stream of pieces (text, bytes or token ids),
found in time linear in what is fed, however long the stop strings are.

stops.py owns stop-string matching for every generation path: the decode loop (the bytes of each
new token and the token ids themselves, loop.py), the server's engine (serve/engine.py), and the
text a user is shown, which holds back a tail that could still become a stop string
(`StopHoldBack`: the CLI's generate and chat, the server's TextStream).

The plain definition (`split_reference`): after each piece, the text so far is cut before the
earliest occurrence of any stop string; with none, the longest tail that is a proper prefix of a
stop string is held back. Computed that way, each piece costs the square of a stop string's
length (every prefix of every stop string tried against the tail): a 500 KB stop string made one
token cost seconds. `StopMatcher` keeps instead, per stop string, how many of its first items the
stream ends with, and advances that count over each new item by the Knuth-Morris-Pratt failure
links (Knuth, Morris and Pratt 1977): amortised O(1) per item and stop string, after O(len(s)) once
per stop string to build the links. A test checks both against each other on random streams.
"""

from __future__ import annotations

from typing import Sequence


def failure_links(s: Sequence) -> list[int]:
    """links[i] = the length of the longest proper prefix of s[:i + 1] that is also its suffix
    (the KMP prefix function): where a partial match of s falls back to when the next item differs."""
    links = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = links[k - 1]
        if s[i] == s[k]:
            k += 1
        links[i] = k
    return links


class StopStrings:
    """Stop strings prepared once, to be matched against many streams: all str, all bytes, or all
    tuples of token ids (empty ones are dropped). `matcher()` starts a stream."""

    def __init__(self, stops: Sequence[Sequence]):
        self.stops = tuple(s for s in stops if len(s))
        self.links = tuple(failure_links(s) for s in self.stops)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def matcher(self) -> StopMatcher:
        return StopMatcher(self)


class StopMatcher:
    """One stream's progress: for each stop string, how many of its first items the stream so far
    ends with (`state`). Feed each piece once, in order."""

    def __init__(self, stops: StopStrings):
        self.stops = stops
        self.state = [0] * len(stops.stops)

    @property
    def held(self) -> int:
        """The length of the longest tail of the stream that is a proper prefix of a stop string."""
        return max(self.state, default=0)

    def feed(self, piece: Sequence) -> int | None:
        """Advance over `piece` -> where the earliest-starting stop string that ends inside it
        starts, as an offset into piece (negative: it began in earlier pieces), or None."""
        found = None
        for j, (s, links) in enumerate(zip(self.stops.stops, self.stops.links)):
            q, n, first = self.state[j], len(s), None
            for i, item in enumerate(piece):
                while q and s[q] != item:
                    q = links[q - 1]
                if s[q] == item:
                    q += 1
                if q == n:  # s ends at item i; later matches of the same s start later
                    first = i + 1 - n if first is None else first
                    q = links[q - 1]
            self.state[j] = q
            if first is not None and (found is None or first < found):
                found = first
        return found


class StopHoldBack:
    """Passes text through, holding back a tail that could be the start of a stop string, and
    cutting the text where a stop string appears (the stop string itself is not shown): feed
    each piece, then flush() at the end. `done` once a stop string was found."""

    def __init__(self, stops: Sequence[str]):
        self._stops = StopStrings([s for s in stops if s])
        self._matcher = self._stops.matcher()
        self._held, self.done = "", False

    def feed(self, piece: str) -> str:
        if self.done:
            return ""
        text = self._held + piece
        start = self._matcher.feed(piece)
        if start is not None:
            self.done, self._held = True, ""
            return text[:len(text) - len(piece) + start]
        cut = len(text) - self._matcher.held
        out, self._held = text[:cut], text[cut:]
        return out

    def flush(self) -> str:
        """The held-back tail (the stream has ended, so it can no longer become a stop string)."""
        out = "" if self.done else self._held
        self._held, self._matcher = "", self._stops.matcher()
        return out


def split_reference(text: str, stops: Sequence[str]) -> tuple[int | None, int]:
    """The plain definition, for tests: -> (where the earliest stop string in `text` starts, or
    None; how many characters at its end could start a stop string, 0 after a hit).
    Quadratic in the stop strings' lengths."""
    hits = [text.find(s) for s in stops if s and s in text]
    if hits:
        return min(hits), 0
    return None, max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
