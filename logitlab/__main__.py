"""`python -m logitlab` runs the command line (see cli/main.py)."""

from logitlab.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
