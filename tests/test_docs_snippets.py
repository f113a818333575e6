"""Every ```python and ```bash (or ```sh) block of README.md and docs/**/*.md runs as written.

A page is one test. Its runnable blocks run in page order in a fresh temporary directory:
python blocks share one namespace (one interpreter per page), bash blocks run with `bash -e`.
The environment has LOGITLAB_DOCS_TINY=1 (for examples that choose a tiny size) and the
`logitlab` script on PATH. Blocks fenced ```text, ```console, ```toml and so on are not run.
A page holding the HTML comment <!-- slow --> is a slow test (pytest -m slow).

Expected output: a block fenced ```text output holds what the closest runnable block above it
prints (its stdout; for python, what print() writes to sys.stdout). The two are compared exactly,
line by line, after trailing spaces of each line and trailing blank lines are dropped, so a page
prints rounded numbers (f"{x:.3f}") and a number in the page that disagrees with the code fails the
test. Output that depends on many floating-point steps (a short training run) may instead be fenced
```text output tol=0.05: then the text between numbers must still match exactly and each number
may differ by at most that absolute amount. One output block per runnable block; an output block with
no runnable block above it, or a second one for the same block, is an error.

A page holding <!-- requires: PATH --> (PATH relative to the project root, e.g. ../shared/data/gpt2)
is skipped, with the path as the reason, where PATH does not exist.

A page holding <!-- hub-cache: ID --> runs with HF_HUB_CACHE pointing at a Hugging Face cache that the
test fills first (HUB_FIXTURES: "gpt2" is a GPT-2-shaped model with random weights and GPT-2's own
vocabulary from the shared data folder), offline, so that `load_pretrained("gpt2")` runs as a user's
would on a cache of their own, and never downloads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash"}
SLOW_MARK = "<!-- slow -->"
OUTPUT_INFO = "text output"  # info string of a block holding the expected stdout of the block above
_OUTPUT = re.compile(r"text output(?: tol=(\d+(?:\.\d*)?(?:e-?\d+)?))?")  # and its optional tolerance
_REQUIRES = re.compile(r"<!-- requires: (\S+) -->")  # a path the page needs; the page is skipped without it
_HUB_CACHE = re.compile(r"<!-- hub-cache: (\S+) -->")  # a hub id the test puts into the page's cache
PAGE_TIMEOUT_S = 900
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    kind: str   # "python" or "bash"
    line: int   # 1-based line of the opening fence
    code: str
    expected: str | None = None  # the ```text output block that follows it, if any
    expected_line: int = 0       # 1-based line of that block's opening fence
    tolerance: float = 0.0       # the absolute tolerance for numbers (0: exact)


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(info string, line of the opening fence, body) of every fenced code block (CommonMark:
    a fence of 3+ backticks or tildes, closed by a fence of the same character at least as long)."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        start, body, i = i + 1, [], i + 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if close and close.group(2)[0] == fence[0] and len(close.group(2)) >= len(fence) \
                    and not close.group(3).strip():
                break
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            i += 1
        found.append((info, start, "\n".join(body) + "\n"))
        i += 1
    return found


def runnable_blocks(text: str) -> list[Block]:
    """The blocks whose info string is exactly python, bash or sh, in page order, each with the
    expected output of the ```text output block after it (see output_problems for misplaced ones)."""
    blocks: list[Block] = []
    for info, line, code in fenced_blocks(text):
        if info in RUNNABLE:
            blocks.append(Block(RUNNABLE[info], line, code))
        elif (m := _OUTPUT.fullmatch(info)) and blocks and blocks[-1].expected is None:
            blocks[-1] = Block(blocks[-1].kind, blocks[-1].line, blocks[-1].code, code, line, float(m.group(1) or 0))
    return blocks


def output_problems(text: str) -> list[str]:
    """Output blocks that belong to no runnable block: none above them, or a second for one block."""
    problems, owner, taken = [], None, set()
    for info, line, code in fenced_blocks(text):
        if info in RUNNABLE:
            owner = line
        elif info.startswith(OUTPUT_INFO) and not _OUTPUT.fullmatch(info):
            problems.append(f"line {line}: ```{info} is not ```{OUTPUT_INFO} or ```{OUTPUT_INFO} tol=NUMBER")
        elif info.startswith(OUTPUT_INFO):
            if owner is None:
                problems.append(f"line {line}: a ```{OUTPUT_INFO} block with no runnable block above it")
            elif owner in taken:
                problems.append(f"line {line}: a second ```{OUTPUT_INFO} block for the block at line {owner}")
            taken.add(owner)
    return problems


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _params():
    out = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if not runnable_blocks(text):
            continue
        marks = [pytest.mark.slow] if SLOW_MARK in text else []
        out.append(pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks))
    return out


