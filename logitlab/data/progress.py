"""A part being written, and the progress record that lets a killed run resume it.

progress.py owns the four files a part grows (tokens.bin, docs.bin, doc_ids.jsonl,
filtered.jsonl: appended a chunk at a time, in document order) and `progress.json` beside them:
where reading stopped (file, document, characters read), the counts and filter statistics so far,
and each file's size at that point. The record is rewritten atomically at most every
CHECKPOINT_SECONDS, after the files are flushed to disk, so it never claims more than they hold.
A run that resumes truncates each file to the recorded size and reads on from the recorded
position; since every document's output depends on the document alone, the finished part is
byte for byte the part an uninterrupted run writes (tested). parts.py decides when to resume.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from logitlab.data.filters import FilterStats
from logitlab.io import files

PROGRESS_FILE = "progress.json"
PROGRESS_FORMAT = "logitlab-part-progress"
CHECKPOINT_SECONDS = 10.0  # at most this much work is done again after a kill
FILES = ("tokens.bin", "docs.bin", "doc_ids.jsonl", "filtered.jsonl")


def start(job: dict) -> dict:
    """The progress of a part that has read nothing yet."""
    return {"format": PROGRESS_FORMAT, "job": job, "position": [0, 0, 0], "documents": 0, "tokens": 0,
            "bytes": 0, "filters": {}, "sizes": dict.fromkeys(FILES, 0)}


def has_progress(tmp: Path) -> bool:
    return (tmp / PROGRESS_FILE).is_file()


def resumable(tmp: Path, job: dict) -> dict | None:
    """The progress record in `tmp` when it belongs to `job` and every file holds at least what
    it says; else None (the directory is then removed, not resumed)."""
    try:
        state = json.loads((tmp / PROGRESS_FILE).read_text(encoding="utf-8"))
        if not isinstance(state, dict) or state.get("format") != PROGRESS_FORMAT or state.get("job") != job:
            return None
        if any((tmp / name).stat().st_size < int(state["sizes"][name]) for name in FILES):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state


def discard(tmp: Path) -> None:
    """Remove the record once the part is complete: it is no part of the output."""
    (tmp / PROGRESS_FILE).unlink(missing_ok=True)


class PartFiles:
    """The growing files of a part in `tmp`, opened at the sizes `state` records (a new part:
    empty). `write` appends one chunk's results and advances `state`; a context manager."""

    def __init__(self, tmp: Path, state: dict, checkpoint_seconds: float | None = None) -> None:
        self.tmp, self.state = tmp, state
        self.every = CHECKPOINT_SECONDS if checkpoint_seconds is None else checkpoint_seconds
        self.handles = {}
        for name in FILES:
            path = tmp / name
            f = path.open("r+b" if path.exists() else "w+b")
            f.truncate(state["sizes"][name])
            f.seek(0, os.SEEK_END)
            self.handles[name] = f
        self.last = time.monotonic()

    def __enter__(self) -> PartFiles:
        return self

    def __exit__(self, *exc) -> None:
        for name, f in self.handles.items():
            with files.writing(self.tmp / name):
                f.close()

    def write(self, meta: list, position: list, reasons: list, ids_list: list, records: np.ndarray) -> None:
        """One chunk, in order: `meta` (source, doc id, boilerplate lines) and the filters'
        `reasons` per document read; token arrays and records of the kept ones; `position` after it."""
        h, st = self.handles, self.state
        rejects, kept_ids = [], []
        for (name, doc_id, removed), reason in zip(meta, reasons):
            stats = st["filters"].setdefault(name, FilterStats().to_dict())
            stats["documents_in"] += 1
            stats["boilerplate_lines"] += removed
            if reason is None:
                stats["documents_kept"] += 1
                kept_ids.append(json.dumps(doc_id) + "\n")
            else:
                stats["removed"][reason] = stats["removed"].get(reason, 0) + 1
                rejects.append(json.dumps({"id": doc_id, "source": name, "reason": reason}) + "\n")
        with files.writing(self.tmp / FILES[0]):
            h["tokens.bin"].write(b"".join(ids.tobytes() for ids in ids_list))
            h["docs.bin"].write(records.tobytes())
            h["doc_ids.jsonl"].write("".join(kept_ids).encode("utf-8"))
            h["filtered.jsonl"].write("".join(rejects).encode("utf-8"))
        st["position"] = list(position)
        st["documents"] += len(records)
        st["tokens"] += int(records["tokens"].sum())
        st["bytes"] += int(records["bytes"].sum())
        if time.monotonic() - self.last >= self.every:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Flush the files to disk, then record how far they are complete (atomically)."""
        for name, f in self.handles.items():
            with files.writing(self.tmp / name):
                f.flush()
                os.fsync(f.fileno())
            self.state["sizes"][name] = f.tell()
        files.atomic_write_text(self.tmp / PROGRESS_FILE, json.dumps(self.state) + "\n")
        self.last = time.monotonic()
