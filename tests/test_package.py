"""The package surface: lazy public API, no side effects on import, the console entry point."""

from __future__ import annotations

import subprocess
import sys

import logitlab


def test_import_has_no_side_effects():
    code = "import sys, logitlab; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_cli_and_training_do_not_import_the_compiler():
    """torch._inductor takes seconds to import: only a compile that needs it imports it (the
    training step's graph passes are imported by loss_fn when it compiles with inductor)."""
    code = ("import sys, logitlab.cli, logitlab.train.loop, logitlab.generate; "
            "print('torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_public_names_resolve():
    for name in logitlab.__all__:
        assert getattr(logitlab, name) is not None
    try:
        logitlab.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("unknown attribute did not raise")


def test_cli_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "logitlab", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for command in ("tokenizer", "params", "convert", "prepare", "train", "plot", "export", "demo",
                    "generate", "chat", "inspect"):
        assert command in out.stdout, command


def test_version_and_help_point_to_the_demo():
    out = subprocess.run([sys.executable, "-m", "logitlab", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"logitlab {logitlab.__version__}"
    out = subprocess.run([sys.executable, "-m", "logitlab", "--help"], capture_output=True, text=True)
    assert "logitlab demo" in " ".join(out.stdout.split())
