"""CLI tables print every number whole at any width: a table wider than the terminal stays one
table whose text columns wrap (fold), and titles stand on their own line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("columns", [60, 80, 120])
def test_params_numbers_are_never_cut(columns):
    env = dict(os.environ, COLUMNS=str(columns))
    out = subprocess.run([sys.executable, "-m", "logitlab", "params", "llama3-70b", "--tflops", "100"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    assert "…" not in out
    for number in ("70,553,706,496", "70,552,387,584", "12,079,595,520", "56,371,445,760"):
        assert number in out, number
    assert "llama3-70b: D 8192, L 80, H 64, Hkv 8, Dh 128, F 28672, V 128256, untied" in out


def test_print_table_folds_instead_of_splitting():
    from rich.console import Console

    from logitlab.cli.common import print_table

    rows = [["row", "1,234,567,890", "9,876,543,210", "a long explanation of what the row means"]]
    columns = ["key", "first", "second", "why"]
    title = "a title that is longer than forty-four columns, on one line"
    for width, layout in ((200, "boxed"), (50, "compact"), (30, "records")):
        con = Console(width=width, record=True, force_terminal=False)
        print_table(con, title, columns, rows, right=(1, 2))
        text = con.export_text()
        lines = text.splitlines()
        assert lines[0] == title
        assert ("┏" in text) == (layout == "boxed")
        assert "1,234,567,890" in text and "9,876,543,210" in text and "…" not in text
        assert "explanation" in text
        if layout == "records":
            assert lines[1:5] == ["row", "  first: 1,234,567,890", "  second: 9,876,543,210",
                                  "  why: a long explanation of what the row means"]
        else:
            assert text.count("key") == 1, "one table, one header"
            assert all(len(line) <= width for line in lines[1:])
