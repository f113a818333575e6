"""`python -m logitlab` runs the command line (see cli.py)."""

from logitlab.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
