"""Temporary directories that name their writer, so that what a killed writer left is found,
resumed or removed, and nothing else is ever touched.

`files.atomic_directory` writes an output into `.NAME.tmp-XXXXXXXX` beside it and renames it
into place; a process killed with SIGKILL leaves that directory behind, and nothing can tell it
from another writer's work in progress. `tracked_directory` is the same context, except that its
temporary directory holds WRITER_FILE ({"kind", "pid", "host", "since"}), which the writer keeps
locked with flock(2) for as long as it runs. The kernel drops the lock when the writer dies, so
the next writer of the same target can prove that a leftover is stale: its name has the pattern,
its WRITER_FILE says logitlab wrote it on this host, and nobody holds the lock. Such a leftover
is resumed, when `resume(tmp)` accepts it (a token part's progress record matches the job), or
removed; a directory without that file, another host's, or a live writer's is left alone.
Where flock does not exist (not POSIX) nothing is tracked and nothing is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

from logitlab.io import files

WRITER_FILE = ".logitlab-writer.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _write_info(fd: int, kind: str) -> None:
    data = json.dumps({"kind": kind, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, (data + "\n").encode(), 0)


def _claim_new(tmp: Path, kind: str) -> int | None:
    """Create and lock tmp/WRITER_FILE; -> its descriptor (None where flock does not exist)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    fd = os.open(tmp / WRITER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
    _write_info(fd, kind)  # written once locked: a reader that sees it complete sees a held lock
    return fd


def try_claim(tmp: Path) -> tuple[int, dict] | None:
    """Take over `tmp` when a logitlab writer on this host left it and is gone: -> (the locked
    WRITER_FILE's descriptor, what it says), else None (not ours, another host's, alive)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return None
    path = tmp / WRITER_FILE
    if tmp.is_symlink() or not tmp.is_dir():
        return None
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    except OSError:
        return None
    try:
        info = json.loads(os.pread(fd, 1 << 16, 0))
        if not isinstance(info, dict) or not isinstance(info.get("kind"), str):
            raise ValueError("not a logitlab writer's file")
        if info.get("host") != socket.gethostname():
            raise ValueError("written on another host: its writer may be alive there")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError while the writer lives
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            raise ValueError("the writer finished and moved its directory meanwhile")
        return fd, info
    except (OSError, ValueError):
        os.close(fd)
        return None


def leftovers(target: Path) -> list[Path]:
    """The `.NAME.tmp-*` directories beside `target` (NAME its name), ours or not: candidates."""
    prefix = f".{target.name}.tmp-"
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    return sorted(target.parent / n for n in names if n.startswith(prefix))


def _adopt_or_remove(target: Path, kind: str, resume: Callable[[Path], bool] | None) -> tuple[Path, int] | None:
    """Remove every stale leftover of `target`'s writers; the first of `kind` that `resume`
    accepts is kept instead, claimed: -> (it, its locked descriptor), or None."""
    adopted = None
    for tmp in leftovers(target):
        claim = try_claim(tmp)
        if claim is None:
            continue
        fd, info = claim
        if adopted is None and resume is not None and info["kind"] == kind and resume(tmp):
            _write_info(fd, kind)
            adopted = (tmp, fd)
            continue
        shutil.rmtree(tmp, ignore_errors=True)  # still locked by us while it goes
        os.close(fd)
    return adopted


@contextlib.contextmanager
def tracked_directory(target: str | os.PathLike, kind: str, *, overwrite: bool = False,
                      legacy: set[str] | None = None, resume: Callable[[Path], bool] | None = None,
                      keep: Callable[[Path], bool] | None = None) -> Iterator[tuple[Path, bool]]:
    """files.atomic_directory whose temporary directory names its writer (module docstring);
    yields (the temporary directory, whether it is a dead writer's, resumed). Stale leftovers of
    the target are removed first. On an exception the directory is removed, unless `keep(tmp)`
    says it holds work to resume; then it stays, with its writer file, for the next writer."""
    target = Path(target)
    ours = files.check_output_dir(target, kind, overwrite=overwrite, legacy=legacy)
    adopted = _adopt_or_remove(target, kind, resume)
    if adopted is not None:
        tmp, fd = adopted
    else:
        tmp = files.make_temporary_dir(target)
        fd = _claim_new(tmp, kind)
    claimed = fd is not None
    try:
        yield tmp, adopted is not None
        if claimed:
            os.unlink(tmp / WRITER_FILE)  # still locked: from here on it is no leftover of anyone
            claimed = False
        files.finish_directory(tmp, target, kind, ours)
    except BaseException:
        if not (claimed and keep is not None and keep(tmp)):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)
