"""`python3 -m bench all|NAME... [--quick] [--no-doc]` runs benchmarks in turn and reports which failed.

Each part runs in its own process (`python3 -m bench.NAME`), so a crash, a thread setting or the
memory of one part does not reach the next; a failure is reported and the run goes on. Flags are
passed to every part that accepts them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

from bench.common import ROOT

NAMES = ("tokenizer", "model", "generate", "roofline", "scaling", "hybrid", "data_prepare", "serve_load",
         "serve_paged")
FLAGS = ("--quick", "--no-doc")


def accepts(name: str, flag: str) -> bool:
    """Whether bench/NAME.py declares `flag` on its command line."""
    spec = importlib.util.find_spec(f"bench.{name}")
    return bool(spec and spec.origin) and f'"{flag}"' in open(spec.origin).read()


def run_part(name: str, flags: list[str]) -> int:
    """Run one benchmark in a fresh interpreter; -> its exit status."""
    args = [f for f in flags if accepts(name, f)]
    return subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=ROOT).returncode


def main(argv: list[str]) -> int:
    flags = [a for a in argv if a in FLAGS]
    names = [a for a in argv if a not in FLAGS]
    unknown = [a for a in names if a not in NAMES + ("all",)]
    if not names or unknown or any(a.startswith("-") for a in names):
        print(f"usage: python3 -m bench {{all,{','.join(NAMES)}}} ... [--quick] [--no-doc]"
              + (f"; unknown: {' '.join(unknown)}" if unknown else ""), file=sys.stderr)
        return 2
    if "all" in names:
        names = [n for n in NAMES if importlib.util.find_spec(f"bench.{n}")]
    status = {}
    for name in names:
        print(f"== bench.{name} {' '.join(flags)}".rstrip(), flush=True)
        start = time.perf_counter()
        try:
            status[name] = run_part(name, flags)
        except Exception as exc:  # the part could not even start: report it, go on with the next
            print(f"bench.{name} did not start: {exc}", file=sys.stderr)
            status[name] = -1
        print(f"== bench.{name}: {'ok' if status[name] == 0 else f'FAILED (exit {status[name]})'} "
              f"in {time.perf_counter() - start:.0f} s", flush=True)
    failed = [n for n, rc in status.items() if rc != 0]
    print(f"== {len(names) - len(failed)} of {len(names)} passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
