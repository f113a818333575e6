"""Shared fixtures: the reference data folder, seeds, and a quiet single-threaded torch."""

from __future__ import annotations

import os
from pathlib import Path

# Tests never download: a hub id resolves from a cache the test builds (tests/_hub.py), and
# huggingface_hub reads this when it is first imported (subprocesses inherit it).
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data/ beside the project; tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"reference data folder {SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture(scope="session")
def gpt2_files(shared_data: Path) -> tuple[Path, Path]:
    vocab, merges = shared_data / "gpt2" / "vocab.json", shared_data / "gpt2" / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        pytest.skip(f"GPT-2 vocabulary files absent under {shared_data / 'gpt2'}")
    return vocab, merges


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch seed; tests needing others set their own."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    torch.manual_seed(0)
    yield
