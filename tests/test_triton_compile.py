"""Every Triton kernel compiles for NVIDIA GPUs (sm_80 and sm_90) ahead of time, on this machine.

The interpreter (tests/triton/) checks what the kernels compute, but it runs them as Python and
never lowers them: a kernel can pass there and still fail to compile (a type that changes
across a loop, an op the compiler lacks for a dtype). Triton's wheel carries ptxas, so
triton.compile with an explicit GPUTarget builds each kernel to a cubin with no GPU present.
This runs in the main test process: the kernels are decorated for the compiler here (TRITON_INTERPRET
unset), and the check is skipped under the interpreter. By default the four FlashAttention kernels
compile once (fp16, causal, sm_90; about 12 s the first time, then from Triton's cache); `-m slow`
adds sm_80, bf16 and fp32, the non-causal variants and every other kernel.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="kernels are decorated for the interpreter in this process"),
    # Triton 3.9 warns that its default for FP fusion will change; the compiled code is not ours to pin
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset:UserWarning"),
]
triton = pytest.importorskip("triton")


def _compile(jit_fn, signature: dict, constexprs: dict, cap: int, num_warps: int = 4, num_stages: int = 2):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _unwrap(jit_fn)
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    assert kernel.asm["cubin"], f"{_name((jit_fn,))}: no cubin"
    return kernel


def desc(dtype: str, rows: int, bd: int) -> str:
    return f"tensordesc<{dtype}[1,1,{rows},{bd}]>"


def flash_cases(dtype: str, causal: bool):
    from logitlab.kernels import triton_flash_bwd as bwd
    from logitlab.kernels import triton_flash_fwd as fwd

    bm, bn, bd = 128, 64, 64
    common = {"CAUSAL": causal, "UPCAST": False, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    ints = {"H": "i32", "G": "i32", "T": "i32", "S": "i32"}
    yield fwd.flash_fwd_kernel, {
        "q_desc": desc(dtype, bm, bd), "k_desc": desc(dtype, bn, bd), "v_desc": desc(dtype, bn, bd),
        "o_desc": desc(dtype, bm, bd), "lse_ptr": "*fp32", "qk_scale": "fp32", **ints, "T_KEY": "i32",
        "S_KEY": "i32"}, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, **common}
    bm, bn = 64, 64
    yield bwd._delta_kernel, {"o_desc": desc(dtype, bm, bd), "do_desc": desc(dtype, bm, bd), "delta_ptr": "*fp32",
                              "T": "i32", "H": "i32"}, {"BLOCK_M": bm, "BLOCK_D": bd}
    grads = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "sm_scale": "fp32", "qk_scale": "fp32", **ints,
             "T_KEY": "i32", "S_KEY": "i32"}
    yield bwd._dkdv_kernel, {
        "q_desc": desc(dtype, bm, bd), "k_desc": desc(dtype, bn, bd), "v_desc": desc(dtype, bn, bd),
        "do_desc": desc(dtype, bm, bd), "dk_desc": desc(dtype, bn, bd), "dv_desc": desc(dtype, bn, bd), **grads,
    }, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, **common}
    yield bwd._dq_kernel, {
        "q_desc": desc(dtype, bm, bd), "k_desc": desc(dtype, bn, bd), "v_desc": desc(dtype, bn, bd),
        "do_desc": desc(dtype, bm, bd), "dq_desc": desc(dtype, bm, bd), **grads,
    }, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, **common}


def other_cases(dtype: str):
    from logitlab.kernels import triton_attention_steps as steps
    from logitlab.kernels import triton_basics as basics
    from logitlab.kernels import triton_cross_entropy as ce
    from logitlab.kernels import triton_grouped_gemm as gg
    from logitlab.kernels import triton_norm as norm
    from logitlab.kernels import triton_swiglu as swiglu

    p = f"*{dtype}"
    yield basics._add_kernel, {"x_ptr": p, "y_ptr": p, "out_ptr": p, "n": "i32"}, {"BLOCK": 1024}
    yield basics._softmax_kernel, {"x_ptr": p, "out_ptr": p, "n_cols": "i32", "x_stride": "i32",
                                   "out_stride": "i32"}, {"BLOCK": 1024}
    yield basics._rms_norm_fwd_kernel, {
        "x_ptr": p, "w_ptr": "*fp32", "y_ptr": p, "rstd_ptr": "*fp32", "n_cols": "i32", "x_stride": "i32",
        "y_stride": "i32", "eps": "fp32"}, {"BLOCK": 1024}
    yield norm._rms_norm_bwd_kernel, {
        "dy_ptr": p, "x_ptr": p, "w_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": p, "dw_ptr": "*fp32", "N": "i32",
        "D": "i32", "rows_per_program": "i32"}, {"BLOCK": 1024}
    yield swiglu._swiglu_fwd_kernel, {"gu_ptr": p, "out_ptr": p, "F": "i32", "gu_stride": "i32",
                                      "out_stride": "i32"}, {"BLOCK": 1024}
    yield swiglu._swiglu_bwd_kernel, {"dy_ptr": p, "gu_ptr": p, "dgu_ptr": p, "F": "i32", "dy_stride": "i32",
                                      "gu_stride": "i32"}, {"BLOCK": 1024}
    yield ce._ce_rows_kernel, {"logits_ptr": p, "stride": "i32", "targets_ptr": "*i64", "loss_ptr": "*fp32",
                               "V": "i32", "ignore_index": "i32", "grad_scale": "fp32"}, {"BLOCK_V": 4096}
    blocks = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}
    strides = {k: "i32" for k in ("N", "K", "sx0", "sx1", "sw0", "sw1", "sw2")}
    yield gg._grouped_mm_kernel, {"x_ptr": p, "w_ptr": p, "out_ptr": p, "tile_expert": "*i32", "tile_start": "*i32",
                                  "tile_end": "*i32", **strides, "so0": "i32", "so1": "i32"}, blocks
    yield gg._grouped_wgrad_kernel, {"dy_ptr": p, "x_ptr": p, "dw_ptr": p, "group_start": "*i32",
                                     "group_end": "*i32", "N": "i32", "K": "i32", "sd0": "i32", "sd1": "i32",
                                     **{k: "i32" for k in ("sx0", "sx1", "sw0", "sw1", "sw2")}}, blocks
    mm = {k: "i32" for k in ("M", "N", "K", "sa_b", "sa_m", "sa_k", "sb_b", "sb_k", "sb_n", "sc_b", "sc_m", "sc_n")}
    prec = {"UPCAST": False, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    yield steps._bmm_kernel, {"a_ptr": p, "b_ptr": p, "c_ptr": "*fp32", **mm, "scale": "fp32", "CAUSAL_FROM": "i32"}, {
        "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, **prec}
    st = {k: "i32" for k in ("T", "S", "Dh", "sq_bh", "sq_t", "sk_bh", "sk_s", "so_bh", "so_t")}
    yield steps._tiled_kernel, {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, **st, "qk_scale": "fp32"}, {
        "CAUSAL": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 64, **prec}


def _unwrap(kernel):
    """The JITFunction inside an autotuner (or the JITFunction itself)."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def _name(case):
    return _unwrap(case[0]).fn.__name__


def test_flash_kernels_compile_for_sm90_fp16_causal():
    for case in flash_cases("fp16", True):
        _compile(*case, cap=90, num_warps=8 if _name(case) == "flash_fwd_kernel" else 4)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [80, 90])
@pytest.mark.parametrize("dtype,causal", [("bf16", False), ("fp32", True), ("fp16", False)])
def test_flash_kernels_compile_sweep(cap, dtype, causal):
    for case in flash_cases(dtype, causal):
        _compile(*case, cap=cap)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [80, 90])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_other_kernels_compile(cap, dtype):
    for case in other_cases(dtype):
        _compile(*case, cap=cap)
