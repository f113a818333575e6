"""How the C allocator behind CPU tensors returns freed memory: keep_freed_memory, and
FaultWatch, which applies it where a measurement of the training steps shows it pays.

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


class FaultWatch:
    """keep_freed_memory decided by measurement: TrainConfig.keep_freed_memory "auto".

    What keeping freed memory saves is the kernel's time spent page-faulting a step's freshly
    mapped activations in, which the process sees as system CPU time. This watches the process's
    system share of CPU time, stime / (utime + stime) (getrusage, every thread of the process),
    over training steps skip+1 .. skip+measure (the first `skip` steps compile and allocate the
    optimizer state), and applies keep_freed_memory when that share is at least `threshold`:

        watch = FaultWatch()
        ...after each step: decision = watch.after_step()   # None until decided, then once a dict

    -> {"keep_freed_memory": applied?, "system_time_share": the share measured}. On a machine
    where mapping memory is cheap the share stays small and nothing changes. apply: what applies
    the setting (default keep_freed_memory; -> whether it was applied)."""

    def __init__(self, skip: int = 1, measure: int = 2, threshold: float = 0.05,
                 apply=None):
        if skip < 0 or measure < 1 or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"FaultWatch needs skip >= 0, measure >= 1 and 0 <= threshold <= 1, got "
                             f"skip={skip}, measure={measure}, threshold={threshold}")
        self.skip, self.measure, self.threshold, self._apply = skip, measure, threshold, apply
        self._steps, self.decision = 0, None
        self._start = self._times() if skip == 0 else None

    @staticmethod
    def _times() -> tuple[float, float]:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime, usage.ru_stime

    def after_step(self) -> dict | None:
        """Call once after every training step; -> the decision at the step that makes it, else None."""
        if self.decision is not None:
            return None
        self._steps += 1
        if self._steps == self.skip:
            self._start = self._times()
        elif self._steps == self.skip + self.measure:
            start = self._start or (0.0, 0.0)
            user, system = (now - before for now, before in zip(self._times(), start))
            share = system / (user + system) if user + system > 0 else 0.0
            applied = bool(share >= self.threshold and (self._apply or keep_freed_memory)())
            self.decision = {"keep_freed_memory": applied, "system_time_share": round(share, 4)}
            return self.decision
        return None
