"""How the C allocator behind CPU tensors returns freed memory: keep_freed_memory.

Unlike the other fast paths this one cannot be installed into a model and removed again: it is
a setting of the whole process (glibc's malloc), applied by an explicit call and never undone.
Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameter numbers (malloc.h)
_KEEP_BYTES = 2**31 - 1                          # the largest value mallopt takes (an int)
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory in the process for the next allocation, instead of
    handing it back to the kernel. -> True when the settings were applied.

    PROCESS-WIDE AND PERMANENT: this changes the allocator of the whole process, for every
    thread and every later allocation, and cannot be undone (glibc can set the thresholds but
    not report them, so there is nothing to restore). Call it only where the process is yours,
    as the trainer does for a run (TrainConfig.keep_freed_memory).

    CPU tensors come from malloc. glibc serves a block above its mmap threshold (128 KiB, rising
    to at most 32 MiB as such blocks are freed) with a fresh mapping that is unmapped again when
    the block is freed, and returns the top of its heap to the kernel once more than the trim
    threshold lies free there. A training step frees its activations and gradients and allocates
    them again in the next step, so every step page-faults them all in anew; with both
    thresholds raised to 2 GiB (through mallopt), which this does, freed blocks are reused. The
    cost is memory held rather than returned: freed blocks stay with the process, and torch's
    64-byte-aligned allocations can leave a few freed blocks of a size unused until the
    allocator's small-chunk cache fills; under bf16 autocast, whose casts of every size fragment
    the kept heap, the peak grows most, which is why `train` applies it by default only to
    compiled float32 steps (docs/benchmarks.md has the measurements).

    Nothing happens (False) where the C library is not glibc, or when MALLOC_MMAP_THRESHOLD_ or
    MALLOC_TRIM_THRESHOLD_ is set in the environment (the user's own choice stands). CUDA
    tensors come from torch's caching allocator and are not affected."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _MALLOC_ENV):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
