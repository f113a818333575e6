"""The command line: argparse subcommands, one module per stage; the only place that reads argv,
prints, or draws progress bars and tables."""

from logitlab.cli.main import main

__all__ = ["main"]
