"""Chat templates: a conversation [{"role": ..., "content": ...}, ...] -> the text a chat model
reads -> ids.

chat.py owns rendering conversations. Two templates exist:

* ChatML (the default, when a tokenizer has no template): each message is
  `<|im_start|>{role}\\n{content}<|im_end|>\\n`, and the generation prompt is
  `<|im_start|>assistant\\n`. `render_chatml` writes it in plain Python; CHATML_TEMPLATE is the
  same thing as a Jinja template, the form written to a Hugging Face tokenizer_config.json (a
  test checks that the two agree).
* a Jinja template (`Tokenizer.chat_template`), e.g. read from a Hugging Face
  tokenizer_config.json's "chat_template" (`read_hf_chat_template`). It is rendered the way
  transformers renders it: the jinja2 sandbox, trim_blocks and lstrip_blocks, the loop-controls
  extension, a `tojson` filter that does not escape HTML, `raise_exception` and `strftime_now`,
  and the tokenizer's bos/eos tokens as variables. The rendered text is encoded with every
  special-token string as its id, as transformers does, so the ids equal
  `PreTrainedTokenizerFast.apply_chat_template` for the same template and vocabulary.

`chat_turns` cuts a rendered conversation into pieces, one per message, so SFT can put its loss
on the assistant's pieces only: the piece of an assistant message is what the message adds after
the generation prompt (its content and end-of-turn token), and the generation prompt is a piece
of its own (role GENERATION_PROMPT). Pieces are found by rendering growing prefixes of the
conversation, which needs a template whose output for messages[:i] is a prefix of its output for messages[:i+1] (true
of ChatML and of most published templates; otherwise a ValueError says so). A byte-level
tokenizer encodes each piece alone; a SentencePiece-style one encodes the whole chat and cuts its
ids at the pieces' ends.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from logitlab.tokenizer.special import ENDOFTEXT, IM_END, IM_START

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


GENERATION_PROMPT = "generation_prompt"  # chat_turns' role for the header before an assistant message


class ChatMethods:
    """The chat methods of every logitlab tokenizer (byte-level Tokenizer, SentencePieceTokenizer)."""

    chat_template: str | None = None  # Jinja source; None: ChatML

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True):
        """Messages [{"role", "content"}, ...] -> ids (or the text, tokenize=False), as transformers'."""
        return apply_chat_template(self, messages, add_generation_prompt, tokenize)

    def chat_turns(self, messages) -> list[tuple[str, list[int]]]:
        """(role, ids) per piece of the rendered chat; the ids concatenate to the whole chat."""
        return chat_turns(self, messages)


def check_messages(messages) -> list[dict]:
    """A conversation: a list of {"role": str, "content": str} (other keys kept for the template).
    ValueError naming the message and the field otherwise."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {n} must be an object with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"message {n}: field {key!r} must be a string, got {m.get(key)!r}")
        if not m["role"]:
            raise ValueError(f"message {n}: field 'role' is empty")
    return list(messages)


def render_chatml(messages, add_generation_prompt: bool = False) -> str:
    """ChatML in plain Python: the reference the Jinja CHATML_TEMPLATE must equal."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in check_messages(messages))
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


class ChatTemplateError(ValueError):
    """A chat template failed: it ran past a bound of its TemplateLimits, used what a chat template
    may not ({% include %}, ...), hit an error of its own, or (`raised`) refused the conversation
    itself with raise_exception. The message names the template (`template_name`)."""

    def __init__(self, message: str, raised: bool = False):
        super().__init__(message)
        self.raised = raised


def template_name(tok) -> str:
    """How errors name a tokenizer's chat template: the file it was read from, when the template
    is still the one read from it (`chat_template_origin`, (template, file), set by the readers)."""
    origin = getattr(tok, "chat_template_origin", None)
    if origin is not None and origin[0] is not None and origin[0] == tok.chat_template:
        return f"chat template {origin[1]}"
    return "chat template (the tokenizer's chat_template)"


@lru_cache(maxsize=16)
def _compiled(template: str, limits):
    """(environment, compiled template): the sandbox bounded by `limits` (sandbox.py) with what
    transformers gives a template: trim_blocks, lstrip_blocks, loop controls, a tojson that does not
    escape HTML, raise_exception and strftime_now. ValueError when the template does not parse or
    holds a refused statement."""
    import jinja2

    from logitlab.tokenizer.sandbox import BoundedEnvironment, TemplateRaised

    def raise_exception(message):
        raise TemplateRaised(message if isinstance(message, str) and len(message) <= 2000 else "(message too long)")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                   sort_keys=sort_keys)
        # with an indent the text can be far larger than the value: joined under the size bound
        return encoder.encode(x) if indent is None else env.join_bounded(encoder.iterencode(x))

    def strftime_now(fmt):
        from datetime import datetime

        if not isinstance(fmt, str) or len(fmt) > 200:
            raise TemplateRaised("strftime_now takes a format string of at most 200 characters")
        return datetime.now().strftime(fmt)

    env = BoundedEnvironment(limits, trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                             filters={"tojson": tojson},
                             globals={"raise_exception": raise_exception, "strftime_now": strftime_now})
    try:
        return env, env.compile_template(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"does not parse (line {exc.lineno}): {exc.message}") from None
    except jinja2.exceptions.TemplateError as exc:  # a refused statement
        raise ValueError(str(exc)) from None


