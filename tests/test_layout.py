"""The package's shape: one sub-package per stage, imports that run one way (module-level and
lazy ones alike, read from the source), no cycles, and modules and functions short enough to
read. docs/design.md explains the rules; this file is their check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "logitlab"

# stage -> the stages it may import (besides itself). cli may import anything.
ALLOWED = {
    "tokenizer": set(),
    "model": set(),
    "kernels": {"model"},
    "quant": {"model"},
    "io": {"model", "tokenizer", "quant"},                  # reading quantized model directories
    "data": {"io"},
    "parallel": {"model"},
    "generate": {"model", "tokenizer"},
    "inspect": {"model", "tokenizer", "generate"},   # generate.sampling: what the sampler draws from
    "train": {"model", "data", "io", "parallel", "kernels"},
    "eval": {"model", "tokenizer", "generate"},
    "serve": None,
    "cli": None,
}
# Modules that import nothing of logitlab, which any stage may use: the file primitives (atomic
# writes, locks) that the tokenizer's and the data's writers share with io, and the packages' lazy
# public names.
LEAVES = {"logitlab.io.files", "logitlab._exports"}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """'logitlab.model.config' -> path, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path) -> set[str]:
    """Every logitlab module `name` imports, at module level or inside a function."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("logitlab")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("logitlab"):
                continue
            found.add(base)
            for alias in node.names:  # `from logitlab.model import layers` imports a module
                if f"{base}.{alias.name}" in modules():
                    found.add(f"{base}.{alias.name}")
    # importing logitlab.a.b runs logitlab.a's __init__ first; a module's own packages are
    # already being initialised when it runs, so those edges are not imports of its own
    own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 1)}
    for target in list(found):
        parts = target.split(".")
        found |= {".".join(parts[:k]) for k in range(2, len(parts))}
    return {t for t in found if t != name and t not in own}


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_stage_is_a_package_and_top_level_modules_are_few():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    # _exports: the lazy-name hooks every package's __init__ shares (a leaf, see LEAVES)
    assert top == ["__init__", "__main__", "_exports"], f"modules outside a stage's package: {top}"
    for name in ALLOWED:
        assert (PACKAGE / name / "__init__.py").is_file(), name


def test_imports_run_one_way():
    bad = []
    for name, path in modules().items():
        here = stage(name)
        if here is None or ALLOWED.get(here) is None:
            continue
        for target in imports_of(name, path):
            if target in LEAVES or any(target == leaf.rpartition(".")[0] for leaf in LEAVES):
                continue
            there = stage(target)
            if there is None:
                bad.append(f"{name} imports the top-level package {target}")
            elif there != here and there not in ALLOWED[here]:
                bad.append(f"{name} ({here}) imports {target} ({there})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {name: imports_of(name, path) for name, path in modules().items()}
    # a package's __init__ re-exports its own modules; edges into a package from its own modules
    # are the cycles that matter, so a sibling must import a sibling, not its package
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_modules_and_functions_are_short():
    long_modules, long_functions = [], []
    for name, path in modules().items():
        source = path.read_text()
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {lines} lines")
        if name.startswith("logitlab.cli"):
            continue  # argument tables aside
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {length} lines")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def test_library_code_never_prints():
    offenders = []
    for name, path in modules().items():
        if name.startswith("logitlab.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{name}:{node.lineno}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if mod and mod.split(".")[0] == "rich":
                    offenders.append(f"{name}:{node.lineno} imports rich")
    assert not offenders, offenders
