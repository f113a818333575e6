"""What every Triton kernel here shares: the interpreter switch, the device check, block sizes.

Triton decides when each `@triton.jit` function is decorated (when its module is imported)
whether it is compiled for a GPU or run by Triton's interpreter on CPU tensors: the interpreter
is chosen by TRITON_INTERPRET=1 in the environment at that moment. INTERPRET records the choice
as this module saw it, so a kernel module imported in the same process made the same one.

The interpreter runs each program of a grid in turn with numpy, so it is a correctness check,
never a speed measurement. numpy has no bfloat16: the interpreter's bf16 arithmetic and bf16
tl.dot give wrong values, so kernels widen every loaded value to float32 before arithmetic,
and widen the operands of tl.dot under the interpreter (UPCAST below); on a GPU tl.dot
multiplies in the input dtype, accumulating in float32. The interpreter also converts float32
to bfloat16 by truncation, not round-to-nearest, so its bf16 results may sit one bf16 unit away
from a GPU's; the bf16 tests use bf16 tolerances.
"""

from __future__ import annotations

import torch

try:
    import triton
    from triton import knobs
except ImportError as exc:  # pragma: no cover - triton is in the test extras
    raise ImportError("logitlab's Triton kernels need triton: pip install triton") from exc

INTERPRET: bool = bool(knobs.runtime.interpret)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, x: torch.Tensor, ndim: int | None = None) -> None:
    """Raise ValueError unless `x` can go to a Triton kernel here: on a CUDA device, or on the CPU
    when the kernels run in the interpreter; a floating dtype of DTYPES; `ndim` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cuda" and not (INTERPRET and x.device.type == "cpu"):
        raise ValueError(f"{name} is on {x.device}: the Triton kernels run on a CUDA device, or on the "
                         "CPU through Triton's interpreter (TRITON_INTERPRET=1 set before the kernels are imported)")
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; the Triton kernels take {', '.join(map(str, DTYPES))}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")


def block_size(n: int, lo: int = 16) -> int:
    """The power of two >= max(n, lo): a Triton block must have a power-of-two length, and
    tl.dot needs at least 16 along each side."""
    return max(lo, triton.next_power_of_2(n))


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether kernels widen tl.dot operands to float32: under the interpreter for 16-bit inputs
    (see the module docstring); never on a GPU."""
    return INTERPRET and dtype != torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: "ieee" for float32 inputs (the exact float32 product the eager
    reference computes, not TF32's 10-bit mantissa), "tf32" (ignored) for 16-bit ones."""
    return "ieee" if dtype == torch.float32 else "tf32"
