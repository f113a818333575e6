"""int8 weights times int8 activations: the compiled products of the "int8dot" route.

int8dot.py owns the calls into _int8dot.c (built at install when a C compiler with OpenMP is
present; setup.py: an optional extension) and the checks on the tensors handed to it. The math is
reference.int8dot_linear: each row of x is quantized per block of 32 columns (Q8_0's rule, the
scale in float32) as it arrives, the block sums of int8 x int8 products are exact in int32, then
scaled by the activation block's d and the weight row's s:

    y_mn = s_n * sum_b d_mb * sum_{k in b} qx_mk * q_nk          x (M, K) -> y (M, N)

Weight-only int8 (the reference and the packed route) multiplies by x itself; quantizing x moves
each product by at most sum_b d_mb / 2 * sum_{k in b} |q_nk s_n| (tests/test_quant_int8dot.py
asserts it). In exchange the products run on integer dot-product instructions that read the
int8 weights at memory speed: AVX2's maddubs / madd with the sign trick (see _int8dot.c), chosen
at run time by CPUID, and plain C loops elsewhere. Whether that is faster than torch's kernels on
a machine is measured there (routes.install "auto"), never assumed.

    linear(x, qweight, scales)        # x (M, K) float32 or bf16, qweight (N, K) int8, scales (N,) float32
    linear_int4(x, packed, scales, zeros)   # the same for Int4Linear's tensors (int4 weights)
    bind(qweight, scales)(x)          # the same, the weight checked once (what the route runs eagerly)
    linear_op(x, qweight, scales)     # the same as a torch operator (what a compiled graph calls)
    quantize(x) -> (q, d)             # the activations as the kernel quantizes them
    block_dots(q, w) -> (M, N, K/32)  # the int32 block sums, for the exact test (block_dots_int4 too)
    isas()                            # ("scalar", "avx2") on this machine
"""

from __future__ import annotations

import torch

try:  # built from _int8dot.c at install when a C compiler is present (setup.py: optional extension)
    from logitlab.quant import _int8dot as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

BLOCK = 32
ISAS = {"best": 0, "scalar": 1, "avx2": 2}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def available() -> bool:
    """Whether the compiled products (logitlab.quant._int8dot) were built by this install."""
    return _native is not None


def _need() -> None:
    if _native is None:
        raise ValueError("the int8dot products need the compiled extension logitlab.quant._int8dot, which this "
                         "install did not build (reinstall with a C compiler that has OpenMP: pip install -e .)")


def isas() -> tuple[str, ...]:
    """The instruction sets the compiled products can use on this CPU, plainest first."""
    _need()
    return tuple(_native.isas())


def _isa(isa: str) -> int:
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {tuple(ISAS)}, got {isa!r}")
    return ISAS[isa]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x checked: a CPU tensor (M, K) of float32 or bf16 with K a multiple of 32, made contiguous."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"int8dot takes a CPU tensor (M, K) of float32 or bfloat16 with K a multiple of {BLOCK}, "
                         f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    return x.contiguous()


def _weight(w: torch.Tensor, K: int) -> None:
    if w.device.type != "cpu" or w.dtype != torch.int8 or w.dim() != 2 or w.shape[1] != K or not w.is_contiguous():
        raise ValueError(f"int8dot takes a contiguous CPU int8 weight (N, {K}), got {tuple(w.shape)} {w.dtype} "
                         f"on {w.device}")


def _product(N: int, K: int, call, tensors: tuple, isa: str, threads: int | None):
    """x (M, K) -> y (M, N) through `call(x_ptr, y_ptr, M, dtype code, threads, isa code)`."""
    code = _isa(isa)

    def product(x: torch.Tensor) -> torch.Tensor:
        x = _rows(x)
        if x.shape[1] != K:
            raise ValueError(f"int8dot: x has {x.shape[1]} columns, the weight {K}")
        y = torch.empty(x.shape[0], N, dtype=x.dtype)
        call(x.data_ptr(), y.data_ptr(), x.shape[0], DTYPES[x.dtype], threads or torch.get_num_threads(), code)
        return y
    product.tensors = tensors                    # kept alive as long as the function is
    return product


def _vector(t: torch.Tensor, what: str, shape: tuple, dtype: torch.dtype) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"int8dot takes {what} as a contiguous CPU {dtype} {shape}, got {tuple(t.shape)} {t.dtype}")


def bind(qweight: torch.Tensor, scales: torch.Tensor, isa: str = "best", threads: int | None = None):
    """The product by one int8 weight, its tensors checked once: a function x (M, K) float32 or
    bf16 -> y (M, N) in x's dtype, computed as the module docstring says. qweight (N, K) int8,
    scales (N,) float32; threads: OpenMP threads (default: torch's count at each call)."""
    _need()
    N, K = qweight.shape if qweight.dim() == 2 else (0, 0)
    _weight(qweight, K)
    _vector(scales, "the weight's scales", (N,), torch.float32)
    w, s = qweight.data_ptr(), scales.data_ptr()
    return _product(N, K, lambda x, y, M, dtype, threads_, code: _native.linear(x, w, s, y, M, K, N, dtype, threads_,
                                                                                 code),
                    (qweight, scales), isa, threads)


