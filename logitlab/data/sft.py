"""Conversations for supervised fine-tuning: reading them, masking the loss, packing or padding
them into rows, and the batches the SFT loop draws.

sft.py owns the data side of SFT. It reads `.jsonl` files whose lines are either
{"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "completion": ...} (a user
turn and an assistant turn, with an optional "system"). It never sees text being rendered: the
tokenizer (passed in, duck-typed: its `chat_turns(messages)` gives (role, ids) pieces, see
logitlab.tokenizer.chat) turns a conversation into ids.

Loss mask (`train_on`): "assistant" (default) trains on every assistant piece, its content and
its end-of-turn token, and on nothing the user, the system or the generation prompt wrote;
"last" only on the last assistant piece; "all" on every token. A target is trained when the
token it predicts is.

Rows. With packing, several conversations share one row of T tokens; each token carries its
conversation's number (`segments`) and its position inside that conversation, so attention stays
inside each conversation (train/sft.py builds the block-diagonal causal mask) and positions restart
at 0. Without packing each row holds one conversation, padded. Padding has segment -1, target
IGNORE_INDEX and id 0. A conversation longer than T is cut to its first T + 1 tokens (counted in
the report), and one with no trained target left is dropped (its loss would be 0/0).

Shapes: B rows per batch, T tokens per row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

IGNORE_INDEX = -100  # the loss's ignored target (train.loss.IGNORE_INDEX)
TRAIN_ON = ("all", "assistant", "last")
TrainOn = Literal["all", "assistant", "last"]


def _conversation(record, where: str) -> list[dict]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'messages' or 'prompt'/'completion'")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["completion"]}]
        if "system" in record:
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise ValueError(f"{where}: needs a 'messages' list or 'prompt' and 'completion' fields, "
                         f"got keys {sorted(record)}")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {n} needs string 'role' and 'content', got {m!r:.80}")
        if not m["role"].strip():
            raise ValueError(f"{where}: message {n} has an empty 'role' (user, assistant, system, ...)")
    return messages


def read_conversations(path: str | os.PathLike) -> list[list[dict]]:
    """Every conversation of a .jsonl file (blank lines skipped); ValueError naming file:line (a line
    that is not UTF-8 or not JSON, a record without messages, a message without a role)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file not found: {path}")
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{n}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                 f"SFT data must be UTF-8 text") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg}, column {exc.colno})") from None
            out.append(_conversation(record, f"{path}:{n}"))
    if not out:
        raise ValueError(f"{path}: holds no conversations")
    return out


