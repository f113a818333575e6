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
