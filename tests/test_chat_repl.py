"""`logitlab chat` in a real terminal (tmux): arrow-key editing and history, the opening line,
/help and /reset, Ctrl-C at the prompt and during a reply, Ctrl-D leaving with exit code 0.

Each test runs `python3 -m logitlab chat` on a tiny random model in a detached tmux session on a
private socket, types with `send-keys` and reads the screen with `capture-pane`, polling until the
expected text appears (no fixed sleeps)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed: the chat REPL is tested in a real terminal")

DEADLINE = 60.0  # seconds to wait for any one expected screen (importing torch can be slow)
MERGES = [(b"t", b"h"), (b"th", b"e"), (b" ", b"c"), (b" c", b"a"), (b" ca", b"t"), (b"e", b"l")]
REPO = Path(__file__).resolve().parents[1]


def _model_dir(tmp_path: Path, context_length: int) -> tuple[Path, list[int]]:
    """A tiny random model with its tokenizer beside it; returns it and the ids to ban so that only
    printable ASCII (and the printable merges) can be written to the terminal."""
    from logitlab.io.model_dir import TOKENIZER_FILE, save_model
    from logitlab.model.transformer import ModelConfig, Transformer
    from logitlab.tokenizer.core import Tokenizer

    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in MERGES:
        vocab[len(vocab)] = a + b
    tok = Tokenizer(vocab, MERGES, special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=context_length, d_model=32,
                                    n_layers=1, n_heads=2, positions="rope"))
    d = tmp_path / "model"
    save_model(model, d)
    tok.save(d / TOKENIZER_FILE)
    banned = [i for i in range(256) if i < 32 or i >= 127]
    return d, banned


class Terminal:
    """One chat process in a 120x40 tmux pane on a private server, kept after it exits."""

    def __init__(self, argv: list[str], tmp_path: Path):
        self.socket = f"logitlab-chat-{uuid.uuid4().hex[:12]}"
        conf = tmp_path / "tmux.conf"
        conf.write_text("set -g remain-on-exit on\nset -g history-limit 50000\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        env.pop("TMUX", None)
        chat = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "logitlab", "chat"] + argv)
        # bash reports the exit code on screen (tmux's pane_dead_status can be empty); a bash that is
        # waiting for its child goes on after a SIGINT that the child survives
        command = "bash -c " + shlex.quote(chat + "; echo chat exited with status $?")
        self._tmux("-f", str(conf), "new-session", "-d", "-s", "chat", "-x", "120", "-y", "40",
                   "-c", str(REPO), command, env=env)

    def _tmux(self, *args: str, env=None) -> str:
        r = subprocess.run(["tmux", "-L", self.socket] + list(args), capture_output=True, text=True,
                           timeout=30, env=env)
        assert r.returncode == 0, f"tmux {' '.join(args)} failed: {r.stderr}"
        return r.stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "chat", *keys)

    def type(self, text: str) -> None:
        self._tmux("send-keys", "-t", "chat", "-l", text)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def wait(self, check, what: str) -> str:
        """Poll the screen until check(screen) is true; fail naming `what` and showing the screen."""
        end = time.monotonic() + DEADLINE
        while True:
            text = self.screen()
            if check(text):
                return text
            if time.monotonic() > end:
                pytest.fail(f"timed out after {DEADLINE:.0f} s waiting for {what}; the screen:\n{text}")
            time.sleep(0.1)

    def wait_prompts(self, n: int) -> str:
        """Wait until the n-th "you>" prompt is on screen (capture-pane trims trailing spaces)."""
        return self.wait(lambda t: prompts(t) >= n, f"prompt number {n}")

    def leave(self) -> str:
        """Press Ctrl-D and wait for the chat process to exit; returns its exit code (or "signal N").
        A Ctrl-D that reaches the terminal just before readline switches it out of canonical mode is
        dropped by the kernel's line discipline (it is not a character in the queue), so it is pressed
        again every few seconds until the process exits."""
        end = time.monotonic() + DEADLINE
        pressed = 0.0
        while True:
            found = re.search(r"chat exited with status (\d+)", self.screen())
            if found:
                return found.group(1)
            if time.monotonic() > end:
                pytest.fail(f"chat did not exit within {DEADLINE:.0f} s; the screen:\n{self.screen()}")
            if time.monotonic() - pressed > 3:
                self.keys("C-d")
                pressed = time.monotonic()
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def prompts(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith("you>"))


def lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


@pytest.fixture
def terminal(tmp_path):
    made = []

    def start(argv):
        t = Terminal(argv, tmp_path)
        made.append(t)
        return t

    yield start
    for t in made:
        t.close()


def test_chat_repl_editing_history_commands_and_keys(tmp_path, terminal):
    d, banned = _model_dir(tmp_path, context_length=128)
    t = terminal([str(d), "--max-new-tokens", "8", "--seed", "0",
                  "--banned-ids", ",".join(str(i) for i in banned)])
    first = t.wait_prompts(1)
    # the opening line names the commands
    assert "/reset" in first and "/help" in first and "Ctrl-D" in first
    # Left arrow edits the line: "helo", Left, "l" -> "hello" (not "helo^[[Dl")
    t.type("helo")
    t.keys("Left")
    t.type("l")
    t.keys("Enter")
    screen = t.wait_prompts(2)
    assert "you> hello" in lines(screen, "you>"), screen
    assert "^[[" not in screen
    assert len(lines(screen, "model:")) == 1 and "tok/s" in screen  # the reply is labelled
    # Up brings back the last line
    t.keys("Up")
    t.wait(lambda s: lines(s, "you>")[-1:] == ["you> hello"] and lines(s, "you>").count("you> hello") == 2,
           "the recalled line")
    t.keys("Enter")
    screen = t.wait_prompts(3)
    assert lines(screen, "you>").count("you> hello") == 2 and len(lines(screen, "model:")) == 2, screen
    # Ctrl-C at the prompt drops the typed line; the REPL goes on with a fresh prompt
    t.type("abc")
    t.wait(lambda s: lines(s, "you>")[-1:] == ["you> abc"], "the typed text")
    t.keys("C-c")
    t.wait_prompts(4)
    t.type("xyz")
    t.keys("Enter")
    screen = t.wait_prompts(5)
    assert "you> xyz" in lines(screen, "you>") and not any("abcxyz" in line for line in screen.splitlines())
    assert len(lines(screen, "model:")) == 3
    # /help prints the commands and is not sent to the model
    t.type("/help")
    t.keys("Enter")
    screen = t.wait_prompts(6)
    assert len(lines(screen, "model:")) == 3, screen
    assert any(line.startswith("/reset") for line in screen.splitlines())
    # /reset confirms
    t.type("/reset")
    t.keys("Enter")
    screen = t.wait_prompts(7)
    assert "history cleared" in screen and len(lines(screen, "model:")) == 3
    # Ctrl-D leaves with exit code 0
    assert t.leave() == "0", t.screen()


def test_chat_repl_ctrl_c_stops_a_reply_and_the_repl_goes_on(tmp_path, terminal):
    # a reply long enough (100k tokens, end-of-text banned too) that it can only end by Ctrl-C
    d, banned = _model_dir(tmp_path, context_length=100_100)
    t = terminal([str(d), "--max-new-tokens", "100000", "--seed", "0",
                  "--banned-ids", ",".join(str(i) for i in banned + [256 + len(MERGES)])])
    t.wait_prompts(1)
    t.type("tell me everything")
    t.keys("Enter")
    t.wait(lambda s: any(len(line) > 20 for line in lines(s, "model:")), "the reply to start")
    t.keys("C-c")
    screen = t.wait_prompts(2)
    assert "[reply stopped]" in screen and "stop: max_new_tokens" not in screen, screen
    t.type("/help")  # the REPL goes on: the next line is read and answered
    t.keys("Enter")
    screen = t.wait_prompts(3)
    assert any(line.startswith("/reset") for line in screen.splitlines()), screen
    assert t.leave() == "0", t.screen()
