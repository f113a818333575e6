"""Stop strings (generate/stops.py): the KMP matcher and the hold-back against the plain definition
on random streams (hypothesis), over text, bytes and token ids; and a cost that grows with what is
fed and the stop strings' lengths, not with the square of a stop string's length, for the hold-back
shared by the CLI and the server."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from logitlab.generate.stops import StopHoldBack, StopStrings, failure_links, split_reference

# a small alphabet makes partial matches, overlaps and repeated prefixes common
stops_text = st.lists(st.text(alphabet="abc", min_size=1, max_size=7), max_size=4)
pieces_text = st.lists(st.text(alphabet="abc", max_size=6), max_size=14)


def reference_stream(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """The hold-back as it was first written: after each piece, cut before the earliest stop
    string in what is held plus the piece, else hold back the longest tail that could start one
    -> (what each piece releases, whether a stop string was found, what is still held)."""
    held, out = "", []
    for piece in pieces:
        text = held + piece
        cut, keep = split_reference(text, stops)
        if cut is not None:
            return out + [text[:cut]], True, ""
        out.append(text[:len(text) - keep])
        held = text[len(text) - keep:]
    return out, False, held


@settings(max_examples=300, deadline=None)
@given(stops_text, pieces_text)
def test_hold_back_equals_the_plain_definition(stops, pieces):
    hold = StopHoldBack(stops)
    got = [hold.feed(p) for p in pieces]
    want, done, held = reference_stream(stops, pieces)
    assert got[:len(want)] == want and not any(got[len(want):])
    assert hold.done == done
    assert hold.flush() == held
    assert "".join(want) + held == ("".join(pieces) if not done else "".join(want))


def _earliest_ending_in(stream, start: int, stops) -> int | None:
    """Brute force: the earliest start of a stop string that ends in stream[start:], relative to start."""
    found = [p - start for s in stops for p in range(len(stream) - len(s) + 1)
             if start < p + len(s) <= len(stream) and stream[p:p + len(s)] == s]
    return min(found, default=None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=5).map(lambda b: bytes(x % 3 for x in b)), max_size=4),
       st.lists(st.binary(max_size=5).map(lambda b: bytes(x % 3 for x in b)), max_size=14))
def test_matcher_over_bytes_finds_every_stop_where_brute_force_does(stops, pieces):
    matcher, stream = StopStrings(stops).matcher(), b""
    for piece in pieces:
        start = len(stream)
        stream += piece
        assert matcher.feed(piece) == _earliest_ending_in(stream, start, stops)
        proper = [n for s in stops for n in range(len(s)) if stream.endswith(s[:n])]
        assert matcher.held == max(proper, default=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple), max_size=3),
       st.lists(st.integers(0, 2), max_size=30))
def test_matcher_over_token_ids_one_at_a_time(sequences, ids):
    matcher = StopStrings(sequences).matcher()
    for n, token in enumerate(ids):
        hit = matcher.feed((token,))
        ends_here = [s for s in sequences if len(s) <= n + 1 and tuple(ids[n + 1 - len(s):n + 1]) == s]
        assert (hit is not None) == bool(ends_here)
        if ends_here:
            assert hit == 1 - max(len(s) for s in ends_here)


def test_failure_links_by_hand():
    assert failure_links("aabaaab") == [0, 1, 0, 1, 2, 2, 3]
    assert failure_links(b"abab") == [0, 0, 1, 2]
    assert failure_links(()) == []


class CountingStr(str):
    """A str that counts the characters read from it by indexing and slicing."""

    reads = 0

    def __getitem__(self, key):
        part = str.__getitem__(self, key)
        CountingStr.reads += len(part)
        return part


def test_a_long_stop_string_costs_what_is_fed_not_its_length_squared():
    """A 20,001-character stop string, fed by the CLI's hold-back and by the server's TextStream
    (a) 16 short pieces that do not match it, (b) all of it 4 characters at a time. Trying every
    prefix of the stop string against the tail reads about 2 * 10**8 characters in (a) and
    5 * 10**7 in (b); the matcher a few per character fed, after one pass over the stop string."""
    from logitlab.serve.protocol import TextStream
    from logitlab.tokenizer.core import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    stop = CountingStr("ab" * 10_000 + "c")
    for text, shown in (("abab" * 16, "abab" * 16), ("x" + "ab" * 10_000 + "c" + "tail", "x")):
        pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
        CountingStr.reads = 0
        hold = StopHoldBack([stop])
        assert "".join(hold.feed(p) for p in pieces) + hold.flush() == shown
        assert CountingStr.reads <= 8 * (len(stop) + len(text))  # a constant per character of each
        CountingStr.reads = 0
        stream = TextStream(tok, [stop])
        assert "".join(stream.feed(i) for i in tok.encode(text)) + stream.finish() == shown
        assert CountingStr.reads <= 8 * (len(stop) + len(text))


def test_the_earliest_starting_stop_string_wins_not_the_first_to_end():
    hold = StopHoldBack(["abcd", "bc"])
    assert hold.feed("xa") == "x" and hold.feed("bcd") == "" and hold.done  # "abcd" starts before "bc"
    hold = StopHoldBack(["abcd", "bc"])
    assert hold.feed("xabc") == "xa" and hold.done                           # "abcd" never came
    hold = StopHoldBack(["ab"])
    assert hold.feed("a") == "" and hold.feed("a") == "a" and hold.flush() == "a"
