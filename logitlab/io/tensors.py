"""Reading tensors from safetensors files: once each, lean, and with errors that name the file.

tensors.py owns the lowest layer of loading: a safetensors file opened so that its errors name it
(open_safetensors), its header read without touching the data (read_header), NaN / inf refused by
file and key (require_finite), and a tensor read and cast on the way in (read_tensor). By default
tensors are read with pread(2) into fresh CPU tensors: the model owns its memory and no longer
depends on the file. A tensor cast to another dtype is read a slice of rows at a time into one
scratch buffer the open file reuses and copied (so cast) into its final tensor: no copy of the
whole tensor in the stored dtype ever exists, and nothing is allocated per slice to fragment the
heap between the model's tensors. A tensor in its stored dtype is read straight into its final
memory (read_into), which may be the rows of a larger tensor (a fused projection's q, k and v).

read_tensor(mapped=True) instead returns a tensor kept in its stored dtype as a private,
copy-on-write mapping of the file's own bytes (SafetensorsFile.map_tensor): no fresh memory is
zeroed and filled, the pages are the page cache's, shared with every other reader of the file,
and a write to the tensor (a training step) copies the page it touches into this process, so the
file never changes. The mapping lives as long as the tensor and goes with it. The price: the file
must stay as it is while the tensor lives (load_pretrained's `mmap` explains what happens
otherwise). The parts of a fused projection are laid out as one tensor the same way
(SafetensorsFile.map_run; the pages are mapping.py's). It imports only io.mapping of logitlab;
which files make a model directory is model_dir.py's and weights.py's.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

from logitlab.io import mapping

# A cast tensor is read in slices of rows of at most this many bytes (in the stored dtype): the
# size of the scratch buffer, the most a load holds beyond the model itself for a cast.
SLICE_BYTES = 16 * 2**20
# read_tensor(mapped=True) maps a tensor of at least this many bytes; smaller ones (norms, biases)
# are read, so that a model holds a few mappings per layer rather than one per vector.
MAP_MIN_BYTES = 2**20

# safetensors' dtype names -> torch's (torch is imported lazily: importing io is cheap)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}


def open_safetensors(path) -> "SafetensorsFile":
    """A safetensors file open for reading tensors one at a time on the CPU: with pread(2) into
    fresh tensors where safetensors has that backend (no pages of the file stay mapped while
    others are read), memory-mapped otherwise (unmapped when closed). A file that is empty,
    truncated, has bytes past its data or a bad header is a ValueError naming it."""
    return SafetensorsFile(path)


class SafetensorsFile:
    """safetensors.safe_open (a context manager with keys(), get_slice(key).get_shape(),
    get_tensor(key), metadata()) whose errors name the file: ValueError "PATH: not a valid
    safetensors file (reason)" instead of a SafetensorError; plus `rows`, a slice of rows read
    into a scratch buffer that this open file reuses."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self._raw = self._scratch = self._offsets = None
        try:
            try:
                self._file = safe_open(str(path), framework="pt", device="cpu", backend="pread")
            except TypeError:  # a safetensors release without the pread backend: memory-mapped
                self._file = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as exc:
            raise _invalid_safetensors(self.path, exc) from exc

    def __enter__(self) -> "SafetensorsFile":
        self._file.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._raw is not None:
            self._raw.close()
        self._raw = self._scratch = None
        self._file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._read(self._file.keys)

    def metadata(self) -> dict | None:
        return self._read(self._file.metadata)

    def get_slice(self, key: str):
        return self._read(self._file.get_slice, key)

    def get_tensor(self, key: str):
        return self._read(self._file.get_tensor, key)

    def read_rows(self, key: str, start: int, end: int, shape: tuple, dtype, out=None):
        """Rows [start, end) of tensor `key` (of `shape` and stored `dtype`), read with pread(2)
        into `out` (a contiguous CPU tensor of those rows' bytes), or into a scratch buffer this file
        reuses (a view valid until the next call) when out is None: no allocation once the buffer
        has grown to the largest slice. (The header was validated when the file was opened.)"""
        import torch

        row = dtype.itemsize * torch.Size(shape[1:]).numel()
        nbytes = (end - start) * row
        if out is None:
            if self._scratch is None or self._scratch.numel() < nbytes:
                self._scratch = None                              # the old buffer goes before the new one
                self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            out = self._scratch[:nbytes].view(dtype).view(end - start, *shape[1:])
        buffer, done, at = memoryview(out.view(torch.uint8).reshape(-1).numpy()), 0, self._offset(key) + start * row
        while done < nbytes:                                      # one call reads at most ~2 GiB
            got = os.preadv(self._raw.fileno(), [buffer[done:nbytes]], at + done)
            if got <= 0:
                raise ValueError(f"{self.path}: tensor {key} ends before its data does; the file may be truncated")
            done += got
        return out

    def map_tensor(self, key: str, shape: tuple, dtype, check=None):
        """Tensor `key` (of `shape` and stored `dtype`) as a view of a private, copy-on-write
        mapping of its bytes in the file (mmap(2) MAP_PRIVATE): writes to it stay in this process.
        The mapping is unmapped when the last tensor over it is freed. None where it cannot be
        mapped: no mmap(2), a big-endian machine, or data not aligned to its element size.
        check(tensor, release), when given, reads it (a NaN check, which may raise, now or queued);
        release(), which it may call once it is done, lets the pages go from this process (madvise
        MADV_DONTNEED: they stay in the page cache, and nothing was written that could be lost), so
        that, as for a tensor never read, a page counts in the resident memory from its first use on
        (read_tensor's let_go: a token table's rows no token looks up never do)."""
        return self.map_run([(key, 0, shape[0] if shape else 1)], shape, dtype, check)

    def map_run(self, pieces: list[tuple[str, int, int]], shape: tuple, dtype, check=None):
        """Rows of tensors, `pieces` ((key, first row, end row) each, stored in `dtype`, rows of
        shape[1:]), as one tensor of `shape` (the pieces one after another) laid out in one private
        range of memory (mapping.map_parts): the pages each piece alone covers are pages of the file
        where its place in the file and in the tensor agree within a page, the rest is read. So a
        fused projection's parts take no fresh memory: none at all when the file holds them back to
        back (gate_proj then up_proj, in a file whose names are sorted), a page or two per part where
        they lie apart (q_proj, k_proj, v_proj, with o_proj between). None where their bytes are not
        shape's, a piece is not aligned to its element size, or nothing could be mapped (no mmap(2),
        a big-endian machine, a call that fails)."""
        import torch

        row = dtype.itemsize * torch.Size(shape[1:]).numel()
        spans = [(self._span(key)[0] + first * row, self._span(key)[0] + end * row) for key, first, end in pieces]
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        if (sum(end - first for first, end in spans) != nbytes or nbytes == 0 or sys.byteorder != "little"
                or any(first % dtype.itemsize for first, _ in spans)
                or any(end > self._span(key)[1] for (key, _, _), (_, end) in zip(pieces, spans))):
            return None
        size = os.fstat(self._raw.fileno()).st_size
        for (key, _, _), (_, end) in zip(pieces, spans):       # a page past the end would be SIGBUS
            if size < end:
                raise ValueError(f"{self.path}: tensor {key} ends before its data does; the file may be truncated")
        mapped = mapping.map_parts(self._raw.fileno(), spans)
        if mapped is None:
            return None
        buffer, start, release = mapped
        tensor = torch.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize, offset=start).view(shape)
        if check is not None:
            check(tensor, release)
        return tensor

    def _offset(self, key: str) -> int:
        """Where tensor `key`'s data starts in the file."""
        return self._span(key)[0]

    def _span(self, key: str) -> tuple[int, int]:
        """(first byte, end byte) of tensor `key`'s data in the file (the header is read once, on
        first use; it was validated when the file was opened)."""
        if self._offsets is None:
            self._raw = open(self.path, "rb")
            size = int.from_bytes(self._raw.read(8), "little")
            header = json.loads(self._raw.read(size))
            self._offsets = {k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
                             for k, v in header.items() if k != "__metadata__"}
        return self._offsets[key]

    def _read(self, fn, *args):
        from safetensors import SafetensorError

        try:
            return fn(*args)
        except SafetensorError as exc:
            raise _invalid_safetensors(self.path, exc) from exc


