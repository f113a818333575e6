"""Subcommand `generate` (registered by main.py): text in, text out.

Loads a model with its tokenizer (--checkpoint DIR or --hf DIR; `inspect` and `chat` load the same
way), streams generated text as soon as it is valid UTF-8, holding back a possible stop-string
start, and prints the timings on stderr or, with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

# SampleConfig fields with no flag of their own: --stop and --logit-bias fill them from text.
# --stop-ids and --banned-ids have flags of their own: a list flag with nargs would swallow the
# positional prompt that follows it, so they take comma-separated ids and repeat instead.
_SKIP = ("logit_bias", "stop_sequences", "stop_bytes", "stop_ids", "banned_ids")
_ID_LISTS = {"stop_ids": "stop_id_lists", "banned_ids": "banned_id_lists"}  # field -> argparse dest


def register(subparsers) -> None:
    """Add `generate` to `subparsers` (`inspect` is inspect.py's, `chat` chat.py's)."""
    from logitlab.cli.common import add_examples
    g = subparsers.add_parser("generate", help="continue a prompt, streaming the text",
                              description="Continue PROMPT with a model, printing text as it is generated, "
                              "then (on stderr, so `> out.txt` holds only the text) the prompt's token count, the "
                              "prefill time, decode tokens/s and why generation stopped. Special-token "
                              "text in PROMPT such as <|endoftext|> becomes its id; --ordinary keeps it as text. "
                              "\\n and \\t in PROMPT and --stop are a newline and a tab (\\\\ is a backslash).")
    _model_flags(g)
    g.add_argument("prompt", help="the text to continue (empty: start from the end-of-text token); "
                   "\\n and \\t are a newline and a tab, as in --stop; special-token text in it such as "
                   "<|endoftext|> becomes its id unless --ordinary is given")
    g.add_argument("--ordinary", action="store_true", help="encode PROMPT as plain text: special-token text "
                   "such as <|endoftext|> stays text (default: it becomes the special token's id)")
    _sample_flags(g)
    _inference_flags(g, draft=True)
    g.add_argument("--compare-plain", action="store_true", help="with --draft: also generate without it, and report "
                   "the speed-up (and, greedy, whether the text is the same)")
    add_examples(g, 'generate runs/a "def parse(" --max-new-tokens 48 --temperature 0.8',
                 'generate Qwen/Qwen3-0.6B "The capital of France is" --temperature 0 --verbose',
                 'generate runs/a "" --num-samples 3 --seed 0            # three unconditional samples',
                 'generate runs/a "import os" --stop "\\n\\n" --json',
                 'generate runs/a "def parse(" --quantize int8 --dtype bf16 --draft ngram --draft-k 4')
    g.add_argument("--json", action="store_true",
                   help="print one JSON object at the end instead of streaming (one line per sample)")
    g.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="generate N continuations of PROMPT, one after another (with --seed S, sample i draws "
                   "from seed S + i; default 1)")
    g.set_defaults(func=_generate)


def _number(kind: type, rule: str, ok):
    """An argparse type: `kind` (int or float) that is finite and passes `ok`; argparse names the flag in the
    error ("argument --rows: must be an integer >= 1, got -1")."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _id_list(text: str) -> tuple[int, ...]:
    """An argparse type for --stop-ids and --banned-ids: "10" or "10,13" -> (10, 13)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"must be token ids separated by commas, got {text!r}")
    return tuple(map(int, parts))


def _model_flags(p) -> None:
    """MODEL (any kind, cli/models.py), --revision, --dtype, --debug."""
    from logitlab.cli.models import add_model_argument

    add_model_argument(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _inference_flags(p, draft: bool = False) -> None:
    from logitlab.cli.models import add_inference_flags

    add_inference_flags(p, draft=draft)


def prepare(args, m, err) -> object:
    """--quantize (and the quantized kernels) on the loaded model, said on stderr; -> the --draft
    drafter or None."""
    from logitlab.cli.models import load_draft, prepare_model

    for line in prepare_model(args, m.model):
        err.print(line, style="dim", markup=False, highlight=False, soft_wrap=True)
    draft = load_draft(args, m.model)
    if draft is not None and getattr(args, "compile", False):
        raise ValueError("--compile compiles the one-token decode step, which --draft does not use: give one of them")
    return draft


def _sample_flags(p) -> None:
    from logitlab.cli.common import add_config_flags
    from logitlab.generate.config import SampleConfig

    add_config_flags(p, SampleConfig, skip=_SKIP)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the generated text contains TEXT (repeatable; \\n and \\t are escapes, "
                   "\\\\ a backslash)")
    p.add_argument("--stop-ids", action="append", default=[], type=_id_list, dest="stop_id_lists",
                   metavar="ID[,ID...]",
                   help="token ids that end generation besides end-of-text: comma-separated, repeatable "
                   "(--stop-ids 10,13 or --stop-ids 10 --stop-ids 13); replaces [sample] stop_ids of --config")
    p.add_argument("--banned-ids", action="append", default=[], type=_id_list, dest="banned_id_lists",
                   metavar="ID[,ID...]", help="token ids that are never generated: comma-separated, repeatable "
                   "(--banned-ids 10,13 or --banned-ids 10 --banned-ids 13); replaces [sample] banned_ids of "
                   "--config (default: none)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    p.add_argument("--config", metavar="FILE", help="TOML file; its [sample] table sets SampleConfig fields")
    p.add_argument("--verbose", action="store_true", help="print each sampling setting and where it came from: a "
                   "flag, --config, the model's generation_config.json or logitlab's default (on stderr)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (slow first call)")
    p.add_argument("--autotune", choices=["auto", "on", "template", "off"], default="auto",
                   help="with --compile on a CPU: inductor's max-autotune over the matrix products (on: each "
                   "product's kernels timed; template: inductor's C++ GEMM template wherever it applies, untimed; "
                   "auto: template for bf16 weights, off for float32, where autotuning was measured slower on "
                   "one CPU and faster on another; kernels.decode)")
    p.add_argument("--freeze", choices=["auto", "on", "off"], default="auto",
                   help="with --compile on a CPU: the weights as prepacked graph constants (auto: on; faster steps, "
                   "but a float32 step is compiled again in every new process, where off lets inductor's on-disk "
                   "cache serve a later run in seconds; kernels.decode)")


# -------------------- Settings

def sample_config(args, end_ids: tuple[int, ...] = (), generation: dict | None = None):
    """SampleConfig from logitlab's defaults < the model's generation_config.json (`generation`) <
    TOML [sample] < flags; --stop and --logit-bias parsed here. --verbose prints each setting with
    where it came from (on stderr)."""
    from logitlab.cli.common import build_config, error_console, read_toml
    from logitlab.cli.models import describe_settings, generation_defaults, sample_sources
    from logitlab.generate.config import SampleConfig

    toml = read_toml(args.config).get("sample", {}) if getattr(args, "config", None) else {}
    defaults = generation_defaults(generation or {})
    table = {**defaults, **toml}
    bias = {}
    for item in args.logit_bias:
        key, _, value = item.partition("=")
        try:
            bias[int(key)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias expects ID=BIAS, got {item!r}") from None
    stops = tuple(_unescape(s).encode() for s in args.stop if s)
    overrides = {"logit_bias": bias} if bias else {}
    for name, dest in _ID_LISTS.items():  # a flag replaces the TOML list, as every flag does
        if getattr(args, dest, None):
            overrides[name] = tuple(i for group in getattr(args, dest) for i in group)
    cfg = build_config(SampleConfig, args, table, **overrides)
    cfg = dataclasses.replace(cfg, stop_bytes=cfg.stop_bytes + stops,
                              stop_ids=cfg.stop_ids + tuple(i for i in end_ids if i not in cfg.stop_ids))
    if getattr(args, "verbose", False):
        sources = sample_sources(args, toml, defaults)
        if end_ids:
            sources["stop_ids"] += " + the model's end-of-sequence ids"
        for line in describe_settings(cfg, sources):
            error_console().print(line, markup=False, highlight=False, soft_wrap=True)
    return cfg


def _unescape(text: str) -> str:
    """The escapes of PROMPT, --stop and --neighbours: \\n newline, \\t tab, \\\\ a backslash (others stay)."""
    import re

    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), "\\"), text)


# -------------------- Streaming text

def stream_text(tokenizer, ids, hidden_ids=(), stops=()):
    """Ids -> text pieces: UTF-8-safe (decode_stream), without end/stop ids, cut at stop strings
    (a tail that could start one held back: generate.stops.StopHoldBack)."""
    from logitlab.generate.stops import StopHoldBack

    hold = StopHoldBack([s.decode("utf-8", errors="replace") for s in stops])
    hidden = set(hidden_ids)
    for piece in tokenizer.decode_stream(i for i in ids if i not in hidden):
        out = hold.feed(piece)
        if out:
            yield out
    tail = hold.flush()
    if tail:
        yield tail


def _write_pieces(pieces, echo: bool) -> str:
    """Join the text pieces, with echo also writing each to stdout as it comes. A failure mid-line
    (e.g. a SamplingError) ends the line first, so the error message starts on a line of its own."""
    out = []
    try:
        for piece in pieces:
            out.append(piece)
            if echo:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except BaseException:
        if echo:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    return "".join(out)


def _timings(console, r, prompt_tokens: int | None = None, newline: bool = True) -> None:
    """The stats footer: prompt tokens, new tokens (the first from the prefill), timings, stop reason."""
    new = len(r.tokens[0]) if r.tokens else r.decode_tokens + 1
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
    prompt = "" if prompt_tokens is None else f"prompt {plural(prompt_tokens, 'token')} · "
    console.print(("\n" if newline else "") + f"{prompt}{plural(new, 'new token')} = {min(new, 1)} from the "
                  f"prefill + {r.decode_tokens} decoded · prefill {r.prefill_seconds * 1e3:.1f} ms · decode at "
                  f"{r.decode_tokens_per_second:.1f} tok/s · stop: {r.stop_reasons[0]}",
                  style="dim", markup=False, highlight=False)


def _write_prompt(out, prompt: str) -> None:
    """The prompt before the generated text: dim in a terminal, plain when piped or redirected."""
    out.print(prompt, style="dim", end="", markup=False, highlight=False, soft_wrap=True) if out.is_terminal \
        else sys.stdout.write(prompt)
    (out.file if out.is_terminal else sys.stdout).flush()


# -------------------- generate

def _generate(args) -> int:
    from logitlab.cli.common import console, error_console
    from logitlab.cli.models import load

    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    m = load(args)
    draft = prepare(args, m, error_console())
    cfg = sample_config(args, m.end_ids[1:], m.generation)
    prompt = _unescape(args.prompt)
    ids = m.tokenizer.encode(prompt, allowed_special="none" if args.ordinary else "all", add_bos=True)
    if not ids and m.eot_id is not None:
        ids = [m.eot_id]  # an empty prompt starts from end-of-text, as GPT-2 samples unconditionally
    out, step = console(), _decode_step(args, m.model)
    for i in range(args.num_samples):
        # sample i draws from seed + i, so --seed S --num-samples N is N different, repeatable samples
        this = cfg if cfg.seed is None or i == 0 else dataclasses.replace(cfg, seed=cfg.seed + i)
        if args.num_samples > 1 and not args.json:
            out.print(f"--- sample {i + 1} of {args.num_samples}", style="dim", markup=False, highlight=False)
        _one_sample(args, m, ids, prompt, this, step, out, error_console(), draft)
    return 0


def _stream(args, m, ids, cfg, step, draft):
    from logitlab.generate.loop import stream
    from logitlab.generate.speculative import SpeculativeStream

    if draft is None:
        return stream(m.model, ids, cfg, eot_id=m.eot_id, token_bytes=m.tokenizer.token_bytes, step=step)
    return SpeculativeStream(m.model, ids, cfg, draft=draft, k=args.draft_k, eot_id=m.eot_id,
                             token_bytes=m.tokenizer.token_bytes)


def _one_sample(args, m, ids, prompt, cfg, step, out, err, draft=None) -> None:
    """Stream one continuation to stdout (text, then a newline where a terminal or a pipe reads it)
    and the timings to stderr; with --json, one JSON object per line instead."""
    s = _stream(args, m, ids, cfg, step, draft)
    if not args.json:
        _write_prompt(out, prompt)
    text = _write_pieces(stream_text(m.tokenizer, s, cfg.stop_ids + m.end_ids, cfg.stop_bytes), not args.json)
    r = s.result
    speculative = _speculative_report(args, m, ids, cfg, step, r) if draft is not None else None
    if args.json:
        print(json.dumps(dict(prompt=prompt, prompt_ids=ids, text=text, ids=r.tokens[0], seed=cfg.seed,
                              stop_reason=r.stop_reasons[0], prefill_seconds=r.prefill_seconds,
                              decode_tokens=r.decode_tokens, decode_seconds=r.decode_seconds,
                              decode_tokens_per_second=r.decode_tokens_per_second,
                              **({"speculative": speculative} if speculative else {})), ensure_ascii=False))
        return
    if _reader_wants_newline():
        sys.stdout.write("\n")
        sys.stdout.flush()
    _timings(err, r, len(ids), newline=False)  # stderr: `> out.txt` is the text alone
    if speculative:
        _speculative_line(err, speculative)


def _speculative_report(args, m, ids, cfg, step, r) -> dict:
    """The drafting record of a speculative run; with --compare-plain, the same prompt generated
    without the drafter and the speed-up of decode tok/s."""
    out = dict(draft=args.draft, k=args.draft_k, drafted=r.drafted, accepted=r.accepted,
               acceptance_rate=r.acceptance_rate if r.drafted else None, target_passes=r.target_passes,
               tokens_per_pass=r.tokens_per_pass if r.target_passes else None)
    if getattr(args, "compare_plain", False):
        s = _stream(args, m, ids, cfg, step, None)
        plain = list(s)
        out.update(plain_decode_tokens_per_second=s.result.decode_tokens_per_second,
                   speedup=r.decode_tokens_per_second / s.result.decode_tokens_per_second,
                   same_tokens=plain == r.tokens[0])
    return out


def _speculative_line(err, sp: dict) -> None:
    rate = f"{sp['acceptance_rate']:.0%}" if sp["acceptance_rate"] is not None else "-"
    per = f"{sp['tokens_per_pass']:.2f}" if sp["tokens_per_pass"] is not None else "-"
    line = (f"speculative ({sp['draft']}, k {sp['k']}): {sp['accepted']} of {sp['drafted']} drafts accepted ({rate}) "
            f"· {per} tokens per pass of the model")
    if "speedup" in sp:
        line += (f" · without the draft {sp['plain_decode_tokens_per_second']:.1f} tok/s: speed-up "
                 f"{sp['speedup']:.2f}x · same tokens: {'yes' if sp['same_tokens'] else 'no'}")
    err.print(line, style="dim", markup=False, highlight=False, soft_wrap=True)


def _reader_wants_newline() -> bool:
    """A newline after the text when stdout is a terminal or a pipe (the next prompt or line starts
    clean); a redirected file keeps the text exactly as generated."""
    import os
    import stat

    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError, AttributeError):   # no real file descriptor (captured output)
        return True
    return sys.stdout.isatty() or stat.S_ISFIFO(mode)


def _decode_step(args, model):
    """The decode step generation runs: the compiled one with --compile, else the eager one."""
    from logitlab.generate.loop import decode_step

    if not args.compile:
        return decode_step
    from logitlab.kernels.decode import compiled_decode_step

    choice = {"auto": None, "on": True, "off": False, "template": "template"}
    return compiled_decode_step(model, step=decode_step, autotune=choice[getattr(args, "autotune", "auto")],
                                freeze=choice[getattr(args, "freeze", "auto")])