def template_variables(tok) -> dict[str, str]:
    """The special tokens a template reads, as written to tokenizer_config.json (so transformers
    passes the same ones). A SentencePiece-style tokenizer names them itself (its `roles`: <s>,
    </s>, ...); for a byte-level one bos_token is its BOS token (Llama 3's <|begin_of_text|>) or
    else the end of text, and eos_token the end of a turn (<|im_end|> when the tokenizer has it,
    else the end of text)."""
    if getattr(tok, "kind", None) == "sentencepiece":
        return dict(tok.roles)
    specials, found = tok.special_tokens, {}
    if ENDOFTEXT in specials:
        found = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT}
    if IM_END in specials:
        found["eos_token"] = IM_END
    if getattr(tok, "bos_token", None) is not None:
        found["bos_token"] = tok.bos_token
    return found


def render(tok, messages, add_generation_prompt: bool = False, limits=None) -> str:
    """The conversation's text through `tok.chat_template` (ChatML when it is None), within
    `limits` (a sandbox.TemplateLimits; its defaults when None). ChatTemplateError, naming the
    template, for anything that goes wrong inside it."""
    messages = check_messages(messages)
    template = getattr(tok, "chat_template", None)
    if template is None:
        return render_chatml(messages, add_generation_prompt)
    try:
        from logitlab.tokenizer.sandbox import TemplateLimitError, TemplateLimits, TemplateRaised
    except ImportError as exc:  # jinja2, which sandbox.py imports
        raise RuntimeError("Jinja chat templates need the jinja2 package (pip install jinja2)") from exc
    name = template_name(tok)
    try:
        env, compiled = _compiled(template, limits or TemplateLimits())
    except ValueError as exc:
        raise ChatTemplateError(f"{name}: {exc}") from None
    try:
        return env.render(compiled, messages=messages,
                          add_generation_prompt=add_generation_prompt, **template_variables(tok))
    except TemplateRaised as exc:
        raise ChatTemplateError(f"{name} refused the conversation: {exc}", raised=True) from None
    except TemplateLimitError as exc:
        raise ChatTemplateError(f"{name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001  a template is a program: any failure in it is its own
        raise ChatTemplateError(f"{name} failed: {type(exc).__name__}: {str(exc)[:500]}") from None


def _check_specials(tok, text: str) -> None:
    """ChatML's markers must be special tokens; else they would be split into ordinary pieces."""
    missing = [s for s in (IM_START, IM_END) if s in text and s not in tok.special_tokens]
    if missing:
        raise ValueError(f"the chat uses {missing} but the tokenizer has no such special token(s); "
                         f"add them first (logitlab tokenizer add-special)")


def apply_chat_template(tok, messages, add_generation_prompt: bool = False, tokenize: bool = True):
    """-> ids of the rendered conversation (or its text, tokenize=False)."""
    text = render(tok, messages, add_generation_prompt)
    if not tokenize:
        return text
    _check_specials(tok, text)
    return tok.encode(text)


def chat_turns(tok, messages) -> list[tuple[str, list[int]]]:
    """-> [(role, ids), ...]: one piece per message, and before each assistant message its
    generation prompt (role GENERATION_PROMPT, e.g. `<|im_start|>assistant\\n`), whose ids
    concatenate to the conversation's. Each piece is encoded alone, so no BPE token crosses from
    one message into the next."""
    messages = check_messages(messages)
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            upto = render(tok, messages[:i], add_generation_prompt=True)
            if upto.startswith(done) and upto != done:
                pieces.append((GENERATION_PROMPT, upto[len(done):]))
                done = upto
        full = render(tok, messages[:i + 1])
        if not full.startswith(done):
            raise ValueError(f"chat template is not prefix-consistent at message {i}: rendering "
                             f"messages[:{i + 1}] does not extend messages[:{i}]; cannot cut turns")
        pieces.append((m["role"], full[len(done):]))
        done = full
    _check_specials(tok, done)
    pieces = [(role, text) for role, text in pieces if text]
    if getattr(tok, "kind", None) == "sentencepiece":
        return _cut_encoded(tok, pieces)
    return [(role, tok.encode(text)) for role, text in pieces]


def _cut_encoded(tok, pieces: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """The whole chat encoded once (its ids are apply_chat_template's), cut where each piece ends.
    A SentencePiece-style piece encodes differently alone (its text would get the "▁" of a text's
    start), so each cut is found by encoding the chat up to it; ValueError when a token crosses one."""
    text = "".join(t for _, t in pieces)
    whole, out, done, end = tok.encode(text), [], 0, 0
    for n, (role, piece) in enumerate(pieces):
        end += len(piece)
        prefix = tok.encode(text[:end])
        if whole[:len(prefix)] != prefix:
            raise ValueError(f"cannot cut the chat into turns: a token crosses the end of piece {n} ({role}) "
                             f"into the next")
        out.append((role, whole[done:len(prefix)]))
        done = len(prefix)
    return out


def fit_history(tok, messages, budget: int) -> tuple[list[int], int]:
    """The prompt for the next reply within `budget` tokens: -> (ids with the generation prompt,
    messages dropped). Whole messages are dropped from the oldest on, never a leading system
    message, and the kept history starts at a user message; ValueError when even the last user
    message does not fit (a chat loop says so and asks for a shorter one)."""
    messages = check_messages(messages)
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(system):]
    for drop in range(len(rest) + 1):
        if drop < len(rest) and rest[drop]["role"] == "assistant":
            continue
        ids = apply_chat_template(tok, system + rest[drop:], add_generation_prompt=True)
        if len(ids) <= budget:
            return ids, drop
    raise ValueError(f"the last message does not fit in {budget} tokens with the template "
                     f"({len(apply_chat_template(tok, system + rest[-1:], True))} needed)")


def read_hf_chat_template(path: str | os.PathLike) -> str | None:
    """The "chat_template" of a Hugging Face tokenizer_config.json (a file, or a directory holding
    one, or a chat_template.jinja beside it); a list of named templates gives the "default" one.
    None when there is none."""
    return find_hf_chat_template(path)[0]


def find_hf_chat_template(path: str | os.PathLike) -> tuple[str | None, Path | None]:
    """(the template, the file it is in) as read_hf_chat_template finds it; (None, None) when
    there is none."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), folder / "chat_template.jinja"
    config = folder / "tokenizer_config.json" if path.is_dir() else path
    if not config.is_file():
        return None, None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config}: not JSON ({exc})") from None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config}: 'chat_template' must be a string or a list of {{name, template}}")
    return template, (config if template is not None else None)


def end_of_turn_id(tok) -> int | None:
    """The id that ends an assistant turn: <|im_end|> when the tokenizer has it, else the end of
    text (a stop token for generation and the last id SFT trains on in each assistant turn)."""
    return tok.special_tokens.get(IM_END, tok.eot_id)


def hf_tokenizer_config(tok, model_max_length: int) -> dict:
    """tokenizer_config.json for transformers' AutoTokenizer: the chat template (ChatML when the
    tokenizer has none and holds ChatML's markers), the special tokens and the end of turn as eos.
    A tokenizer.json with a BOS token keeps its post-processor (the <s> or <|begin_of_text|> it
    adds), so no add_bos_token is written for it: transformers would rebuild the post-processor."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    sentencepiece = getattr(tok, "kind", None) == "sentencepiece"
    if not sentencepiece and getattr(tok, "bos_token", None) is None:
        config["add_bos_token"] = False
    specials = tok.special_tokens
    config.update(template_variables(tok))
    if ENDOFTEXT in specials and not sentencepiece:
        config["unk_token"] = ENDOFTEXT
    template = getattr(tok, "chat_template", None)
    if template is None and IM_START in specials and IM_END in specials:
        template = CHATML_TEMPLATE
    if template is not None:
        config["chat_template"] = template
    named = set(config.values()) if sentencepiece else set()
    extra = sorted(s for s in specials if s != ENDOFTEXT and s not in named)
    if extra:
        config["additional_special_tokens"] = extra
    return config


def write_hf_tokenizer_config(tok, directory: str | os.PathLike, model_max_length: int) -> Path:
    """Write (atomically) directory/tokenizer_config.json and special_tokens_map.json for `tok`."""
    from logitlab.io.files import atomic_write_text

    config = hf_tokenizer_config(tok, model_max_length)
    keys = ("bos_token", "eos_token", "unk_token", "pad_token", "additional_special_tokens")
    special_map = {k: config[k] for k in keys if k in config}
    directory = Path(directory)
    atomic_write_text(directory / "special_tokens_map.json", json.dumps(special_map, indent=2) + "\n")
    return atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