def mask_turns(turns: list[tuple[str, list[int]]], train_on: TrainOn = "assistant") -> tuple[list[int], list[bool]]:
    """(role, ids) pieces -> (ids, trained): trained[t] says whether token t is a loss target."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    assistant = [i for i, (role, _) in enumerate(turns) if role == "assistant"]
    ids, trained = [], []
    for i, (role, piece) in enumerate(turns):
        if train_on == "all":
            on = True
        elif train_on == "assistant":
            on = i in assistant
        else:
            on = bool(assistant) and i == assistant[-1]
        ids.extend(piece)
        trained.extend([on] * len(piece))
    return ids, trained


def encode_conversation(tokenizer, messages, train_on: TrainOn = "assistant") -> tuple[list[int], list[int]]:
    """-> (inputs, targets), one shorter than the conversation: targets[t] = ids[t + 1] when that
    token is trained, else IGNORE_INDEX."""
    ids, trained = mask_turns(tokenizer.chat_turns(messages), train_on)
    targets = [i if on else IGNORE_INDEX for i, on in zip(ids[1:], trained[1:])]
    return ids[:-1], targets


@dataclass
class Rows:
    """Rows of T tokens: ids, targets, segments (conversation number, -1 padding) and positions
    inside the conversation, each (N, T) int64; and what building them dropped or cut."""

    ids: torch.Tensor
    targets: torch.Tensor
    segments: torch.Tensor
    positions: torch.Tensor
    truncated: int = 0
    dropped: int = 0

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def trained_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def build_rows(examples: list[tuple[list[int], list[int]]], seq_len: int, pack: bool = True) -> Rows:
    """(inputs, targets) per conversation -> Rows of seq_len tokens: packed greedily in the given
    order (a conversation never splits across rows) or one per row."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    rows: list[list[tuple[list[int], list[int]]]] = []
    truncated = dropped = 0
    used = seq_len  # forces a first row
    for x, y in examples:
        if len(x) > seq_len:
            x, y, truncated = x[:seq_len], y[:seq_len], truncated + 1
        if not x or all(t == IGNORE_INDEX for t in y):
            dropped += 1
            continue
        if not pack or used + len(x) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((x, y))
        used += len(x)
    N = len(rows)
    ids = torch.zeros(N, seq_len, dtype=torch.long)
    targets = torch.full((N, seq_len), IGNORE_INDEX, dtype=torch.long)
    segments = torch.full((N, seq_len), -1, dtype=torch.long)
    positions = torch.zeros(N, seq_len, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for s, (x, y) in enumerate(row):
            n = len(x)
            ids[r, at:at + n], targets[r, at:at + n] = torch.tensor(x), torch.tensor(y)
            segments[r, at:at + n], positions[r, at:at + n] = s, torch.arange(n)
            at += n
    return Rows(ids, targets, segments, positions, truncated, dropped)


@dataclass
class PackedInputs:
    """A batch's inputs: ids, segments, positions (B, T). `.to(device)` as a tensor's, so the
    training step moves it like one."""

    ids: torch.Tensor
    segments: torch.Tensor
    positions: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> PackedInputs:
        moved = (t.to(device, non_blocking=non_blocking) for t in (self.ids, self.segments, self.positions))
        return PackedInputs(*moved)


class RowBatches:
    """Shuffled batches of rows, epoch after epoch: next() -> (PackedInputs, targets (B, T)).

    The order of epoch e is a permutation drawn from a generator seeded with seed + e, so the state
    (epoch, index) is all a checkpoint needs for an exact resume. rank/world_size take a slice."""

    def __init__(self, rows: Rows, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if len(rows) == 0:
            raise ValueError("no SFT rows to train on (every conversation was dropped)")
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by world_size ({world_size})")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.index = 0, 0

    def _order(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.rows), generator=gen)

    def next(self) -> tuple[PackedInputs, torch.Tensor]:
        order, picked = self._order(), []
        while len(picked) < self.batch_size:
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order()
            picked.append(int(order[self.index]))
            self.index += 1
        per = self.batch_size // self.world_size
        take = torch.tensor(picked[self.rank * per:(self.rank + 1) * per])
        r = self.rows
        return PackedInputs(r.ids[take], r.segments[take], r.positions[take]), r.targets[take]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


STDLIB_MODULES = ("builtins", "math", "os.path", "json", "string", "textwrap", "itertools", "functools",
                  "collections", "re", "shutil", "random", "statistics", "heapq", "bisect", "operator")


def stdlib_conversations(modules=STDLIB_MODULES, limit: int | None = None) -> list[list[dict]]:
    """A small instruction set from the running Python's own standard library, no download:
    "What does json.dumps do?" answered with the first line of its docstring, one conversation per
    public function or class that has one (sorted by name, so the set is the same on every run)."""
    import importlib
    import inspect

    out = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        prefix = "" if module_name == "builtins" else module_name + "."
        for name in sorted(dir(module)):
            obj = getattr(module, name, None)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            if not first or len(first) > 200 or first.startswith(name + "("):
                continue
            out.append([{"role": "user", "content": f"What does {prefix}{name} do?"},
                        {"role": "assistant", "content": first}])
    return out[:limit] if limit is not None else out


def write_conversations(conversations: list[list[dict]], path: str | os.PathLike) -> Path:
    """One {"messages": [...]} line per conversation, written atomically."""
    from logitlab.io.files import atomic_write_text

    lines = "".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in conversations)
    return atomic_write_text(path, lines)