def _invalid_safetensors(path: Path, exc: Exception) -> ValueError:
    reason = str(exc).removeprefix("Error while deserializing header: ")
    return ValueError(f"{path}: not a valid safetensors file ({reason}); it may be truncated or corrupt: "
                      "write or download it again")


def read_header(path) -> dict:
    """name -> (shape, stored torch dtype) of every tensor of a safetensors file, from its header
    alone (nothing is read). An unknown dtype reads as uint8 (reading that tensor then fails)."""
    import torch

    with open_safetensors(path) as f:
        pieces = {key: f.get_slice(key) for key in f.keys()}
        return {key: (tuple(p.get_shape()), getattr(torch, _DTYPES.get(p.get_dtype(), "uint8")))
                for key, p in pieces.items()}


def require_finite(path: str | os.PathLike, key: str, tensor) -> None:
    """ValueError naming the file and the key when the floating tensor `key` read from `path`
    holds NaN or inf: a model loaded with one computes NaN logits. One pass per tensor and no
    temporary as large as it: min and max propagate NaN, so both are finite exactly when every
    element is (isfinite(t).all() would allocate a mask per tensor, raising the peak of a load)."""
    import torch

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    values = tensor if tensor.dtype.itemsize > 1 else tensor.to(torch.float16)  # fp8 has no aminmax
    lo, hi = torch.aminmax(values)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise ValueError(f"{path}: tensor {key} holds {int((~torch.isfinite(values)).sum())} NaN / inf values")


