"""Subcommands for the train stage (registered by cli.py)."""

from __future__ import annotations


def register(subparsers) -> None:
    """Add this module's subcommands to `subparsers`."""
