"""The OpenAI wire format: request bodies checked field by field, sampling parameters mapped to
SampleConfig, chat messages rendered to a prompt, and generated ids turned back into text.

protocol.py owns what the HTTP app (app.py) needs besides HTTP itself:
  - `ApiError(status, message, param)`: a 4xx answer naming the field, as OpenAI's
    {"error": {"message", "type", "param", "code"}} body;
  - `read_json(request, max_bytes)` / `parse_json(body)`: the body's size bounded while it is read,
    its nesting before it is parsed, and JSON's NaN and Infinity refused (Python's json accepts them);
  - `sampling(body, ...)`: max_tokens, temperature, top_p, top_k, min_p, the penalties, seed,
    logit_bias and stop -> (SampleConfig, stop strings);
  - `chat_prompt(tokenizer, messages)`: the tokenizer's chat template (Tokenizer.apply_chat_template)
    when it has one that fits its special tokens, else ChatML written as plain text; a template
    that refuses the conversation (raise_exception) is a 400, one that fails or runs past its
    bounds (tokenizer/sandbox.py) a 500, for that request only;
  - `TextStream`: ids -> text pieces, UTF-8 safe, without end/stop ids, cut before a stop string
    (a possible start of one held back until it is known).
"""

from __future__ import annotations

import codecs
import json
import math
import re

import numpy as np

from logitlab.generate.sampling import SampleConfig
from logitlab.generate.stops import StopHoldBack
from logitlab.tokenizer.chat import ChatTemplateError

MAX_STOPS = 16
MAX_STOP_BYTES = 8192    # all stop strings of one request together, UTF-8
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 64      # nesting of arrays and objects in a request body


class ApiError(Exception):
    """An answer other than 200: status, message, and the request field at fault (or None)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number")


# A JSON string: quote, then characters and escapes, then a quote, or the end of the text (an
# unterminated string, maybe ending in a lone backslash). The possessive *+ and the end
# alternative mean a match never fails once it starts, so the scan is linear.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text (0 for a scalar), found without parsing
    it: strings blanked out, every byte but brackets dropped, then the largest running count of
    [ and { minus ] and }, vectorised (a megabyte in milliseconds). Malformed text may count
    deeper than a parser would go before failing; it is refused either way."""
    brackets = _JSON_STRING.sub(b'""', body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    b = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1)
    return max(int(np.cumsum(steps).max()), 0)


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """The request's JSON object; ApiError 400 for anything else (NaN / Infinity included), and
    for arrays and objects nested deeper than max_depth, refused before parsing (Python's parser
    recurses once per level)."""
    depth = json_depth(body)
    if depth > max_depth:
        raise ApiError(400, f"the request body nests arrays and objects {depth} deep; at most {max_depth}")
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(value).__name__}")
    return value