# The interpreter a page's blocks run in: python blocks exec'd in one namespace, bash blocks as
# `bash -e -c`, in order; the first failure names the page and the block's line, then exits 1.
# A block with expected output has its stdout captured, echoed, then compared (see the docstring).
_DRIVER = r"""
import contextlib, difflib, io, json, re, subprocess, sys, traceback
page, blocks = sys.argv[1], json.load(sys.stdin)
namespace = {"__name__": "__main__"}

def lines(text):
    out = [line.rstrip() for line in text.splitlines()]
    while out and not out[-1]:
        out.pop()
    return out

NUMBER = re.compile(r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")

def agree(expected, printed, tol):
    a, b = lines(expected), lines(printed)
    if tol == 0 or len(a) != len(b):
        return a == b
    for x, y in zip(a, b):
        px, py = NUMBER.split(x), NUMBER.split(y)  # text, number, text, ..., text
        if len(px) != len(py) or px[0::2] != py[0::2]:
            return False
        if any(abs(float(u) - float(v)) > tol for u, v in zip(px[1::2], py[1::2])):
            return False
    return True

for kind, line, code, expected, expected_line, tol in blocks:
    print(f"--- {page}:{line} ({kind})", flush=True)
    captured = None
    if kind == "bash":
        done = subprocess.run(["bash", "-e", "-c", code], stdin=subprocess.DEVNULL, text=True,
                              stdout=None if expected is None else subprocess.PIPE)
        captured = done.stdout
        if captured is not None:
            sys.stdout.write(captured)
        if done.returncode:
            print(f"FAILED: {page}:{line}: the bash block exited with {done.returncode}", flush=True)
            sys.exit(1)
    else:
        buffer = io.StringIO() if expected is not None else None
        try:
            with contextlib.redirect_stdout(buffer) if buffer is not None else contextlib.nullcontext():
                exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except BaseException:
            if buffer is not None:
                sys.stdout.write(buffer.getvalue())
            traceback.print_exc()
            print(f"FAILED: {page}:{line}: the python block raised", flush=True)
            sys.exit(1)
        captured = None if buffer is None else buffer.getvalue()
        if captured is not None:
            sys.stdout.write(captured)
    if expected is not None and not agree(expected, captured, tol):
        diff = difflib.unified_diff(lines(expected), lines(captured), f"{page}:{expected_line} (expected)",
                                    f"{page}:{line} (printed)", lineterm="")
        print("\n".join(diff), flush=True)
        within = f" (numbers within {tol})" if tol else ""
        print(f"FAILED: {page}:{line}: the block printed other output than the text output block at line "
              f"{expected_line} shows{within}", flush=True)
        sys.exit(1)
"""


def _random_gpt2(cache: Path, work: Path) -> None:
    from tests._hub import add_random_gpt2

    data = ROOT.parent / "shared" / "data" / "gpt2"
    add_random_gpt2(cache, data / "vocab.json", data / "merges.txt", work)


HUB_FIXTURES = {"gpt2": _random_gpt2}  # hub id -> fill(cache, work folder)


