"""Training input for BPE: files -> distinct pre-tokens with their counts, in parallel, streamed.

bpe.py learns merges from what this module counts. The work is planned as byte ranges of files
(a large file is cut after a newline between two printable ASCII characters: no pre-token of the
gpt2 or cl100k pattern crosses such a point), grouped into batches of about `BATCH_BYTES`.
Worker processes read their own ranges block by block (no text travels between processes),
cut the text into chunks at safe points, split each chunk at special tokens (so no merge crosses
a document boundary), pre-tokenize it and count the pre-tokens; each batch returns one Counter.
Memory is bounded by the distinct pre-tokens, not by the corpus size.

Cut points are exact for the gpt2 and cl100k patterns (tested); a custom pattern that matches
across "non-space, one space or newline, non-space" may split differently at chunk boundaries.

Invalid UTF-8 is decoded with U+FFFD replacement; a UnicodeWarning names the file and the byte
offset of the first bad byte (once per file range).
"""

from __future__ import annotations

import codecs
import os
import re
import sysconfig
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from logitlab.tokenizer.patterns import find_safe_cut, pretokenizer, special_regex

BLOCK_BYTES = 1 << 20  # bytes per read
CHUNK_CHARS = 1 << 20  # characters pre-tokenized at once
BATCH_BYTES = 4 << 20  # bytes of input per worker task
MIN_BYTES_PER_WORKER = 2 << 20  # below this much input per process, extra processes cost more than they save
_RANGE_CUT = re.compile(rb"(?<=[!-~])\n(?=[!-~])")  # a newline between printable ASCII characters


def stdlib_files() -> list[Path]:
    """The Python standard library's own *.py files (no site-packages): the default corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in ("site-packages", "dist-packages", "__pycache__") for part in p.parts))


def expand_paths(input_path, glob: str = "**/*") -> list[Path]:
    """One path or a list of paths; directories give their files matching `glob`, sorted."""
    items = [input_path] if isinstance(input_path, (str, os.PathLike)) else list(input_path)
    if not items:
        raise ValueError("no training input given")
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.glob(glob) if f.is_file())
            if not found:
                raise ValueError(f"directory {p} has no files matching {glob!r}")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"training input not found: {p}")
    return files


def read_text_blocks(path, start: int = 0, end: int | None = None,
                     block_bytes: int = BLOCK_BYTES) -> Iterator[str]:
    """Decode bytes [start, end) of a file block by block; invalid UTF-8 -> U+FFFD plus one
    warning naming the file and the byte offset."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    offset = start
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            want = block_bytes if end is None else min(block_bytes, end - offset)
            block = f.read(want) if want > 0 else b""
            if not block:
                break
            pending = decoder.getstate()[0]
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as exc:
                _warn_bad(path, offset - len(pending) + exc.start)
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                text = decoder.decode(pending + block)
            offset += len(block)
            yield text
        try:
            tail = decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            pending = decoder.getstate()[0]
            _warn_bad(path, offset - len(pending))
            tail = pending.decode("utf-8", errors="replace")
        if tail:
            yield tail


def _warn_bad(path, offset: int) -> None:
    warnings.warn(f"{path}: invalid UTF-8 at byte offset {offset}; decoding it with U+FFFD "
                  f"replacement", UnicodeWarning, stacklevel=2)


def iter_chunks(path, start: int, end: int | None, special_re, longest_special: int = 0,
                chunk_chars: int | None = None) -> Iterator[str]:
    """Text of one file range in chunks of about `chunk_chars`, cut where no pre-token or
    special token is split."""
    chunk_chars = chunk_chars or CHUNK_CHARS
    buf = ""
    for text in read_text_blocks(path, start, end):
        buf += text
        if len(buf) >= chunk_chars:
            cut = find_safe_cut(buf, special_re, longest_special)
            if cut > 0:
                yield buf[:cut]
                buf = buf[cut:]
    if buf:
        yield buf


def plan_batches(files: list[Path], specials: list[str], batch_bytes: int = BATCH_BYTES
                 ) -> list[list[tuple[str, int, int]]]:
    """Group (path, start, end) byte ranges into batches of about `batch_bytes`."""
    can_cut = not any("\n" in s for s in specials)
    units: list[tuple[str, int, int]] = []
    for path in files:
        size = path.stat().st_size
        cuts = [0]
        if can_cut and size > batch_bytes:
            with open(path, "rb") as f:
                for target in range(batch_bytes, size, batch_bytes):
                    f.seek(target)
                    m = _RANGE_CUT.search(f.read(1 << 16))
                    if m is not None and target + m.end() > cuts[-1]:
                        cuts.append(target + m.end())
        cuts.append(size)
        units.extend((str(path), a, b) for a, b in zip(cuts, cuts[1:]) if b > a)
    batches: list[list[tuple[str, int, int]]] = []
    current, current_size = [], 0
    for unit in units:
        current.append(unit)
        current_size += unit[2] - unit[1]
        if current_size >= batch_bytes:
            batches.append(current)
            current, current_size = [], 0
    if current:
        batches.append(current)
    return batches


_WORKER: dict = {}


def _init_worker(pattern: str, specials: list[str]) -> None:
    _WORKER["split"] = pretokenizer(pattern)
    _WORKER["special"] = special_regex(specials)
    _WORKER["longest"] = max(map(len, specials), default=0)


def _count_batch(batch: list[tuple[str, int, int]]) -> tuple[Counter, list[str], int]:
    """(pre-token counts, warning messages, bytes read) for one batch of file ranges."""
    split, special = _WORKER["split"], _WORKER["special"]
    counts: Counter = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path, start, end in batch:
            for chunk in iter_chunks(path, start, end, special, _WORKER["longest"]):
                for part in (special.split(chunk) if special is not None else (chunk,)):
                    counts.update(split(part))
    return counts, [str(w.message) for w in caught], sum(end - start for _, start, end in batch)


def count_pretokens(files: list[Path], pattern: str, specials: list[str], workers: int | None = None,
                    progress=None) -> Counter:
    """str pre-token -> frequency over all files, pre-tokenized by `workers` processes (default:
    all cores; fewer when there is under MIN_BYTES_PER_WORKER of input per process). The result
    does not depend on `workers`."""
    workers = (os.cpu_count() or 1) if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    total_bytes = sum(f.stat().st_size for f in files)
    workers = max(1, min(workers, total_bytes // max(1, MIN_BYTES_PER_WORKER)))
    batch_bytes = min(BATCH_BYTES, max(1 << 18, total_bytes // (4 * workers)))
    batches = plan_batches(files, specials, batch_bytes)
    total: Counter = Counter()

    def collect(result) -> None:
        counts, messages, n_bytes = result
        total.update(counts)
        for message in messages:
            warnings.warn(message, UnicodeWarning, stacklevel=4)
        if progress:
            progress(n_bytes)

    if workers == 1 or len(batches) == 1:
        _init_worker(pattern, specials)
        for batch in batches:
            collect(_count_batch(batch))
        return total
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(min(workers, len(batches)), initializer=_init_worker, initargs=(pattern, specials)) as pool:
        for result in pool.imap_unordered(_count_batch, batches):
            collect(result)
    return total
