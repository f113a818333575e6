"""File primitives every writer shares: directories that appear all at once, outputs that know
they are ours, JSON read with the file named, a lock per run directory, and disk-full errors
that say where.

files.py owns the rule that nothing we did not write is ever deleted or overwritten:

- `atomic_directory(target, kind)` writes into a temporary sibling and renames it into place.
  A target that exists must be a directory that is empty, or an output of the same `kind` that
  logitlab wrote (its `.logitlab-output.json` lists the entries it wrote). Anything else is
  refused, naming what is there. Replacing one of our outputs needs `overwrite=True`; the
  entries we did not write (a README a user added) are kept, hard-linked into the new directory
  before the swap, so a kill at any instant leaves them in place.
- `atomic_write_text` / `atomic_write_bytes`: a file replaced by rename, never half written.
- `read_json(path)`: the parsed JSON, or ValueError naming the file, line and column.
- `RunLock(directory)`: one writer per run directory (an flock on RUN/.lock that the kernel
  releases when the holder dies, so a stale lock file never blocks; the file names the holder).
- `writing(path)`: turns "no space left" of any writer (OSError ENOSPC, or the RuntimeError
  torch.save's zip writer raises) into DiskFullError naming the file and the device.

It imports nothing of logitlab, so every other module can use it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator

OUTPUT_MARKER = ".logitlab-output.json"


class DiskFullError(OSError):
    """No space left on a device while writing a file; the message names both."""


class LockedError(RuntimeError):
    """Another process holds the run directory's lock."""


# --------------------------------------------------------------------------------------------
# Small writes and reads
# --------------------------------------------------------------------------------------------

def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where unsupported."""
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


# The mode of every file logitlab writes: mkstemp and safetensors' writer create files 0600,
# which would leave weights unreadable beside world-readable configs.
FILE_MODE = 0o644


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, flush it, and rename it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with writing(path), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)  # mkstemp makes 0600; our files are world-readable like any other
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_json(path: str | os.PathLike, what: str = "JSON file"):
    """json.loads of the file; FileNotFoundError or ValueError naming the file (and for bad JSON
    its line and column)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"no such {what}: {path}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 {what} ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                         f"the file may be truncated") from None


# --------------------------------------------------------------------------------------------
# Disk full
# --------------------------------------------------------------------------------------------

def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the file system holding `path` (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    dev = p.stat().st_dev
    while p != p.parent and p.parent.stat().st_dev == dev:
        p = p.parent
    return p


def is_disk_full(exc: BaseException, directory: str | os.PathLike) -> bool:
    """Whether `exc`, raised while writing into `directory`, means the device is full: ENOSPC
    (or EDQUOT), or another writer's error (torch.save's zip writer reports 'unexpected pos')
    while the device has less than 1 MiB free."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, DiskFullError):
        return True
    try:
        return shutil.disk_usage(mount_point(directory)).free < 2**20
    except OSError:  # pragma: no cover
        return False


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Around the write of one file: a full device becomes DiskFullError naming the file and
    the device; every other error passes through unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if not is_disk_full(exc, Path(path).parent):
            raise
        raise DiskFullError(errno.ENOSPC, f"no space left on {mount_point(path)} while writing {path}") from exc


# --------------------------------------------------------------------------------------------
# Outputs that know they are ours
# --------------------------------------------------------------------------------------------

def owned_entries(directory: str | os.PathLike, kind: str) -> set[str] | None:
    """The names of `directory` that logitlab wrote as an output of `kind`, from its marker file,
    or None when the directory is not such an output (no marker, another kind, a bad marker)."""
    marker = Path(directory) / OUTPUT_MARKER
    if not marker.is_file():
        return None
    try:
        payload = json.loads(marker.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    if not isinstance(payload, dict) or payload.get("kind") != kind or not isinstance(payload.get("files"), list):
        return None
    return {str(name) for name in payload["files"]} | {OUTPUT_MARKER}


def _describe(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_output_dir(target: str | os.PathLike, kind: str, *, overwrite: bool = False,
                     source: str | os.PathLike | None = None, legacy: set[str] | None = None) -> set[str]:
    """Refuse `target` unless writing a `kind` output there loses nothing; returns the entries
    of ours it holds (replaced by the write), empty for a new or empty directory.

    `source` is the directory the output is made from: the target may lie inside it (a Hugging
    Face export inside a run), never be it or contain it. `legacy` names the entries that count
    as ours in a directory from before the marker existed (the caller recognised it)."""
    target = Path(target)
    if source is not None:
        src, dst = Path(source).resolve(), target.resolve()
        if dst == src or dst in src.parents:
            raise ValueError(f"{target} is the source {source} or contains it: write the output elsewhere")
    if not target.exists():
        if target.is_symlink():
            raise ValueError(f"{target} is a dangling symbolic link; remove it or choose another directory")
        return set()
    if not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory; choose a new directory")
    present = set(os.listdir(target))
    if not present:
        return set()
    ours = owned_entries(target, kind)
    if ours is None:
        ours = legacy
    if ours is None:
        raise ValueError(f"{target} is not empty and was not written by logitlab as a {kind} directory "
                         f"(it holds {_describe(present)}); nothing there is replaced: choose a new or empty "
                         f"directory")
    if not overwrite:
        raise ValueError(f"{target} already holds a {kind} directory written by logitlab; pass --overwrite "
                         f"(overwrite=True) to replace its files (other files there are kept)")
    return ours & present


def _link_tree(src: Path, dst: Path) -> None:
    """Recreate `src` at `dst` with hard links to the same files (no data copied)."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        os.mkdir(dst)
        shutil.copystat(src, dst)
        for name in os.listdir(src):
            _link_tree(src / name, dst / name)
    else:
        os.link(src, dst)


def _fsync_tree(directory: Path) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())


