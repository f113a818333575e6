"""mapping.map_parts: parts of a file laid out one after another in one range of memory, the pages
each part alone covers mapped from the file where they line up, the rest read. Whatever the
arrangement, the bytes are the file's, before and after the mapped pages are let go."""

from __future__ import annotations

import os
import random
import sys

import pytest

from logitlab.io import mapping
from logitlab.io.mapping import PAGE

pytestmark = pytest.mark.skipif(mapping.libc() is None, reason="no mmap(2) to call through ctypes here")


def test_parts_back_to_back_are_one_mapping_with_nothing_read():
    runs, holes = mapping.plan([(1000, 1000 + 3 * PAGE), (1000 + 3 * PAGE, 1000 + 5 * PAGE)], 1000)
    assert runs == [(0, 6, 0)] and holes == []


def test_parts_apart_map_the_pages_each_covers_alone_and_read_where_they_meet():
    k = (1000, 1000 + 2 * PAGE)                    # k_proj, o_proj, q_proj, v_proj as a sorted file holds them
    o = (k[1], k[1] + 4 * PAGE)
    q = (o[1], o[1] + 4 * PAGE)
    v = (q[1], q[1] + 2 * PAGE)
    runs, holes = mapping.plan([q, k, v], 1000)
    assert [pages for _, pages, _ in runs] == [4, 1, 2]               # q's 4 pages (with the first),
    assert sum(end - first for first, end, _ in holes) == 2 * PAGE    # two pages where q|k and k|v meet
    runs, holes = mapping.plan([(0, 4 * PAGE), (8 * PAGE, 10 * PAGE)], 0)
    assert runs == [(0, 4, 0), (4, 2, 8 * PAGE)] and holes == []      # page-aligned parts: all mapped


def test_a_part_whose_offset_does_not_line_up_is_read():
    runs, holes = mapping.plan([(0, 2 * PAGE), (2 * PAGE + 256, 3 * PAGE + 256)], 0)
    assert runs == [(0, 2, 0)] and holes == [(2 * PAGE, 3 * PAGE, 2 * PAGE + 256)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mmap(2) flags")
def test_any_arrangement_reads_back_the_file_bytes_and_never_writes_the_file(tmp_path):
    rng = random.Random(0)
    data = rng.randbytes(40 * PAGE)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for trial in range(120):
            spans = []
            for _ in range(rng.randint(1, 4)):
                size = rng.choice([rng.randint(1, 5 * PAGE), PAGE * rng.randint(1, 4)])
                first = rng.choice([rng.randint(0, 30 * PAGE), PAGE * rng.randint(0, 30) + rng.choice([0, 8, 1000])])
                first = min(first, len(data) - size)
                spans.append((first, first + size))
            buffer, start, release = mapping.map_parts(fd, spans)
            expected = b"".join(data[a:b] for a, b in spans)
            assert buffer.raw[start:start + len(expected)] == expected, spans
            if trial % 2:
                release()                                 # mapped pages refill from the file, read ones stay
                assert buffer.raw[start:start + len(expected)] == expected, spans
            else:
                view = memoryview(buffer).cast("B")
                view[start:start + len(expected)] = bytes(len(expected))       # written: copies, not the file
                assert buffer.raw[start:start + len(expected)] == bytes(len(expected))
            del buffer
        assert path.read_bytes() == data
    finally:
        os.close(fd)
