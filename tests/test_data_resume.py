"""A preparation killed or interrupted part-way: the next run resumes the part from its last
progress record, to the bytes an uninterrupted run writes, and removes the temporary directories
that dead runs of ours left, never anything else (io/workdir.py, data/progress.py)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from logitlab.cli.main import main
from logitlab.data import merge, parts, progress
from logitlab.io import workdir
from tests.test_data_shards import CFG, _corpus, byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PART_FILES = ("tokens.bin", "docs.bin", "doc_ids.jsonl", "filtered.jsonl", "part.json", "tokenizer.logitlab.json")


class Counting:
    """The byte tokenizer, counting the documents it encodes."""

    def __init__(self):
        self.tok, self.calls = byte_tokenizer(), 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode_ordinary(self, text):
        self.calls += 1
        return self.tok.encode_ordinary(text)

    def encode_ordinary_array(self, text):
        self.calls += 1
        return self.tok.encode_ordinary_array(text)


def _same_files(a: Path, b: Path, names) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _interrupted(sources, tok, out: Path, after: int) -> None:
    """prepare_part stopped by Ctrl-C after `after` chunks were written."""
    calls = []

    def stop(documents, tokens):
        calls.append(documents)
        if len(calls) == after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        parts.prepare_part(sources, tok, out, CFG, workers=1, progress=stop)


def test_an_interrupted_part_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "_CHUNK_CHARS", 2000)
    monkeypatch.setattr(progress, "CHECKPOINT_SECONDS", 0.0)
    sources, tok = _corpus(tmp_path), Counting()
    whole = parts.prepare_part(sources, tok, tmp_path / "whole", CFG, workers=1)
    all_calls, tok.calls = tok.calls, 0
    _interrupted(sources, tok, tmp_path / "p", after=4)
    (left,) = workdir.leftovers(tmp_path / "p")  # kept: it holds a progress record
    assert progress.has_progress(left) and not (tmp_path / "p").exists()
    tok.calls, notes = 0, []
    assert parts.prepare_part(sources, tok, tmp_path / "p", CFG, workers=1, notice=notes.append) == whole
    assert 0 < tok.calls < all_calls - 10  # only what came after the record was encoded again
    assert len(notes) == 1 and "resuming" in notes[0] and "documents into file" in notes[0]
    _same_files(tmp_path / "whole", tmp_path / "p", PART_FILES)
    assert workdir.leftovers(tmp_path / "p") == [] and not (tmp_path / "p" / progress.PROGRESS_FILE).exists()
    # with worker processes, the resumed part is the same too
    _interrupted(sources, byte_tokenizer(), tmp_path / "q", after=3)
    assert parts.prepare_part(sources, byte_tokenizer(), tmp_path / "q", CFG, workers=2) == whole
    _same_files(tmp_path / "whole", tmp_path / "q", PART_FILES)


def test_leftovers_of_another_job_or_damaged_are_removed_and_others_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(parts, "_CHUNK_CHARS", 2000)
    monkeypatch.setattr(progress, "CHECKPOINT_SECONDS", 0.0)
    sources, out = _corpus(tmp_path), tmp_path / "p"
    _interrupted(sources, byte_tokenizer(), out, after=2)
    (stale,) = workdir.leftovers(out)
    foreign = tmp_path / ".p.tmp-mine"  # the pattern, but no writer file: not provably ours
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    busy = tmp_path / ".p.tmp-busy"  # ours, but its writer still holds the lock
    busy.mkdir()
    fd = os.open(busy / workdir.WRITER_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"kind": parts.PART_KIND, "pid": os.getpid(), "host": socket.gethostname()}).encode())
    try:
        other = parts.PrepareConfig(dedup=CFG.dedup)  # another job: its leftover is not resumed
        tok, notes = Counting(), []
        parts.prepare_part(sources, tok, out, other, workers=1, notice=notes.append)
        assert notes == [] and not stale.exists()
        assert (foreign / "notes.txt").read_text() == "keep me" and busy.is_dir()
    finally:
        os.close(fd)  # the "writer" dies: its directory is stale now
    # a record that claims more than the files hold is not trusted: removed, prepared from zero
    _interrupted(sources, byte_tokenizer(), tmp_path / "r", after=2)
    (left,) = workdir.leftovers(tmp_path / "r")
    state = json.loads((left / progress.PROGRESS_FILE).read_text())
    os.truncate(left / "tokens.bin", state["sizes"]["tokens.bin"] - 1)
    notes = []
    parts.prepare_part(sources, byte_tokenizer(), tmp_path / "r", CFG, workers=1, notice=notes.append)
    assert notes == [] and workdir.leftovers(tmp_path / "r") == []
    parts.prepare_part(sources, byte_tokenizer(), out, CFG, workers=1)
    assert not busy.exists() and foreign.is_dir()


_SLOW_PREPARE = """
import sys, time
from logitlab.cli.main import main
from logitlab.data import parts, progress, tokens
parts._CHUNK_CHARS = tokens._CHUNK_CHARS = 3000
progress.CHECKPOINT_SECONDS = 0.0
write, encode = progress.PartFiles.write, tokens._encode_chunk
progress.PartFiles.write = lambda *a: (write(*a), time.sleep(0.2))  # slow enough to be killed part-way
tokens._encode_chunk = lambda task: (time.sleep(0.2), encode(task))[1]
sys.exit(main(sys.argv[1:]))
"""


def _kill_when(argv, ready, timeout: float = 120.0) -> None:
    """Run `logitlab` with argv in a subprocess (slowed down) and kill -9 it once ready()."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PREPARE, *argv], cwd=ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout  # generous: the machine may be loaded
    try:
        while not ready():
            assert proc.poll() is None, f"prepare ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "timed out waiting for prepare"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _progress_recorded(out: Path) -> bool:
    return any(progress.has_progress(d) for d in workdir.leftovers(out.parent / f".{out.name}.part"))