def hub_cache_env(text: str, root: Path) -> dict[str, str]:
    """The environment of a page holding <!-- hub-cache: ID -->: its ids put into a fresh cache under
    `root` (outside the page's working directory), HF_HUB_CACHE pointing there, offline."""
    ids = _HUB_CACHE.findall(text)
    if not ids:
        return {}
    cache, work = root / "cache", root / "sources"
    for repo_id in ids:
        HUB_FIXTURES[repo_id](cache, work)
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def run_page(page: Path, workdir: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    blocks = runnable_blocks(page.read_text(encoding="utf-8"))
    scripts = str(Path(sys.executable).parent)  # where `pip install -e .` put the logitlab script
    env = dict(os.environ, LOGITLAB_DOCS_TINY="1", PATH=scripts + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    name = str(page.relative_to(ROOT))
    payload = json.dumps([(b.kind, b.line, b.code, b.expected, b.expected_line, b.tolerance) for b in blocks])
    return subprocess.run([sys.executable, "-c", _DRIVER, name], input=payload, cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)


@pytest.mark.parametrize("page", _params())
def test_page_snippets_run(page: Path, tmp_path: Path):
    missing = [p for p in _REQUIRES.findall(page.read_text(encoding="utf-8")) if not (ROOT / p).exists()]
    if missing:
        pytest.skip(f"{page.name} needs {', '.join(missing)} (relative to {ROOT}), which is absent")
    problems = output_problems(page.read_text(encoding="utf-8"))
    assert not problems, f"{page.name}: " + "; ".join(problems)
    workdir = tmp_path / "page"
    workdir.mkdir(exist_ok=True)
    done = run_page(page, workdir, hub_cache_env(page.read_text(encoding="utf-8"), tmp_path / "hub"))
    if done.returncode:
        failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED: ")]
        where = failed[-1] if failed else f"{page.name}: exit code {done.returncode}"
        pytest.fail(f"{where}\n--- stdout (tail)\n{done.stdout[-6000:]}\n--- stderr (tail)\n{done.stderr[-6000:]}",
                    pytrace=False)


# -------------------- the collector itself

def test_only_python_bash_and_sh_blocks_run():
    text = ("# t\n```python\nx = 1\n```\n```text\nnot run\n```\n```bash\necho hi\n```\n"
            "```console\n$ no\n```\n```sh\ntrue\n```\n```toml\n[a]\n```\n```python title\nno\n```\n")
    blocks = runnable_blocks(text)
    assert [(b.kind, b.line, b.code) for b in blocks] == [
        ("python", 2, "x = 1\n"), ("bash", 8, "echo hi\n"), ("bash", 14, "true\n")]


def test_fences_nest_and_close_only_on_their_own_kind():
    text = "````python\n```bash\ninner\n```\n````\n~~~bash\n```\nstill bash\n~~~\n  ```python\n  y = 2\n  ```\n"
    blocks = runnable_blocks(text)
    assert [(b.kind, b.line) for b in blocks] == [("python", 1), ("bash", 6), ("python", 10)]
    assert blocks[0].code == "```bash\ninner\n```\n"
    assert blocks[1].code == "```\nstill bash\n"
    assert blocks[2].code == "y = 2\n"


def test_a_failing_block_names_its_page_and_line(tmp_path: Path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("```python\nvalue = 41\n```\n\n```bash\ntest -n \"$LOGITLAB_DOCS_TINY\"\n```\n\n"
                    "```python\nassert value == 41\nraise SystemExit(3)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    done = run_page(page, tmp_path)
    assert done.returncode == 1
    assert "FAILED: page.md:9: the python block raised" in done.stdout
    assert "page.md:5 (bash)" in done.stdout  # the bash block ran (and passed) before it


def test_output_blocks_attach_to_the_block_above():
    text = ("```python\nprint(1)\n```\n```text output\n1\n```\n```bash\necho 2\n```\nprose\n"
            "```text\nnot output\n```\n```text output\n2\n```\n```python\nx = 3\n```\n")
    blocks = runnable_blocks(text)
    assert [(b.kind, b.expected, b.expected_line) for b in blocks] == [
        ("python", "1\n", 4), ("bash", "2\n", 14), ("python", None, 0)]
    assert output_problems(text) == []
    bad = "```text output\n0\n```\n```python\nprint(1)\n```\n```text output\n1\n```\n```text output\n1\n```\n"
    assert output_problems(bad) == [
        f"line 1: a ```{OUTPUT_INFO} block with no runnable block above it",
        f"line 10: a second ```{OUTPUT_INFO} block for the block at line 4"]


def test_printed_output_is_compared_with_the_page(tmp_path: Path, monkeypatch):
    page = tmp_path / "page.md"
    good = ("```python\nx = 2 / 3\nprint(f'{x:.3f}  ')\n```\n```text output\n0.667\n\n```\n"
            "```bash\necho two\n```\n```text output\ntwo\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page.write_text(good)
    done = run_page(page, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0.667" in done.stdout  # captured output is still shown
    page.write_text(good.replace("0.667\n", "0.666\n"))
    done = run_page(page, tmp_path)
    assert done.returncode == 1
    assert "FAILED: page.md:1: the block printed other output than the text output block at line 5" in done.stdout
    assert "-0.666" in done.stdout and "+0.667" in done.stdout
    page.write_text(good.replace("output\ntwo", "output\nthree"))
    done = run_page(page, tmp_path)
    assert "FAILED: page.md:9: the block printed other output" in done.stdout


def test_a_tolerance_allows_numbers_to_differ_by_that_much_and_no_more(tmp_path: Path, monkeypatch):
    page = tmp_path / "page.md"
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    code = "```python\nprint('loss 0.52 nats, 7/30 right')\n```\n"
    for expected, tol, ok in (("loss 0.50 nats, 7/30 right", "0.05", True),
                              ("loss 0.40 nats, 7/30 right", "0.05", False),
                              ("loss 0.50 nats, 7/30 right", None, False),
                              ("loss 0.52 bits, 7/30 right", "0.05", False),
                              ("loss 0.52 nats, 7/30", "0.05", False)):
        info = OUTPUT_INFO + (f" tol={tol}" if tol else "")
        page.write_text(f"{code}```{info}\n{expected}\n```\n")
        assert runnable_blocks(page.read_text())[0].tolerance == float(tol or 0)
        done = run_page(page, tmp_path)
        assert (done.returncode == 0) == ok, (expected, tol, done.stdout)
        if not ok:
            assert "the block printed other output" in done.stdout
    assert output_problems(f"{code}```text output tol=x\n1\n```\n") == [
        "line 4: ```text output tol=x is not ```text output or ```text output tol=NUMBER"]


def test_a_page_whose_required_path_is_absent_is_skipped(tmp_path: Path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- requires: data/absent.txt -->\n```python\nraise SystemExit(1)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="data/absent.txt"):
        test_page_snippets_run(page, tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "absent.txt").write_text("here\n")
    with pytest.raises(pytest.fail.Exception, match="page.md:2: the python block raised"):
        test_page_snippets_run(page, tmp_path)


def test_a_hub_cache_page_loads_its_ids_offline_from_the_filled_cache(tmp_path: Path, monkeypatch):
    from logitlab.io.hf import save_pretrained
    from logitlab.model import Transformer, get_preset
    from tests._hub import add_snapshot

    def tiny(cache: Path, work: Path) -> None:
        save_pretrained(Transformer(get_preset("tiny", n_layers=3)), work / "x")
        add_snapshot(cache, "org/x", work / "x")

    monkeypatch.setitem(HUB_FIXTURES, "org/x", tiny)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("<!-- hub-cache: org/x -->\n```python\nimport logitlab\n"
                    "print(logitlab.load_pretrained('org/x').config.n_layers)\n```\n```text output\n3\n```\n")
    test_page_snippets_run(page, tmp_path)               # the page's stdout is compared with "3"
    assert (tmp_path / "hub" / "cache" / "models--org--x").is_dir()
    assert not (tmp_path / "page" / "x").exists()        # the source folder stays out of the page's directory


def test_every_page_with_blocks_is_collected():
    ids = {p.id for p in _params()}
    assert "README.md" in ids
    for page in pages():
        if runnable_blocks(page.read_text(encoding="utf-8")):
            assert str(page.relative_to(ROOT)) in ids


# -------------------- the TOML formats the docs show

_HEREDOC_TOML = re.compile(r"cat > (\S+\.toml) <<'EOF'\n(.*?)\nEOF\n", re.S)


def _doc_toml_examples() -> list[tuple[str, str]]:
    found = []
    for page in pages():
        for name, body in _HEREDOC_TOML.findall(page.read_text(encoding="utf-8")):
            found.append((f"{page.relative_to(ROOT)}:{name}", body))
    return found


def test_toml_examples_load_through_the_config_loaders(tmp_path: Path):
    """Each [train], [model] and [sample] example in the docs builds its config with the loader the
    CLI uses (defaults < preset < file), so a documented key that does not exist fails here."""
    import argparse

    from logitlab.cli.common import build_config, read_toml
    from logitlab.cli.train import _model_config
    from logitlab.generate.loop import SampleConfig
    from logitlab.train.config import TrainConfig

    examples = _doc_toml_examples()
    seen = set()
    for where, body in examples:
        path = tmp_path / "example.toml"
        path.write_text(body)
        table = read_toml(path)
        if "train" in table:
            assert build_config(TrainConfig, None, table["train"]).steps > 0, where
        if "model" in table or "preset" in table:
            cfg = _model_config(argparse.Namespace(preset=None), table, None)
            for key, value in table.get("model", {}).items():
                assert getattr(cfg, key) == value, (where, key)
        if "sample" in table:
            cfg = build_config(SampleConfig, None, table["sample"])
            assert all(getattr(cfg, k) == (tuple(v) if isinstance(v, list) else v)
                       for k, v in table["sample"].items()), where
        seen |= set(table) & {"train", "model", "sample"}
    missing = sorted({"train", "model", "sample"} - seen)
    assert not missing, f"the docs show no TOML example of the table(s) {missing}"


# -------------------- torchrun commands shown for a cluster, not run here

_SHELL_VALUE = re.compile(r"\$\{?\w+\}?")      # "$RUN", "${RUN}": a value the job script fills in
_SHELL_ARRAY = re.compile(r"\$\{\w+\[@\]\}")  # "${RESUME[@]}": zero or more arguments


def shown_torchrun_commands() -> list[tuple[str, list[str]]]:
    """(page:line, the arguments after `-m logitlab`) of every torchrun command in a block that is
    not run (a SLURM job script, say): continuation lines joined, a shell variable standing for one
    value replaced by "x", an array of arguments dropped. The runnable blocks' commands run."""
    import shlex

    found = []
    for page in pages():
        for info, line, code in fenced_blocks(page.read_text(encoding="utf-8")):
            if info in RUNNABLE:
                continue
            for command in code.replace("\\\n", " ").splitlines():
                if "torchrun" not in command or "-m logitlab" not in command:
                    continue
                words = shlex.split(command.split("#")[0])
                args = words[words.index("logitlab", words.index("-m")) + 1:]
                args = ["x" if _SHELL_VALUE.fullmatch(a) else a for a in args if not _SHELL_ARRAY.fullmatch(a)]
                found.append((f"{page.relative_to(ROOT)}:{line}", args))
    return found


def test_torchrun_commands_shown_but_not_run_use_flags_that_exist():
    """A job script that is only shown must still be one that runs: its flags parse (the SLURM
    script's --dist-timeout once named a flag that did not exist)."""
    from logitlab.cli.main import build_parser

    commands = shown_torchrun_commands()
    assert any("--dist-timeout" in args for _, args in commands), commands   # distributed.md's SLURM script
    for where, args in commands:
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `logitlab {' '.join(args)}` does not parse", pytrace=False)
