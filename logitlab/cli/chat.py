"""Subcommand `chat` (registered by main.py): an interactive prompt loop over a plain-text
transcript. It reuses generate.py's model loading, sampling flags and streaming of text."""

from __future__ import annotations

import argparse
import dataclasses

from logitlab.cli.generate import (
    _decode_step,
    _model_flags,
    _sample_flags,
    _timings,
    _write_pieces,
    load,
    sample_config,
    stream_text,
)


def register(subparsers) -> None:
    """Add `chat` to `subparsers`."""
    c = subparsers.add_parser("chat", help="interactive prompt loop with history (Ctrl-D leaves)",
                              description="Each turn appends 'User: ...' and 'Assistant:' to a plain-text "
                              "transcript and continues it, stopping at the next 'User:'. The transcript is "
                              "cut from the left to fit the context. /reset clears it; Ctrl-D leaves. What you type is "
                              "plain text: special-token text such as <|endoftext|> stays text (--no-ordinary "
                              "turns it into the special token's id).")
    _model_flags(c)
    _sample_flags(c)
    c.add_argument("--system", default="", help="text placed at the top of the transcript")
    c.add_argument("--ordinary", action=argparse.BooleanOptionalAction, default=True,
                   help="encode the transcript (your lines, --system, earlier replies) as plain text: "
                   "special-token text such as <|endoftext|> stays text (the default); --no-ordinary turns "
                   "it into the special token's id")
    c.set_defaults(func=_chat)


def _chat(args) -> int:
    from logitlab.cli.common import console
    from logitlab.generate.loop import make_generator, stream

    m = load(args)
    cfg = sample_config(args, m.end_ids[1:])
    cfg = dataclasses.replace(cfg, stop_bytes=cfg.stop_bytes + (b"\nUser:",))
    generator = make_generator(cfg.seed)
    room = m.model.config.context_length - cfg.max_new_tokens
    if room < 1:
        raise ValueError(f"max_new_tokens ({cfg.max_new_tokens}) leaves no room in the context "
                         f"({m.model.config.context_length})")
    out = console()
    history = (args.system.strip() + "\n") if args.system.strip() else ""
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/reset":
            history = (args.system.strip() + "\n") if args.system.strip() else ""
            continue
        if not line.strip():
            continue
        history += f"User: {line}\nAssistant:"
        ids = m.tokenizer.encode(history, allowed_special="none" if args.ordinary else "all")[-room:]
        s = stream(m.model, ids, cfg, eot_id=m.eot_id, token_bytes=m.tokenizer.token_bytes,
                   generator=generator, step=_decode_step(args, m.model))
        reply = _write_pieces(stream_text(m.tokenizer, s, cfg.stop_ids + m.end_ids, cfg.stop_bytes), True)
        history += reply.rstrip() + "\n"
        _timings(out, s.result)
