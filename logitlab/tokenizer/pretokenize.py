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

For the GPT-2 pattern, when the compiled extension (_bpe_fast.c) is built, ASCII text is split
and counted in C (no str object per pre-token; about five times faster) and only the stretches
around non-ASCII characters go through the regex; the counts are identical (tested).

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

from logitlab.tokenizer.patterns import GPT2_PATTERN, SAFE_CUT, find_safe_cut, pretokenizer, special_regex

try:  # compiled from _bpe_fast.c at install when a C compiler is present (optional extension)
    from logitlab.tokenizer._bpe_fast import count_ascii_gpt2 as _count_ascii_gpt2
except ImportError:  # pragma: no cover - depends on the install
    _count_ascii_gpt2 = None

BLOCK_BYTES = 1 << 20  # bytes per read
CHUNK_CHARS = 1 << 20  # characters pre-tokenized at once
BATCH_BYTES = 4 << 20  # bytes of input per worker task
MIN_BYTES_PER_WORKER = 2 << 20  # below this much input per process, extra processes cost more than they save
_RANGE_CUT = re.compile(rb"(?<=[!-~])\n(?=[!-~])")  # a newline between printable ASCII characters
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_SAFE_CUT_AFTER = re.compile(r"(?<=\S) (?=\S)|(?<=\S\n)(?=\S)")  # SAFE_CUT, searched forwards


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


def native_counting(pattern: str) -> bool:
    """Whether pre-tokens of `pattern` are counted by the compiled splitter (GPT-2 pattern only)."""
    return _count_ascii_gpt2 is not None and pattern == GPT2_PATTERN


def count_part(text: str, counts: Counter, split, native: bool) -> None:
    """Add the pre-tokens of `text` to `counts`. native: ASCII stretches go to the compiled
    GPT-2 splitter (identical pieces, tested), the rest (cut out at SAFE_CUT points, where no
    pre-token is split) to `split`."""
    if not native:
        counts.update(split(text))
        return
    if text.isascii():
        _count_ascii_gpt2(text, counts)
        return
    n = len(text)
    if n - len(text.encode("ascii", "ignore")) > n >> 8:  # dense non-ASCII: one pass of `split`
        counts.update(split(text))
        return
    pos = 0
    while pos < n:
        m = _NON_ASCII.search(text, pos)
        if m is None:
            _count_ascii_gpt2(text[pos:], counts)
            return
        cut = SAFE_CUT.search(text, pos, m.start())
        start = cut.start() if cut is not None else pos
        if start > pos:
            _count_ascii_gpt2(text[pos:start], counts)
        after = _SAFE_CUT_AFTER.search(text, m.end())
        end = after.start() if after is not None else n
        counts.update(split(text[start:end]))
        pos = end


_WORKER: dict = {}


def _init_worker(pattern: str, specials: list[str], native: bool = False) -> None:
    _WORKER["split"] = pretokenizer(pattern)
    _WORKER["special"] = special_regex(specials)
    _WORKER["longest"] = max(map(len, specials), default=0)
    _WORKER["native"] = native


def _count_batch(batch: list[tuple[str, int, int]]) -> tuple[Counter, list[str], int]:
    """(pre-token counts, warning messages, bytes read) for one batch of file ranges."""
    split, special, native = _WORKER["split"], _WORKER["special"], _WORKER["native"]
    counts: Counter = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path, start, end in batch:
            for chunk in iter_chunks(path, start, end, special, _WORKER["longest"]):
                for part in (special.split(chunk) if special is not None else (chunk,)):
                    count_part(part, counts, split, native)
    return counts, [str(w.message) for w in caught], sum(end - start for _, start, end in batch)


def count_pretokens(files: list[Path], pattern: str, specials: list[str], workers: int | None = None,
                    progress=None, native: bool | None = None) -> Counter:
    """str pre-token -> frequency over all files, pre-tokenized by `workers` processes (default:
    all cores; fewer when there is under MIN_BYTES_PER_WORKER of input per process). The result
    does not depend on `workers`. `native`: None (default) uses the compiled GPT-2 splitter when
    it applies (see `native_counting`), False never; the counts are the same."""
    if native and not native_counting(pattern):
        raise ValueError("native=True needs the GPT-2 pattern and the compiled extension "
                         "logitlab.tokenizer._bpe_fast (reinstall with a C compiler: pip install -e .)")
    native = native_counting(pattern) if native is None else bool(native)
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
        _init_worker(pattern, specials, native)
        for batch in batches:
            collect(_count_batch(batch))
        return total
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(min(workers, len(batches)), initializer=_init_worker, initargs=(pattern, specials, native)) as pool:
        for result in pool.imap_unordered(_count_batch, batches):
            collect(result)
    return total