def bind_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, isa: str = "best",
              threads: int | None = None):
    """The same for an int4 weight (Int4Linear's tensors): packed (N, K/2) uint8, two columns a
    byte (reference.pack_int4); scales (N, K/G) bf16 and zeros (N, K/G) uint8, G a multiple of 32:
    y_mn = sum_g s_ng * sum_{k in g} (q_nk - z_ng) * x_mk with x quantized per block of 32."""
    _need()
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous() or scales.dim() != 2:
        raise ValueError(f"int8dot takes an int4 weight as contiguous uint8 (N, K/2) and its scales (N, K/G), "
                         f"got {tuple(packed.shape)} {packed.dtype} and {tuple(scales.shape)}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    groups = scales.shape[1]
    if groups == 0 or K % groups or (K // groups) % BLOCK:
        raise ValueError(f"int8dot: {groups} groups do not split {K} columns into multiples of {BLOCK}")
    _vector(scales, "the int4 scales", (N, groups), torch.bfloat16)
    _vector(zeros, "the int4 zero points", (N, groups), torch.uint8)
    w, s, z, G = packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), K // groups
    return _product(N, K, lambda x, y, M, dtype, threads_, code: _native.linear4(x, w, s, z, y, M, K, N, G, dtype,
                                                                                  threads_, code),
                    (packed, scales, zeros), isa, threads)


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, isa: str = "best",
           threads: int | None = None) -> torch.Tensor:
    """x (M, K) float32 or bf16 -> y (M, N) in x's dtype: bind(qweight, scales, isa, threads)(x)."""
    return bind(qweight, scales, isa, threads)(x)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                isa: str = "best", threads: int | None = None) -> torch.Tensor:
    """x (M, K) -> y (M, N) by an int4 weight: bind_int4(packed, scales, zeros, isa, threads)(x)."""
    return bind_int4(packed, scales, zeros, isa, threads)(x)


@torch.library.custom_op("logitlab::int8dot_linear", mutates_args=())
def linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """linear(x, qweight, scales) as an operator of its own, so that torch.compile keeps it as one
    opaque call in its graph (a compiled decode step is one graph; the C call would break it)."""
    return linear(x, qweight, scales)


@linear_op.register_fake
def _(x, qweight, scales):
    return x.new_empty((x.shape[0], qweight.shape[0]))


@torch.library.custom_op("logitlab::int8dot_linear_int4", mutates_args=())
def linear_int4_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """linear_int4 as an operator of its own (see linear_op)."""
    return linear_int4(x, packed, scales, zeros)


@linear_int4_op.register_fake
def _(x, packed, scales, zeros):
    return x.new_empty((x.shape[0], packed.shape[0]))


def quantize(x: torch.Tensor, isa: str = "best") -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) int8, d (M, K/32) float32), quantized by the compiled code with the
    instruction set `isa` (equal to reference.quantize_activations, byte for byte)."""
    _need()
    x = _rows(x)
    M, K = x.shape
    q, d = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // BLOCK, dtype=torch.float32)
    _native.quantize(x.data_ptr(), q.data_ptr(), d.data_ptr(), M, K, DTYPES[x.dtype], _isa(isa))
    return q, d


def block_dots(q: torch.Tensor, w: torch.Tensor, isa: str = "best") -> torch.Tensor:
    """q (M, K) int8, w (N, K) int8 -> (M, N, K/32) int32: the sum over each block of 32 columns of
    q_mk * w_nk, by the instruction set `isa` uses in linear (values in -127..127)."""
    _need()
    if q.dim() != 2:
        raise ValueError(f"block_dots takes q (M, K), got {tuple(q.shape)}")
    M, K = q.shape
    _weight(q.contiguous(), K)
    _weight(w, K)
    out = torch.empty(M, w.shape[0], K // BLOCK, dtype=torch.int32)
    _native.block_dots(q.contiguous().data_ptr(), w.data_ptr(), out.data_ptr(), M, K, w.shape[0], _isa(isa))
    return out


def block_dots_int4(q: torch.Tensor, packed: torch.Tensor, group_size: int, isa: str = "best") -> torch.Tensor:
    """q (M, K) int8, packed (N, K/2) uint8 -> (M, N, K/32) int32: the sum over each block of 32
    columns of q_mk * u_nk, u (0..15) unpacked from `packed`, by the instruction set `isa` as
    linear_int4 runs it for groups of `group_size` (AVX2 reads blocks in pairs above 32)."""
    _need()
    if q.dim() != 2 or packed.dim() != 2 or packed.dtype != torch.uint8 or 2 * packed.shape[1] != q.shape[1]:
        raise ValueError(f"block_dots_int4 takes q (M, K) and packed (N, K/2) uint8, got {tuple(q.shape)} and "
                         f"{tuple(packed.shape)} {packed.dtype}")
    M, K = q.shape
    _weight(q.contiguous(), K)
    packed = packed.contiguous()
    out = torch.empty(M, packed.shape[0], K // BLOCK, dtype=torch.int32)
    _native.block_dots4(q.contiguous().data_ptr(), packed.data_ptr(), out.data_ptr(), M, K, packed.shape[0],
                        group_size, _isa(isa))
    return out
