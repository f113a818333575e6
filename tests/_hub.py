"""A Hugging Face hub cache built on disk, in huggingface_hub's own layout, so that a hub id
resolves offline through the real resolution code (HF_HUB_OFFLINE=1, set by conftest.py):

    CACHE/models--ORG--NAME/blobs/SHA256            the files' bytes
    CACHE/models--ORG--NAME/snapshots/COMMIT/FILE   a relative symlink to its blob
    CACHE/models--ORG--NAME/refs/REVISION           the commit a branch or tag names
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, source: Path, revisions=("main",), commit: str | None = None) -> Path:
    """Put every file of directory `source` into `cache` as the snapshot of `repo_id` at
    `commit` (default: a hash of the files), named by each of `revisions` -> the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(source).iterdir() if p.is_file())
    sha256 = {p: _digest(p, hashlib.sha256()) for p in files}    # read in pieces: weights may be gigabytes
    if commit is None:
        digest = hashlib.sha1()
        for p in files:
            digest.update(p.name.encode() + bytes.fromhex(sha256[p]))
        commit = digest.hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob = repo / "blobs" / sha256[p]
        shutil.copyfile(p, blob)
        link = snapshot / p.name
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for rev in revisions:
        (repo / "refs" / rev).write_text(commit)
    return snapshot


def _digest(path: Path, h) -> str:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def use_cache(monkeypatch, cache: Path) -> None:
    """Point this process's huggingface_hub (already imported or not) and its subprocesses at `cache`."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover
        return
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def add_random_gpt2(cache: Path, vocab_json: Path, merges_txt: Path, work: Path) -> Path:
    """Put a GPT-2-shaped model into `cache` as the hub id "gpt2": GPT-2 small's shapes (12 layers,
    D 768, 12 heads, its 1024 learned positions) with seeded random weights, and GPT-2's own
    vocabulary files, so that `load_pretrained("gpt2")` and `load_tokenizer("gpt2")` resolve offline.
    The source folder goes under `work` (keep it away from where code runs: a directory named gpt2
    there would be loaded instead of the hub id)."""
    import torch

    from logitlab.io import hf
    from logitlab.model import Transformer, get_preset

    torch.manual_seed(0)
    source = work / "gpt2"
    hf.save_pretrained(Transformer(get_preset("gpt2")), source)
    shutil.copyfile(vocab_json, source / "vocab.json")
    shutil.copyfile(merges_txt, source / "merges.txt")
    return add_snapshot(cache, "gpt2", source)