class FiniteChecks:
    """The NaN / inf checks of a load (require_finite), run on a few threads while the loader goes
    on reading and mapping: checking reads every byte of the weights (about 10 GB/s on one core,
    the largest cost of a mapped load), and the loader's own work is mostly waiting on the kernel
    (pread, page faults), so the two overlap. A loader's thread pool, as file loaders have one,
    separate from torch's compute threads: at most `workers` (default: the CPUs this process may
    use, up to 4), none on a one-CPU machine (each check then runs at once).

    queue(job, held) queues one check (a function of no arguments, which raises ValueError on a
    bad tensor); wait() raises the error of the first failing job in the order they were queued.
    A queued job holds its tensor: `held` is the bytes that would otherwise have been freed by now
    (0 for a mapping, whose pages are the file's), and the queue keeps them under QUEUE_BYTES (a
    job waits for older ones first), so a load's peak grows by at most that much. As a context
    manager it waits on a clean exit and drops the queue on an error."""

    QUEUE_BYTES = 256 * 2**20

    def __init__(self, workers: int | None = None):
        from concurrent.futures import ThreadPoolExecutor

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(4, cpus) if workers is None else workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="finite") if workers > 1 else None
        self._queue: collections.deque = collections.deque()    # (future, bytes held) in the order queued
        self._held = 0

    def queue(self, job, held: int = 0) -> None:
        if self._pool is None:
            job()
            return
        while self._queue and self._held + held > self.QUEUE_BYTES:
            self._next()
        self._queue.append((self._pool.submit(job), held))
        self._held += held

    def wait(self) -> None:
        while self._queue:
            self._next()

    def _next(self) -> None:
        """Wait for the oldest job (raising its error) and let go of what it held."""
        future, held = self._queue.popleft()
        self._held -= held
        future.result()

    def __enter__(self) -> "FiniteChecks":
        return self

    def __exit__(self, kind, *exc) -> None:
        try:
            if kind is None:
                self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            self._queue.clear()


def check_finite(finite, path, name: str, tensor, release=None, mapped: bool = False) -> None:
    """The NaN / inf check (require_finite) a reader asked for: `finite` False (none), True (now),
    or a FiniteChecks (queued there). mapped: `tensor` is a mapping of the file the model keeps
    (queuing it holds nothing more); release, when given, lets its pages go once it is checked (at
    once when no check is asked for)."""
    def job():
        try:
            require_finite(path, name, tensor)
        finally:
            if release is not None:
                release()

    if isinstance(finite, FiniteChecks):
        finite.queue(job, 0 if mapped else tensor.numel() * tensor.element_size())
    elif finite:
        job()
    elif release is not None:
        release()


