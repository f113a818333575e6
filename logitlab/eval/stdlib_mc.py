"""A multiple-choice evaluation that needs no download: the real next line of a function among four.

Questions come from the Python standard library's own source, which every Python install carries:
a function's first lines are the context, and the choices are its real next line and three lines
taken from other functions, re-indented to the real line's indentation (so indentation alone does
not give the answer away). The model picks the choice with the highest log-probability.

Accuracy is reported centred, as in the CORE metric (DCLM, Li et al. 2024): (accuracy - 1/k) /
(1 - 1/k) for k choices, so guessing scores 0 and a perfect model 1. This tracks a small model's
progress during training; the demo model trains on this same source, so it is not a benchmark of
record. The questions depend on the seed and on the Python version's standard library.

stdlib_mc.py owns building the questions (`stdlib_next_line_tasks`, from any Python files) and
scoring them (`evaluate_mc`, through scoring.score_ids).
"""

from __future__ import annotations

import ast
import os
import random
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from logitlab.eval.scoring import encode_pair, score_ids

CONTEXT_LINES = 16  # at most this many lines of the function before the line to guess
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}


@dataclass(frozen=True)
class MCTask:
    """context, the choices (each a line ending in a newline) and the index of the right one; source
    names the file and line the question comes from."""

    context: str
    choices: tuple[str, ...]
    answer: int
    source: str = ""


@lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)  # pruned: site-packages is most of the tree
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return tuple(sorted(found))


def stdlib_files() -> list[Path]:
    """The standard library's .py files (without its tests and installed packages), sorted."""
    return list(_stdlib_files())


def _function_lines(source: str) -> list[tuple[int, list[tuple[str, bool]]]]:
    """(first line number, lines) of every function (def line included) of a module, outermost first, each
    with whether it may be asked for or used as a distractor: not inside a docstring or other
    string statement, and `_guessable`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    strings = {n for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
               and isinstance(node.value.value, str) for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
    lines = source.splitlines()
    return [(node.lineno, [(lines[n - 1], n not in strings and _guessable(lines[n - 1]))
                           for n in range(node.lineno, node.end_lineno + 1)]) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno]


def _guessable(line: str) -> bool:
    """A line worth asking for: code with some content, not a comment or a lone bracket."""
    text = line.strip()
    return len(text) >= 8 and not text.startswith(("#", ")", "]", "}")) and text.isascii()


def _question(function: list[tuple[str, bool]], pool: list[str], rng: random.Random, where: str,
              first_line: int) -> MCTask | None:
    """One question from one function: a line after the def, and three re-indented others from pool."""
    candidates = [k for k in range(1, len(function)) if function[k][1]]
    if not candidates:
        return None
    k = rng.choice(candidates)
    answer = function[k][0].rstrip()
    indent = answer[:len(answer) - len(answer.lstrip())]
    others = sorted({indent + line.strip() for line in pool} - {answer})
    if len(others) < 3:
        return None
    choices = [answer] + rng.sample(others, 3)
    rng.shuffle(choices)
    context = "\n".join(line for line, _ in function[max(0, k - CONTEXT_LINES):k]) + "\n"
    return MCTask(context, tuple(c + "\n" for c in choices), choices.index(answer), f"{where}:{first_line + k}")


def stdlib_next_line_tasks(n: int = 200, seed: int = 0, files: Sequence[str | Path] | None = None,
                           per_file: int = 2) -> list[MCTask]:
    """n questions (fewer only when `files` run out), from `files` (default: stdlib_files()) visited
    in a seeded random order, at most per_file questions from each file."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (how many questions) must be an integer >= 1, got {n!r}")
    rng = random.Random(seed)
    paths = list(stdlib_files() if files is None else map(Path, files))
    rng.shuffle(paths)
    tasks: list[MCTask] = []
    for path in paths:
        try:
            functions = _function_lines(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        functions = [f for f in functions if len(f[1]) >= 3]
        if len(functions) < 2:
            continue
        for f in rng.sample(range(len(functions)), min(per_file, len(functions))):
            pool = [line for g, (_, lines) in enumerate(functions) if g != f for line, ok in lines[1:] if ok]
            task = _question(functions[f][1], pool, rng, path.name, functions[f][0])
            if task is not None:
                tasks.append(task)
            if len(tasks) == n:
                return tasks
    return tasks


@dataclass(frozen=True)
class MCResult:
    """accuracy: the highest summed log-probability picks; accuracy_norm: per byte of the choice
    (lm-evaluation-harness's acc_norm); centred_accuracy: (accuracy - 1/k) / (1 - 1/k)."""

    examples: int
    choices: int
    accuracy: float
    accuracy_norm: float
    predictions: tuple[int, ...]

    @property
    def centred_accuracy(self) -> float:
        chance = 1 / self.choices
        return (self.accuracy - chance) / (1 - chance)


def evaluate_mc(model, tokenizer, tasks: Sequence[MCTask], batch_size: int = 16) -> MCResult:
    """Score every choice of every task after its context; all tasks need the same number of choices."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    k = len(tasks[0].choices)
    if k < 2 or any(len(t.choices) != k for t in tasks):
        raise ValueError(f"every task needs the same number (>= 2) of choices; the first has {k}")
    pairs = [encode_pair(tokenizer, t.context, c) for t in tasks for c in t.choices]
    scores = score_ids(model, pairs, batch_size)
    right = right_norm = 0
    predictions = []
    for i, task in enumerate(tasks):
        row = scores[i * k:(i + 1) * k]
        raw = [s.logprob for s in row]
        norm = [s.logprob / len(c.encode()) for s, c in zip(row, task.choices)]
        pick = max(range(k), key=raw.__getitem__)
        predictions.append(pick)
        right += pick == task.answer
        right_norm += max(range(k), key=norm.__getitem__) == task.answer
    return MCResult(len(tasks), k, right / len(tasks), right_norm / len(tasks), tuple(predictions))
