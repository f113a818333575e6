"""Private, copy-on-write mappings of a file's bytes, including one tensor stitched from parts that
lie apart in the file.

mapping.py owns the calls to mmap(2), munmap(2) and madvise(2), made through ctypes: Python's mmap
module keeps a file descriptor per mapping (until 3.13) and cannot map at a chosen address.
map_parts lays the parts of a fused tensor (q_proj, k_proj, v_proj; gate_proj, up_proj) one after
another in one range of memory. A page can be a page of the file only where the file's bytes fall
on it in the same place within a page as the tensor's, so each part is mapped over the pages it
alone covers when its offset in the file and its place in the tensor agree modulo the page size
(true of every part when all tensors between them fill whole pages, as large matrices do); a page
that two parts share and that no one file page can serve (where a part ends and the next begins),
and any part whose offset disagrees, is ordinary memory read with pread(2). Parts stored back to
back in the tensor's order (gate_proj then up_proj, in a file whose names are sorted) are one
mapping with nothing read. It imports nothing of logitlab.
"""

from __future__ import annotations

import functools
import mmap
import os

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10                  # the same value on Linux and macOS; Python's mmap module lacks it


@functools.cache
def libc():
    """The C library's mmap(2), munmap(2) and madvise(2) with their argument types, or None where
    there is none to call (not POSIX, or not 64-bit: off_t is then not the 64-bit integer declared
    here)."""
    import ctypes

    if os.name != "posix" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int64]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


def plan(spans: list[tuple[int, int]], start: int) -> tuple[list, list]:
    """How to lay out parts (`spans`: (first, end) byte of each in the file, in the tensor's order)
    in a range of memory whose tensor begins `start` bytes into its first page (start < PAGE):
    (runs, holes). runs: (first page, pages, file offset) to map, consecutive pages of one stretch of
    the file; holes: (first byte, end byte, file offset) of the range to read instead. A page is
    mapped when every part on it wants the same file page there."""
    parts, at = [], start                          # (first, end byte in the range, file offset - range offset)
    for first, end in spans:
        parts.append((at, at + end - first, first - at))
        at += end - first

    def wanted(page: int):                          # the file offset of this page, or None
        lo, hi = page * PAGE, (page + 1) * PAGE
        shifts = {shift for a, b, shift in parts if a < hi and b > lo}
        shift = shifts.pop() if len(shifts) == 1 else None
        return shift if shift is not None and shift % PAGE == 0 else None

    pieces = []                                     # (first page, end page, shift or None)
    for a, b, shift in parts:
        inner = (-(-a // PAGE), b // PAGE)          # the pages this part alone covers
        if inner[0] < inner[1]:
            pieces.append((*inner, shift if shift % PAGE == 0 else None))
    edges = {a // PAGE for a, _, _ in parts if a % PAGE} | {b // PAGE for _, b, _ in parts if b % PAGE}
    pieces += [(page, page + 1, wanted(page)) for page in edges]
    runs, holes = [], []
    for first, end, shift in sorted(pieces):
        if shift is None:
            lo, hi = first * PAGE, end * PAGE
            holes += [(max(lo, a), min(hi, b), max(lo, a) + s) for a, b, s in parts if a < hi and b > lo]
        elif runs and runs[-1][0] + runs[-1][1] == first and runs[-1][2] == first * PAGE + shift - runs[-1][1] * PAGE:
            runs[-1] = (runs[-1][0], runs[-1][1] + end - first, runs[-1][2])
        else:
            runs.append((first, end - first, first * PAGE + shift))
    return runs, holes


def map_parts(fd: int, spans: list[tuple[int, int]]):
    """The bytes of `spans` ((first, end) in the open file `fd`, in order) one after another in one
    private, readable and writable range of memory: (buffer, offset of the first byte in it,
    release), or None where it cannot be made (no mmap(2), a call that fails). buffer is a ctypes
    array a tensor can be made over (torch.frombuffer keeps it alive); the whole range is unmapped
    when it is freed. release() lets the mapped pages go from this process (madvise MADV_DONTNEED:
    they stay in the page cache and refill from the file on the next touch); only while nothing has
    been written to them, since a page written since would lose that write. Pages read into
    (plan's holes) are never let go: they hold the only copy of their bytes."""
    import ctypes
    import weakref

    lib = libc()
    if lib is None:
        return None
    start = spans[0][0] % PAGE
    length = -(-(start + sum(end - first for first, end in spans)) // PAGE) * PAGE
    failed = ctypes.c_void_p(-1).value
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    address = lib.mmap(None, length, rw, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)   # reserved, untouched
    if address is None or address == failed:
        return None
    buffer = (ctypes.c_char * length).from_address(address)
    # at exit the process's memory goes anyway: unmapping then could pull pages from under a tensor
    # that some other exit handler still reads
    weakref.finalize(buffer, lib.munmap, address, length).atexit = False
    runs, holes = plan(spans, start)
    for page, pages, offset in runs:
        if lib.mmap(address + page * PAGE, pages * PAGE, rw, mmap.MAP_PRIVATE | MAP_FIXED, fd, offset) != \
                address + page * PAGE:
            return None                           # buffer goes, and the whole range with it
    view = memoryview(buffer).cast("B")
    for first, end, offset in holes:
        done = 0
        while first + done < end:
            got = os.preadv(fd, [view[first + done:end]], offset + done)
            if got <= 0:
                return None
            done += got

    def release() -> None:
        for page, pages, _ in runs:
            lib.madvise(address + page * PAGE, pages * PAGE, mmap.MADV_DONTNEED)

    return buffer, start, release


def let_go(address: int, nbytes: int) -> None:
    """Let the pages that lie wholly inside [address, address + nbytes) go from this process
    (madvise MADV_DONTNEED), for a range of a mapping that nothing will read again or that refills
    from the file: a page of the file comes back on the next touch; a page that was read into (a
    hole) or written comes back zero, so only for bytes already used and done with."""
    lib = libc()
    first, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    if lib is not None and end > first:
        lib.madvise(first, end - first, mmap.MADV_DONTNEED)
