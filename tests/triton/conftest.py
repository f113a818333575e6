"""The Triton kernel cases run only where their kernels can: under Triton's interpreter
(TRITON_INTERPRET=1 in the environment before pytest starts) or on a CUDA machine.

Elsewhere this folder is not collected (and a case file named on the command line has its
cases skipped), so no kernel runs in a process that did not choose its mode;
tests/test_triton_kernels.py runs this folder in a child process with TRITON_INTERPRET=1
instead (see its docstring for why)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

RUN_HERE = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
HERE = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path, config):
    if not RUN_HERE and collection_path.name.startswith("test_"):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """A case file named on the command line is collected even so: skip its cases, saying why."""
    if RUN_HERE:
        return
    skip = pytest.mark.skip(reason="the Triton cases need TRITON_INTERPRET=1 set before pytest starts, or a "
                                   "CUDA device; tests/test_triton_kernels.py runs them in the interpreter")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    """Where the cases put their tensors: the CPU under the interpreter, else the GPU."""
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
