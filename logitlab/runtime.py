"""Where and how computation runs, chosen by explicit calls and never at import.

runtime.py owns the device choice, whether bf16 autocast is worth using there, seeding every
random generator, capturing and restoring their states (for exact resume), a measured
matmul peak used as the denominator of model FLOPs utilisation (MFU), and how the C allocator
behind CPU tensors returns freed memory (keep_freed_memory).

It imports nothing from logitlab.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import random
import time
from functools import lru_cache

import numpy as np
import torch


def pick_device(preference: str = "auto") -> torch.device:
    """"auto" -> cuda when available, else mps, else cpu; anything else is taken as given."""
    if preference != "auto":
        device = torch.device(preference)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {preference!r} requested but CUDA is not available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@lru_cache(maxsize=None)
def _cpu_has_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX); without it bf16 autocast
    on CPU is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return _cpu_has_bf16()
    return False


def autocast_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype for `precision`: "fp32" -> None; "bf16" -> bfloat16 (error if the
    device cannot); "auto" -> bfloat16 on a CUDA device that supports it, else None (fp32).
    CPU stays fp32 under "auto": small CPU models are not faster in bf16 and fp32 keeps runs
    bit-reproducible."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"precision 'bf16' is not supported on device {device}")
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"precision 'bf16' requested but {torch.cuda.get_device_name(device)} lacks bf16")
        return torch.bfloat16
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and bf16_supported(device) else None
    raise ValueError(f"precision must be 'auto', 'fp32' or 'bf16', got {precision!r}")


def autocast(device: torch.device, dtype: torch.dtype | None):
    """A context manager running the forward pass under autocast(dtype), or nothing for None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    """Seed Python's random, NumPy's global generator and torch (every device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def capture_rng_state() -> dict:
    """States of every generator, as tensors and plain Python values (torch.save-able and
    loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state; a state of another shape is a ValueError saying so."""
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"not a generator state written by logitlab ({type(exc).__name__}: {exc})") from None
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameter numbers (malloc.h)
_KEEP_BYTES = 2**31 - 1                          # the largest value mallopt takes (an int)
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep freed memory in the process for the next allocation, instead of
    handing it back to the kernel. -> True when the settings were applied.

    CPU tensors come from malloc. glibc serves a block above its mmap threshold (128 KiB, rising
    to at most 32 MiB as such blocks are freed) with a fresh mapping that is unmapped again when
    the block is freed, and returns the top of its heap to the kernel once more than the trim
    threshold lies free there. A training step frees its activations and gradients and allocates
    them again in the next step, so every step page-faults them all in anew: 73 thousand faults
    and 120 ms of system time in a 1.4 s small-Llama float32 step here (one thread), 200 thousand
    and 0.3 s in a GPT-2 small step, none once both thresholds are raised to 2 GiB, which this
    does (through mallopt). The kernel's cost per fault grows when other processes run between
    the steps: GPT-2 small's compiled float32 step alternating with another process's took 0.84 s
    (12%) less with this. The cost is memory held rather than returned: freed blocks stay with the
    process, and torch's 64-byte-aligned allocations can leave a few freed blocks of a size unused
    until the allocator's small-chunk cache fills (a loop allocating one 64 MiB tensor grew by
    eight such blocks before it reused them). GPT-2 small's compiled float32 training step peaked
    0-11% higher with it, the eager step 12% (fp32) and 29% (bf16 autocast, whose casts of every
    size fragment the heap), the compiled bf16 step 27%, which is why `train` applies it by
    default only to compiled float32 steps.

    Process-wide and not undone (glibc can set the thresholds but not report them). Nothing
    happens (False) where the C library is not glibc, or when MALLOC_MMAP_THRESHOLD_ or
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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int, seconds: float = 0.1) -> float:
    """FLOP/s of a size x size x size matmul (2·size³ FLOPs each): the fastest of repeated timings
    for about `seconds` (at least one) after two warm-up calls. Uncached; see matmul_peak_flops."""
    g = torch.Generator().manual_seed(0)  # private: the global generators are not touched
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    for _ in range(2):  # warm-up
        a @ b
    synchronize(device)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@lru_cache(maxsize=None)
def _measured_peak(device_str: str, dtype_str: str, size: int) -> float:
    return measure_matmul_flops(torch.device(device_str), getattr(torch, dtype_str), size)


def matmul_peak_flops(device: torch.device, dtype: torch.dtype | None = None, size: int | None = None) -> float:
    """Measured dense matmul throughput in FLOP/s (best of a few square matmuls), cached per
    (device, dtype, size). MFU = achieved model FLOP/s / this."""
    dtype = dtype or torch.float32
    size = size or (4096 if device.type == "cuda" else 1024)
    return _measured_peak(str(device), str(dtype).removeprefix("torch."), size)


def fastest_thread_count(step, candidates=None, repeats: int = 3) -> tuple[int, float]:
    """Run `step()` under each torch thread count in `candidates` (default: torch's current count
    and 1), keep the fastest and return (threads, seconds per step: min of `repeats` after one
    warm-up). On a CPU shared with other jobs, two spinning threads can be several times slower
    than one. The chosen count stays set."""
    candidates = sorted(set(candidates or (torch.get_num_threads(), 1)), reverse=True)
    timings = {}
    for n in candidates:
        torch.set_num_threads(n)
        step()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        timings[n] = min(times)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best, timings[best]