@pytest.mark.slow
def test_kill_9_during_prepare_then_the_rerun_resumes_and_cleans_up(tmp_path, capsys):
    tok = byte_tokenizer()
    tok.save(tmp_path / "tok.json")
    sources = _corpus(tmp_path)
    argv = ["prepare", "--data", *sources, "--filter", "--filter-code-sources", "code", "--dedup", "exact", "near",
            "--dedup-bands", "8", "--dedup-rows", "4", "--tokenizer", str(tmp_path / "tok.json"), "--workers", "1",
            "--shard-tokens", "600", "--val-fraction", "0.1"]
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    out = tmp_path / "out"
    _kill_when([*argv, "--out", str(out)], lambda: _progress_recorded(out))
    assert not out.exists() and workdir.leftovers(out.parent / ".out.part")  # what the kill left
    capsys.readouterr()
    assert main([*argv, "--out", str(out)]) == 0
    assert "resuming" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest == json.loads((tmp_path / "whole" / "manifest.json").read_text())
    shards = [s["file"] for split in manifest["splits"].values() for s in split["shards"]]
    _same_files(tmp_path / "whole", out, shards + ["filtered.jsonl", "duplicates.jsonl"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # part and leftovers gone

    # the single-file layout: nothing to resume, but the killed run's temporary directory goes
    plain = tmp_path / "plain"
    mine = tmp_path / ".plain.tmp-notes"  # someone's own directory that happens to match the pattern
    mine.mkdir()
    single = ["prepare", "--data", str(tmp_path / "web"), "--tokenizer", str(tmp_path / "tok.json"), "--workers",
              "1", "--out", str(plain)]

    def started() -> bool:
        return any((d / "train.bin").is_file() and (d / "train.bin").stat().st_size for d in workdir.leftovers(plain))

    _kill_when(single, started)
    assert len(workdir.leftovers(plain)) == 2
    assert main(single) == 0
    assert workdir.leftovers(plain) == [mine] and (plain / "manifest.json").is_file()


def test_a_dead_merges_leftover_is_removed(tmp_path):
    parts.prepare_part(_corpus(tmp_path), byte_tokenizer(), tmp_path / "p0", CFG, workers=1)
    dead = tmp_path / ".merged.tmp-k1ll3d"  # as a merge killed with SIGKILL leaves it: its lock is free
    dead.mkdir()
    (dead / "train-00000.bin").write_bytes(b"\0\0")
    (dead / workdir.WRITER_FILE).write_text(json.dumps({"kind": "token data", "pid": 1, "host": socket.gethostname()}))
    with pytest.raises(RuntimeError):  # a merge that fails part-way leaves nothing behind either
        with workdir.tracked_directory(tmp_path / "merged", "token data") as (tmp, _):
            assert not dead.exists()
            raise RuntimeError("boom")
    dead.mkdir()
    (dead / workdir.WRITER_FILE).write_text(json.dumps({"kind": "token data", "pid": 1, "host": "elsewhere"}))
    merge.merge_parts([tmp_path / "p0"], tmp_path / "merged")
    assert workdir.leftovers(tmp_path / "merged") == [dead]  # another host's: its writer may be alive there
