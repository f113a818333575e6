"""Run a memory bomb where it cannot hurt: a fresh Python process whose address space is capped
(resource.RLIMIT_AS), so a regression that allocates what a hostile file asks for fails the test
with torch's "tried to allocate" error instead of taking the shared machine down. A hang is a
failure too (timeout)."""

from __future__ import annotations

import subprocess
import sys

GIB = 2**30


def run_bounded(code: str, *args: str, limit: int = 4 * GIB, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -c code args...` with at most `limit` bytes of address space (importing torch takes
    about 1 GiB of it) -> the completed process (stdout, stderr, returncode); never raises for a
    non-zero exit, so the caller reads the error the child printed."""
    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap)


def last_line(proc: subprocess.CompletedProcess) -> str:
    """The last line the child wrote on stderr (an uncaught exception's message), or stdout's."""
    lines = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return lines[-1] if lines else ""