def _set_file_modes(directory: Path) -> None:
    """Give every regular file under `directory` (all written by us) FILE_MODE."""
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


def _write_marker(directory: Path, kind: str, names) -> None:
    payload = {"kind": kind, "files": sorted(set(names) - {OUTPUT_MARKER}), "written": time.time()}
    (directory / OUTPUT_MARKER).write_text(json.dumps(payload, indent=2) + "\n")


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, kind: str = "model", *, overwrite: bool = False,
                     source: str | os.PathLike | None = None, legacy: set[str] | None = None,
                     marker: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside `target`; on success it becomes `target` at once.

    The target is checked first (check_output_dir: a new or empty directory, or with
    `overwrite` one of our `kind` outputs). On any exception the temporary directory is removed
    and `target` is untouched. Replacing an output of ours keeps every entry we did not write:
    each is hard-linked into the new directory before the swap. The marker file lists what we
    wrote (`marker=False` leaves it out, for directories whose name already says they are ours,
    as run checkpoints)."""
    target = Path(target)
    ours = check_output_dir(target, kind, overwrite=overwrite, source=source, legacy=legacy)
    tmp = make_temporary_dir(target)
    try:
        yield tmp
        finish_directory(tmp, target, kind, ours, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def finish_directory(tmp: Path, target: Path, kind: str, ours: set[str], marker: bool = True) -> None:
    """atomic_directory's last step: mark `tmp`, link the entries of `target` that are not `ours`
    into it, and swap it into place."""
    written = set(os.listdir(tmp))
    if marker:
        _write_marker(tmp, kind, written)
    _set_file_modes(tmp)  # before other files are linked in: their modes are their owners'
    if target.exists():
        foreign = set(os.listdir(target)) - ours
        clash = foreign & (written | {OUTPUT_MARKER})
        if clash:
            raise ValueError(f"{target}: {_describe(clash)} would replace a file logitlab did not write")
        for name in foreign:  # kept: linked into the new directory, so no instant loses them
            _link_tree(target / name, tmp / name)
    _fsync_tree(tmp)
    _swap_into_place(tmp, target)


def make_temporary_dir(target: Path) -> Path:
    """A new empty directory `.NAME.tmp-XXXX` beside `target` (its parents made), or
    PermissionError naming the directory that cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except PermissionError:
        raise PermissionError(errno.EACCES, f"cannot write into {target.parent}: permission denied") from None
    except NotADirectoryError:
        raise NotADirectoryError(errno.ENOTDIR, f"cannot create {target}: a parent is not a directory") from None
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; an output directory is as readable as any other
    return tmp


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`; an existing target is moved aside first and deleted only once
    the new one is in place (put back if the second rename fails)."""
    old = None
    if target.exists():
        # named after the unique temporary directory: concurrent writers never collide
        old = target.parent / tmp.name.replace(".tmp-", ".old-", 1)
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# One writer per run directory
# --------------------------------------------------------------------------------------------

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on a run directory for as long as the context is open.

    The lock is an flock(2) on RUN/.lock: the kernel drops it when the holder exits or is
    killed, so a lock file left by a dead process is stale by construction and is taken over.
    The file records the holder's pid, host and start time for the error message, and is removed
    on release (while still locked; a locker that finds its file unlinked or replaced under it
    tries again, so two holders can never both succeed). Where flock is unavailable (not POSIX)
    the lock is a no-op."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> "RunLock":
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return self
        self._created = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise LockedError(f"{self.directory} is in use by another training process "
                                  f"({self.holder()}); wait for it to finish or use another run directory") from None
            if self._same_file(fd):
                break
            os.close(fd)  # the holder released and removed it between our open and flock: again
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(info) + "\n").encode())
        self._fd = fd
        return self

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def holder(self) -> str:
        """'pid P on host H, since ...' from the lock file, or 'holder unknown'."""
        try:
            info = json.loads(self.path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
            return f"pid {info['pid']} on host {info['host']}, since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)   # still locked: nobody can hold this inode meanwhile
            os.close(self._fd)         # closing the descriptor releases the flock
            self._fd = None
            if self._created:          # a run that wrote nothing leaves no empty directory behind
                with contextlib.suppress(OSError):
                    os.rmdir(self.directory)
