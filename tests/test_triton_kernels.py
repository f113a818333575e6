"""The Triton kernels' parity cases (tests/triton/) run through Triton's interpreter in a child
process, plus the checks that need no kernel launch.

Why a child process: Triton reads TRITON_INTERPRET when each @triton.jit function is decorated,
that is when logitlab.kernels.triton_* is first imported, and never again. Setting the variable
inside this pytest process would leak into every test file that runs after (and any that
imports the kernels first would fix the other mode, so the result would hang on import order).
So the cases live in tests/triton/, whose conftest collects them only in a process that chose
its mode before starting (TRITON_INTERPRET=1, or a CUDA machine, where they run compiled), and
the test below starts `python -m pytest tests/triton` with TRITON_INTERPRET=1 in the child's
environment only, passing on this run's -m selection (so `-m slow` runs the larger sweeps too).
The child's report is shown when it fails; `TRITON_INTERPRET=1 pytest tests/triton` runs the
cases directly, one by one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "triton"
IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@pytest.mark.slow
def test_triton_cases_pass_in_the_interpreter(request):
    if IN_PROCESS:
        pytest.skip("tests/triton is collected in this process (interpreter or CUDA)")
    pytest.importorskip("triton")
    marker = request.config.getoption("markexpr") or "not slow"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-m", marker, str(CASES)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    report = f"{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"tests/triton failed under the interpreter:\n{report}"
    assert " passed" in proc.stdout, proc.stdout[-2000:]


def test_install_refuses_a_cpu_model_without_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter accepts CPU models")
    pytest.importorskip("triton")
    from logitlab.kernels import triton_install
    from logitlab.model.config import ModelConfig
    from logitlab.model.transformer import Transformer

    model = Transformer(ModelConfig(vocab_size=32, context_length=16, d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="CUDA device.*TRITON_INTERPRET=1"):
        triton_install.install(model)
    assert type(model.blocks[0].attn).__name__ == "Attention"          # nothing was switched


def test_kernels_refuse_cpu_tensors_without_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs CPU tensors")
    pytest.importorskip("triton")
    from logitlab.kernels.triton_attention import flash_attention

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="q is on cpu"):
        flash_attention(q, q, q)


def test_attention_io_counts_by_hand():
    from logitlab.kernels.triton_io import attention_hbm_bytes

    got = attention_hbm_bytes(B=1, H=1, T=256, S=256, Dh=64, elem_bytes=2, block_m=128)
    assert got["naive"] == 2 * (2 * 256 * 64 + 2 * 256 * 64 + 4 * 256 * 256)
    assert got["tiled"] == 2 * (2 * 256 * 64 + 2 * 2 * 256 * 64)              # two query blocks read K, V
    assert got["tiled_causal"] == 2 * (2 * 256 * 64 + 2 * (128 + 256) * 64)   # keys up to each diagonal
    bigger = attention_hbm_bytes(B=2, H=3, T=256, S=256, Dh=64, elem_bytes=2, block_m=128)
    assert bigger["naive"] == 6 * got["naive"]
    decode = attention_hbm_bytes(B=1, H=1, T=1, S=100, Dh=64, block_m=128)
    assert decode["tiled_causal"] == decode["tiled"]                          # one query sees every key
    with pytest.raises(ValueError, match="block_m must be a positive int"):
        attention_hbm_bytes(1, 1, 4, 4, 16, block_m=0)


def test_cross_entropy_memory_counts():
    from logitlab.kernels.triton_io import cross_entropy_bytes, default_chunk_rows

    assert default_chunk_rows(8192, 248_320, 1024) == 64                      # ceil(8192 / 243) = 34 -> 64
    assert default_chunk_rows(3, 10, 64) == 3 and default_chunk_rows(14, 1500, 24) == 1
    m = cross_entropy_bytes(N=8192, V=248_320, D=1024, elem_bytes=2)
    assert m["full"] == 3 * 8192 * 248_320 * 4
    assert m["chunked"] == 64 * 248_320 * 2 + 248_320 * 1024 * 4 and m["chunked"] * 20 < m["full"]


def test_bench_exits_with_a_clear_message_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    proc = subprocess.run([sys.executable, "-m", "bench.triton_attention", "--quick", "--no-doc"], cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr
