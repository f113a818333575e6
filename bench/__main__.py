"""`python3 -m bench NAME...` runs the named benchmarks (`all`: every one that exists) in turn."""

from __future__ import annotations

import importlib.util
import runpy
import sys

NAMES = ("tokenizer", "model", "generate", "roofline")


def main(argv: list[str]) -> int:
    if not argv or any(a not in NAMES + ("all",) for a in argv):
        print(f"usage: python3 -m bench {{all,{','.join(NAMES)}}} ...", file=sys.stderr)
        return 2
    names = [n for n in NAMES if importlib.util.find_spec(f"bench.{n}")] if "all" in argv else argv
    for name in names:
        print(f"== bench.{name}", flush=True)
        sys.argv = [f"bench.{name}"]
        try:
            runpy.run_module(f"bench.{name}", run_name="__main__")
        except SystemExit as exc:  # each benchmark ends with SystemExit(main())
            if exc.code not in (0, None):
                return int(exc.code) if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
