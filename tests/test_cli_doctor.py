"""Optional features: every extra is listed by `logitlab doctor`, and a command whose extra is
missing prints one line naming the command and the extra (no traceback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from logitlab.cli import doctor
from logitlab.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def test_every_feature_is_an_extra_of_the_package():
    tomllib = pytest.importorskip("tomllib")              # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(doctor.FEATURES) <= set(extras)
    assert extras["all"] == [f"logitlab[{','.join(doctor.FEATURES)}]"]
    for extra, (modules, _) in doctor.FEATURES.items():
        listed = " ".join(extras[extra]).lower().replace("-", "_")
        assert all(dist.lower().replace("-", "_") in listed for dist in modules.values()), extra


def test_a_missing_module_is_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)      # `import uvicorn` raises ModuleNotFoundError
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "logitlab serve needs uvicorn: pip install 'logitlab[serve]'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_modules_are_not_blamed_on_an_extra():
    assert doctor.extra_for("jinja2.sandbox") == "post"
    assert doctor.extra_for("lm_eval") == "eval"
    assert doctor.missing_extra_line("train", ModuleNotFoundError("x", name="no_such_thing")) is None


def test_doctor_lists_every_extra(monkeypatch, capsys):
    real = doctor.importlib.util.find_spec
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: None if name == "peft" else real(name))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for extra in doctor.FEATURES:
        assert extra in out
    assert "peft missing" in out
    assert "pip install 'logitlab[post]'" in out


def test_help_and_argument_errors_import_no_torch():
    """`logitlab --help`, a command's --help and an argument error answer without importing torch
    (the parser is built from torch-free config modules), so they take a fraction of a second."""
    import subprocess

    code = ("import sys\nfrom logitlab.cli.main import main\n"
            "for argv in (['--help'], ['train', '--help'], ['generate', '--help'], ['sft', '--help'], "
            "['eval', 'long', '--help'], ['generate']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "HEAVY []" in out.stderr, out.stderr[-2000:]


def test_help_copies_of_library_constants_agree():
    from logitlab.cli import eval as cli_eval
    from logitlab.data.sft import TRAIN_ON
    from logitlab.eval.long import DEFAULT_SCALINGS
    from logitlab.model.positions import EXTENSIONS
    from logitlab.train.config import SFTConfig

    assert cli_eval.DEFAULT_SCALINGS == DEFAULT_SCALINGS and cli_eval.EXTENSIONS == EXTENSIONS
    for value in TRAIN_ON:
        SFTConfig(data="x.jsonl", train_on=value)


def test_doctor_says_which_compiled_parts_were_built(monkeypatch, capsys):
    for module in doctor.NATIVE:                   # every listed extension is one setup.py builds
        path = ROOT / (module.replace(".", "/") + ".c")
        assert path.is_file() and path.name in (ROOT / "setup.py").read_text(), module
    real = doctor.importlib.util.find_spec
    hidden = "logitlab.data._text_fast"
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: None if name == hidden else real(name))
    assert main(["doctor"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{doctor.NATIVE[hidden]}: not built (the Python path runs)" in out
