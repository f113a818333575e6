"""The machine's measured matrix-product rate: what the planner times a step at, and the
denominator of MFU. Measured, never looked up from CPU flags or GPU names."""

from __future__ import annotations

import functools

DTYPE_NAMES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "int8")


def measure_matmul_flops(dtype="fp32", n: int = 1024, seconds: float = 0.5, device="cpu") -> float:
    """FLOP/s of an n x n x n matmul (2·n³ FLOPs each) on `device` in `dtype` (a name of
    DTYPE_BYTES or a torch.dtype): the fastest of repeated timings for about `seconds` (at least
    one) after two warm-up calls. Uncached; see matmul_peak_flops."""
    import time

    import torch

    if not isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_NAMES)}")
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16}.get(dtype, torch.float32)
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)  # private: the global generators are not touched
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    for _ in range(2):  # warm-up
        a @ b
    sync()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@functools.lru_cache(maxsize=None)
def _measured_peak(device: str, dtype: str, size: int) -> float:
    import torch

    return measure_matmul_flops(getattr(torch, dtype), size, 0.1, device)


def matmul_peak_flops(device, dtype=None, size: int | None = None) -> float:
    """Measured dense matmul throughput in FLOP/s (the best of a few square matmuls), cached per
    (device, dtype, size) for the process: MFU = achieved model FLOP/s / this."""
    import torch

    device = torch.device(device)
    dtype = dtype or torch.float32
    size = size or (4096 if device.type == "cuda" else 1024)
    return _measured_peak(str(device), str(dtype).removeprefix("torch."), size)