def cast_read(path, name: str, tensor, finite, dtype):
    """A tensor just read from `path`: checked for NaN / inf when `finite` (True or a FiniteChecks),
    then cast to `dtype` when it is floating (dtype None: as stored)."""
    if finite:
        require_finite(path, name, tensor)      # now: the uncast tensor is dropped after the cast
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def read_tensor(f: SafetensorsFile, path, name: str, shape: tuple, stored, finite=False, dtype=None,
                mapped: bool = False, let_go: bool = False):
    """Tensor `name` of the open file `f` (of `shape` and `stored` dtype), as `dtype` (None: as
    stored; integer tensors stay as stored): read_into a tensor allocated for it, or with
    `mapped`, where it holds at least MAP_MIN_BYTES, from a private mapping of the file
    (f.map_tensor; read as usual where it cannot be mapped): in its stored dtype the mapping itself,
    cast to another the mapping's values cast a slice at a time (cast_mapped: no pread copy, and
    no more of the stored dtype resident than a slice). let_go: the mapped pages
    the check read are let go after it (a token table, of which a forward pass reads only the rows
    of its tokens); every other tensor is read whole by the first forward pass, so its pages stay."""
    import torch

    target = dtype if stored.is_floating_point and dtype is not None else stored
    if mapped and stored.itemsize * torch.Size(shape).numel() >= MAP_MIN_BYTES:
        def check(t, release):                    # the check queued; the pages are the model's
            check_finite(finite, path, name, t, release if let_go else None, mapped=True)

        kept = target == stored
        tensor = f.map_tensor(name, shape, stored, check if finite and kept else None)
        if tensor is not None:
            return tensor if kept else cast_mapped(path, name, tensor, torch.empty(shape, dtype=target), finite)
    return read_into(f, path, name, shape, stored, torch.empty(shape, dtype=target), finite)


def cast_mapped(path, name: str, mapped, out, finite=False):
    """`out` (of another dtype) filled from `mapped` (a mapping of tensor `name`'s bytes in the
    file, nothing written to it) a slice of rows at a time (cast_slices): each slice checked, cast,
    and its pages let go (mapping.let_go), so that no more than a slice of the stored dtype is ever
    resident, as when reading through a scratch buffer, without the copy into it. -> out."""
    rows_out, rows_in = (out, mapped) if out.dim() else (out.view(1), mapped.view(1))   # a 0-d tensor: one row
    cast_slices(path, name, rows_out, 0, rows_in.shape[0], rows_in[0].nbytes, lambda a, b: rows_in[a:b], finite,
                lambda part: mapping.let_go(part.data_ptr(), part.nbytes))
    return out


def read_into(f: SafetensorsFile, path, name: str, shape: tuple, stored, out, finite=False, rows=None):
    """Fill `out` (a tensor of `shape`: a new tensor, or the rows of a fused projection) with tensor
    `name` of the open file `f` -> out; rows=(first, end): only those rows of it, out being their
    shape. In the stored dtype the bytes go straight into out's memory (pread(2), no copy); in
    another dtype a slice of rows at a time (SLICE_BYTES) goes through the file's scratch buffer and
    is cast by the copy into out, so the stored-dtype copy of the whole never exists. finite=True:
    NaN or inf is a ValueError naming the file and the tensor (a FiniteChecks: the check of rows
    read straight into out is queued there)."""
    import torch

    first, end = rows if rows is not None else (0, shape[0] if shape else 0)
    if tuple(out.shape) != ((end - first, *shape[1:]) if rows is not None else tuple(shape)):
        raise ValueError(f"{path}: tensor {name} has shape {tuple(shape)}, its place {tuple(out.shape)}")
    direct = out.dtype == stored and out.is_contiguous() and out.device.type == "cpu"
    if sys.byteorder != "little" or not hasattr(os, "preadv") or not shape or (out.dtype == stored and not direct):
        whole = f.get_tensor(name) if rows is None else f.get_slice(name)[first:end]
        out.copy_(cast_read(path, name, whole, finite, None))               # the general (slower) way
        return out
    if direct:
        f.read_rows(name, first, end, shape, stored, out)
        check_finite(finite, path, name, out)
        return out
    # (rows, ...) in the stored dtype, in the scratch buffer: checked now, since it is read into again next
    return cast_slices(path, name, out, first, end, stored.itemsize * torch.Size(shape[1:]).numel(),
                       lambda start, stop: f.read_rows(name, start, stop, shape, stored), finite)


def cast_slices(path, name: str, out, first: int, end: int, row_bytes: int, rows, finite=False, done=None):
    """Fill `out` (another dtype) with rows [first, end) of tensor `name`, SLICE_BYTES of the stored
    dtype at a time: rows(start, stop) gives a slice (read into a scratch buffer, or a view of a
    mapping), which is checked for NaN / inf when finite, cast into its place, then handed to
    done(slice) when given (a mapping lets its pages go). -> out."""
    step = max(1, SLICE_BYTES // max(1, row_bytes))
    for start in range(first, end, step):
        part = rows(start, min(start + step, end))
        if finite:
            require_finite(path, name, part)
        out[start - first:start - first + step].copy_(part)
        if done is not None:
            done(part)
    return out