async def read_json(request, max_bytes: int) -> dict:
    """The JSON body of a starlette request, refused past max_bytes (413) before or while reading
    it, then checked as parse_json does."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body ({declared} bytes) is larger than the limit of {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is larger than the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


# -------------------- fields

def number(body: dict, name: str, default, low=None, high=None, integer: bool = False):
    """body[name] as a finite number (an integer when integer=True) within [low, high]; null -> default."""
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be {kind}, got {json.dumps(value)}", name)
    if not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be finite, got {value}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"between {low} and {high}"
        raise ApiError(400, f"'{name}' must be {span}, got {value}", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(value)}", name)
    return value


def integer(body: dict, name: str, default, low=None, high=None):
    return number(body, name, default, low, high, integer=True)


def _stops(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' holds {len(stops)} strings; at most {MAX_STOPS}", "stop")
    try:
        size = sum(len(s.encode()) for s in stops)
    except UnicodeEncodeError:
        raise ApiError(400, "'stop' holds a lone surrogate, which is not text", "stop") from None
    if size > MAX_STOP_BYTES:
        raise ApiError(400, f"'stop' strings hold {size} bytes in all; at most {MAX_STOP_BYTES}", "stop")
    return [s for s in stops if s]


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", "logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab_size):
            raise ApiError(400, f"'logit_bias' key {key!r} is not a token id (0..{vocab_size - 1})", "logit_bias")
        out[int(key)] = number(value, key, 0.0, -100, 100)
    return out


def sampling(body: dict, vocab_size: int, default_max_tokens: int, max_tokens_field: str = "max_tokens",
             defaults: dict | None = None) -> tuple[SampleConfig, list[str]]:
    """(SampleConfig, stop strings) from the OpenAI fields; every value checked, ApiError naming it.
    `defaults` (the model's generation_config.json, io.generation_config.sample_defaults) replace
    the OpenAI defaults of the fields a request leaves out."""
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **(defaults or {})}
    max_tokens = integer(body, max_tokens_field, default_max_tokens, low=1)
    fields = dict(
        max_new_tokens=max_tokens,
        temperature=number(body, "temperature", d["temperature"], 0, 2),
        top_p=number(body, "top_p", d["top_p"], 0, 1),
        top_k=integer(body, "top_k", d["top_k"], low=0),
        min_p=number(body, "min_p", d["min_p"], 0, 1),
        repetition_penalty=number(body, "repetition_penalty", d["repetition_penalty"], 0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2, 2),
        presence_penalty=number(body, "presence_penalty", 0.0, -2, 2),
        seed=integer(body, "seed", None),
        logit_bias=_logit_bias(body, vocab_size),
    )
    if fields["top_p"] == 0:
        raise ApiError(400, "'top_p' must be greater than 0", "top_p")
    stops = _stops(body)
    try:
        config = SampleConfig(**fields, stop_bytes=tuple(s.encode() for s in stops))
    except ValueError as exc:  # SampleConfig's own rules: its message starts with the field's name
        field = str(exc).split(" ", 1)[0]
        param = {"max_new_tokens": max_tokens_field}.get(field, field)
        raise ApiError(400, str(exc).replace(field, param, 1), param) from None
    return config, stops


# -------------------- prompts

def completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    """'prompt': a string, a list of strings, a list of token ids or a list of such lists."""
    prompt = body.get("prompt")
    eot = tokenizer.eot_id
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if not all(p and all(isinstance(i, int) and not isinstance(i, bool) for i in p) for p in prompt):
            raise ApiError(400, "'prompt' lists must hold token ids (integers)", "prompt")
        return prompt
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings or a list of token ids", "prompt")
    ids = [tokenizer.encode(p, add_bos=True) for p in prompts]  # <s> first for a SentencePiece-style tokenizer
    if any(not p for p in ids) and eot is None:
        raise ApiError(400, "'prompt' is empty and the tokenizer has no <|endoftext|> to start from", "prompt")
    return [p or [eot] for p in ids]


def _message_text(n: int, message) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"messages[{n}] must be an object with a string 'role'", "messages")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{n}].content parts must be {{'type': 'text', 'text': str}}", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{n}].content must be a string", "messages")
    return {"role": message["role"], "content": content}


IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def chat_prompt(tokenizer, messages) -> tuple[list[int], list[str], list[int]]:
    """(prompt ids, stop strings, stop ids) for a conversation. The tokenizer's apply_chat_template
    when it has one and its markers are special tokens; else ChatML as plain text, with "<|im_end|>"
    as a stop string (a model that never learned the markers still gets a well-formed prompt)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    messages = [_message_text(n, m) for n, m in enumerate(messages)]
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is not None:
        try:
            ids = apply(messages, add_generation_prompt=True)
            end = tokenizer.special_tokens.get(IM_END)
            return list(ids), [], [end] if end is not None else []
        except ChatTemplateError as exc:  # the template refused this conversation, or failed: this request's error
            raise ApiError(400 if exc.raised else 500, str(exc), "messages" if exc.raised else None,
                           None if exc.raised else "chat_template_error") from None
        except ValueError:
            pass  # the template needs special tokens this tokenizer lacks: plain text below
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages) + f"{IM_START}assistant\n"
    return tokenizer.encode(text, allowed_special="none", add_bos=True), [IM_END], []


# -------------------- text out

class TextStream:
    """Generated ids -> text pieces: bytes decoded incrementally (a character split across tokens
    waits for its last byte), `hidden` ids (end-of-text, stop ids) left out, and the text cut
    before the first stop string, with a tail that could start one held back (StopHoldBack, the
    same as the CLI's). `text` is everything released so far."""

    def __init__(self, tokenizer, stops=(), hidden=()):
        self.tokenizer, self.hidden = tokenizer, set(hidden)
        self._hold = StopHoldBack(stops)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    @property
    def done(self) -> bool:
        """A stop string was found: nothing more is released."""
        return self._hold.done

    def feed(self, token: int) -> str:
        if self.done or token in self.hidden:
            return ""
        return self._release(self._hold.feed(self._decoder.decode(self.tokenizer.token_bytes(token))))

    def finish(self) -> str:
        if self.done:
            return ""
        return self._release(self._hold.feed(self._decoder.decode(b"", final=True)) + self._hold.flush())

    def _release(self, out: str) -> str:
        self.text += out
        return out


def token_text(tokenizer, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")
