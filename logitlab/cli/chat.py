"""Subcommand `chat` (registered by main.py): an interactive prompt loop over a plain-text
transcript, or, when the tokenizer has a chat template (or ChatML's <|im_start|> / <|im_end|>
tokens, as after `logitlab sft`), over a list of messages rendered by that template. It reuses
generate.py's model loading, sampling flags and streaming of text.

The loop is a REPL: line editing and history with the arrow keys (Python's readline, loaded only
when stdin is a terminal), an opening line naming the commands (/reset, /help, Ctrl-D), the prompt
labelled "you> " and each reply "model: ". Ctrl-C at the prompt clears the line; Ctrl-C during a
reply stops that reply (the part already shown stays in the transcript); Ctrl-D leaves (exit 0)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from logitlab.cli.common import add_examples
from logitlab.cli.generate import (
    _decode_step,
    _inference_flags,
    _model_flags,
    _sample_flags,
    _timings,
    prepare,
    sample_config,
    stream_text,
)


def register(subparsers) -> None:
    """Add `chat` to `subparsers`."""
    c = subparsers.add_parser("chat", help="interactive prompt loop with history (Ctrl-D leaves)",
                              description="Each turn appends 'User: ...' and 'Assistant:' to a plain-text "
                              "transcript and continues it, stopping at the next 'User:'. The transcript is "
                              "cut from the left to fit the context. /reset clears it, /help lists the "
                              "commands, Ctrl-C stops a reply, Ctrl-D leaves. What you type is "
                              "plain text: special-token text such as <|endoftext|> stays text (--no-ordinary "
                              "turns it into the special token's id).")
    _model_flags(c)
    add_examples(c, "chat runs/a --temperature 0.7", "chat Qwen/Qwen3-0.6B --system \"Answer briefly.\"",
                 "chat runs/sft --max-new-tokens 128 --verbose")
    _sample_flags(c)
    _inference_flags(c)
    c.add_argument("--system", default="", help="text placed at the top of the transcript")
    c.add_argument("--ordinary", action=argparse.BooleanOptionalAction, default=True,
                   help="encode the transcript (your lines, --system, earlier replies) as plain text: "
                   "special-token text such as <|endoftext|> stays text (the default); --no-ordinary turns "
                   "it into the special token's id")
    c.set_defaults(func=_chat)


PROMPT = "you> "
REPLY_LABEL = "model: "
COMMANDS = ("/reset          clear the history (the transcript so far)",
            "/temperature T  sample the next replies at temperature T (0: greedy)",
            "/top-p P        keep the smallest set of top tokens whose mass reaches P (1: off)",
            "/show           print the exact text the model reads next (the template applied)",
            "/save FILE      write the conversation to FILE (a new file; JSON messages, or the transcript)",
            "/help           list these commands",
            "Ctrl-C          clear the line at the prompt; stop a reply while it is being written",
            "Ctrl-D          leave")
OPENING = "Chat with the model: type a message and press Enter. /reset clears the history, /help lists " \
          "the commands, Ctrl-D leaves."


def _line_editing() -> None:
    """Arrow-key editing and history for input(): importing readline is enough. Only for a terminal
    (a pipe or file has no keys to edit with), and only where the module exists (not on Windows)."""
    if not sys.stdin.isatty():
        return
    try:
        import readline  # noqa: F401  (importing it is what turns line editing on)
    except ImportError:
        pass


def _read_line() -> str | None:
    """The next line typed, or None at Ctrl-D / end of input. Ctrl-C discards the line and asks again."""
    while True:
        try:
            return input(PROMPT)
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:
            print()  # the typed line is dropped; a fresh prompt follows


def _write_reply(pieces) -> tuple[str, bool]:
    """Write the reply's pieces as they come, after the label. Returns (text shown, stopped): stopped
    is True when Ctrl-C ended the reply early. Any other failure ends the line first, so that the
    error message starts on a line of its own."""
    shown = []
    sys.stdout.write(REPLY_LABEL)
    sys.stdout.flush()
    try:
        for piece in pieces:
            shown.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write("\n[reply stopped]\n")
        sys.stdout.flush()
        return "".join(shown), True
    except BaseException:
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise
    return "".join(shown), False


@dataclasses.dataclass
class _Session:
    """What a chat keeps between turns: the sampling settings (which /temperature and /top-p
    change), the conversation (a transcript, or a messages list with a template) and how it is shown
    (/show) and saved (/save)."""

    cfg: object
    state: object
    start: object
    show: object            # state -> the exact text the model reads next
    save: object            # state -> (bytes to write, what they are)


def _chat(args) -> int:
    from logitlab.cli.common import console, error_console
    from logitlab.cli.models import load
    from logitlab.generate.loop import make_generator

    m = load(args)
    prepare(args, m, error_console())
    cfg = sample_config(args, m.end_ids[1:], m.generation)
    cfg = dataclasses.replace(cfg, stop_bytes=cfg.stop_bytes + (b"\nUser:",))
    generator = make_generator(cfg.seed)
    room = m.model.config.context_length - cfg.max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens ({cfg.max_new_tokens}) leaves no room in the context "
                         f"({m.model.config.context_length})")
    out = console()
    if _uses_template(m.tokenizer):
        return _chat_with_template(args, m, cfg, generator, room, out)
    start = (args.system.strip() + "\n") if args.system.strip() else ""
    session = _Session(cfg, start, start, show=lambda history: history,
                       save=lambda history: (history.encode(), "the transcript"))
    return _repl(session, lambda history, line: _turn(args, m, session.cfg, generator, room, out,
                                                      history + f"User: {line}\nAssistant:"))


def _repl(session: _Session, turn) -> int:
    """The loop both chat forms share: read a line, handle the /commands and empty lines, else
    session.state = turn(state, line). Ctrl-C outside the reply itself (encoding, timings) drops the
    turn; Ctrl-D leaves with 0."""
    _line_editing()
    print(OPENING)
    while True:
        line = _read_line()
        if line is None:
            return 0
        command = line.strip()
        if command.startswith("/"):
            _command(session, command)
        elif command:
            try:
                session.state = turn(session.state, line)
            except KeyboardInterrupt:
                print("\n[reply stopped]")


def _command(session: _Session, command: str) -> None:
    """One /command of the REPL; a mistake is one line and the chat goes on."""
    name, _, rest = command.partition(" ")
    rest = rest.strip()
    try:
        if name == "/reset":
            session.state = session.start
            print("history cleared")
        elif name == "/help":
            print("\n".join(COMMANDS))
        elif name in ("/temperature", "/top-p") and rest:
            field = "temperature" if name == "/temperature" else "top_p"
            try:
                value = float(rest)
            except ValueError:
                raise ValueError(f"{name} needs a number, got {rest!r}") from None
            session.cfg = dataclasses.replace(session.cfg, **{field: value})   # SampleConfig checks its range
            print(f"{field} = {getattr(session.cfg, field)}")
        elif name == "/show":
            text = session.show(session.state)
            print(text, end="" if text.endswith("\n") else "\n")
        elif name == "/save" and rest:
            from pathlib import Path

            from logitlab.io.files import atomic_write_bytes

            data, what = session.save(session.state)
            if Path(rest).exists():
                raise ValueError(f"{rest} exists; /save writes a new file (nothing is overwritten)")
            atomic_write_bytes(rest, data)
            print(f"saved {what} to {rest}")
        else:
            print(f"unknown command {command!r} (or its value is missing); /help lists the commands")
    except ValueError as exc:
        print(f"error: {exc}")


def _turn(args, m, cfg, generator, room, out, history: str) -> str:
    """One reply to the transcript `history`, written as it comes; returns the transcript with it."""
    from logitlab.generate.loop import stream

    ids = m.tokenizer.encode(history, allowed_special="none" if args.ordinary else "all", add_bos=True)[-room:]
    s = stream(m.model, ids, cfg, eot_id=m.eot_id, token_bytes=m.tokenizer.token_bytes,
               generator=generator, step=_decode_step(args, m.model))
    reply, stopped = _write_reply(stream_text(m.tokenizer, s, cfg.stop_ids + m.end_ids, cfg.stop_bytes))
    history += reply.rstrip() + "\n"
    if not stopped:
        try:
            _timings(out, s.result)
        except KeyboardInterrupt:
            print()
    return history


# --------------------------------------------------------------------------------------------
# a tokenizer with a chat template (or ChatML's markers): messages, not a transcript
# --------------------------------------------------------------------------------------------

def _uses_template(tok) -> bool:
    return getattr(tok, "chat_template", None) is not None or {"<|im_start|>", "<|im_end|>"} <= set(tok.special_tokens)


def _chat_with_template(args, m, cfg, generator, room, out) -> int:
    """The loop over a messages list rendered by the tokenizer's chat template; each reply stops at
    the end-of-turn token, and the oldest turns are dropped (and said to be) when the context is full."""
    import json

    from logitlab.tokenizer.chat import end_of_turn_id

    end = end_of_turn_id(m.tokenizer)
    cfg = dataclasses.replace(cfg, stop_ids=tuple(cfg.stop_ids) + ((end,) if end is not None else ()),
                              stop_bytes=tuple(b for b in cfg.stop_bytes if b != b"\nUser:"))
    start = [{"role": "system", "content": args.system.strip()}] if args.system.strip() else []
    session = _Session(cfg, start, start,
                       show=lambda messages: m.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                             tokenize=False),
                       save=lambda messages: ((json.dumps({"messages": messages}, ensure_ascii=False) + "\n").encode(),
                                              "the messages (one JSON line, as sft reads)"))
    return _repl(session, lambda messages, line: _template_turn(
        args, m, session.cfg, generator, room, out, messages + [{"role": "user", "content": line}]))


def _template_turn(args, m, cfg, generator, room, out, messages: list) -> list:
    from logitlab.generate.loop import stream
    from logitlab.tokenizer.chat import fit_history

    ids, dropped = fit_history(m.tokenizer, messages, room)
    if dropped:
        print(f"[{dropped} earliest message(s) left out to fit the context]")
    s = stream(m.model, ids, cfg, eot_id=m.eot_id, token_bytes=m.tokenizer.token_bytes,
               generator=generator, step=_decode_step(args, m.model))
    reply, stopped = _write_reply(stream_text(m.tokenizer, s, cfg.stop_ids + m.end_ids, cfg.stop_bytes))
    if not stopped:
        try:
            _timings(out, s.result)
        except KeyboardInterrupt:
            print()
    return messages + [{"role": "assistant", "content": reply.strip()}]
