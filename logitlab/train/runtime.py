"""Where and how computation runs, chosen by explicit calls and never at import.

runtime.py owns the device choice, whether bf16 autocast is worth using there, seeding every
random generator, capturing and restoring their states (for exact resume), a measured
matmul peak used as the denominator of model FLOPs utilisation (MFU). How the C allocator
behind CPU tensors returns freed memory is kernels.allocator.keep_freed_memory (process-wide),
re-exported here for existing callers.
"""

from __future__ import annotations

import contextlib
import random
import time
from functools import lru_cache

import numpy as np
import torch

from logitlab.kernels import cpu_bf16
from logitlab.kernels.allocator import keep_freed_memory  # noqa: F401  (re-exported)


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def freed_memory_policy(config, device: torch.device, amp_dtype) -> str:
    """-> "keep" (now), "watch" (allocator.FaultWatch decides after the first steps) or "leave".
    auto watches compiled float32 steps only: a compiled fp32 step reuses a few planned buffers, so
    keeping freed memory costs it little peak; under bf16 autocast the casts of every size
    fragment the kept heap (docs/benchmarks.md)."""
    if device.type != "cpu" or config.keep_freed_memory == "off":
        return "leave"
    if config.keep_freed_memory == "on":
        return "keep"
    return "watch" if config.compile and amp_dtype is None else "leave"


def install_bf16_route(model, config, device: torch.device, amp_dtype) -> cpu_bf16.Installed | None:
    """The CPU bf16 matmul and attention routes for this run (only where there are bf16 products
    on a CPU), attention measured at the run's sequence length."""
    bf16 = amp_dtype == torch.bfloat16 or any(p.dtype == torch.bfloat16 for p in model.parameters())
    if device.type != "cpu" or not bf16:
        return None
    seq_len = config.seq_len or getattr(getattr(model, "config", None), "context_length", None)
    return cpu_bf16.install(model, config.bf16_matmul, seq_len=seq_len)
