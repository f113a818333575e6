"""Benchmarks against peer libraries; run one with `python3 -m bench.<name>` from the repository root."""
