"""Checkpoint directories on disk: atomic writes, logitlab's own checkpoint layout.

checkpoint.py owns how a directory appears on disk all at once or not at all: everything is
written into a temporary sibling directory, flushed, then renamed into place, so a kill at any
instant leaves either the previous checkpoint or the new one, never half of one. Hugging Face
directory import/export lives in hf.py (same atomic rule, via `atomic_directory`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success rename it to `target`.

    On any exception the temporary directory is removed and `target` is untouched. When
    `target` exists and `overwrite` is true, it is moved aside first and deleted only after
    the new directory is in place."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb+") as f:
                    os.fsync(f.fileno())
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a single file atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
