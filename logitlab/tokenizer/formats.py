"""Tokenizer file formats: logitlab JSON, GPT-2 vocab.json + merges.txt, Hugging Face
tokenizer.json (byte-level BPE; its pre-tokenizer and post-processor are read and written by
hf_steps.py) and tiktoken rank files. SentencePiece-style files are sp_files.py's (`read_logitlab`
and `is_sentencepiece_json` tell the kinds apart).

Every reader checks its input and raises ValueError / FileNotFoundError naming the file and the
bad entry. Ids are kept as the files give them; the writers store our ids unchanged, so a file
written here and read back (by us, by `tokenizers`, `transformers` or tiktoken) gives the same ids.

Every writer replaces its file atomically (a temporary file beside it, then a rename), and only
replaces a file of its own kind: `check_target` refuses a directory, a symbolic link, or an
existing non-empty file whose start is not what that writer writes (an existing logitlab
tokenizer is replaced; a README or a model file never is).

GPT-2's files and HF tokenizer.json spell bytes with GPT-2's printable alphabet
(`bytes_to_unicode`): printable Latin-1 bytes stand for themselves and the other 68 bytes
become the characters U+0100... in byte order, so every token is a printable string.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path

from logitlab.io.files import DiskFullError, atomic_write_bytes
from logitlab.tokenizer.hf_steps import byte_level_pattern, byte_level_pre_tokenizer, checked_bos, template_processing

FORMAT = "logitlab-tokenizer"
VERSION = 1

# What each writer's file starts with; an existing file is replaced only when its start matches.
LOGITLAB, LISTING, HF, TIKTOKEN = "logitlab tokenizer file", "vocab listing", "tokenizer.json", "tiktoken rank file"
_STARTS = {
    LOGITLAB: re.compile(rb'\A\s*\{\s*"format"\s*:\s*"logitlab-tokenizer"'),
    LISTING: re.compile(rb"\A0\t\["),
    HF: re.compile(rb'\A\s*\{\s*"version"\s*:'),
    TIKTOKEN: re.compile(rb"\A[A-Za-z0-9+/]+=* [0-9]+\r?\n"),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """byte value -> printable character (GPT-2's byte-level alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def to_printable(token: bytes) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def from_printable(text: str, where: str) -> bytes:
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in text)
    except KeyError as exc:
        raise ValueError(f"{where}: token {text!r} has character {exc.args[0]!r} outside the "
                         f"byte-level alphabet") from None


def _read_json(path, what: str):
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: malformed {what} (not JSON: {exc})") from None


def _field(obj: dict, key: str, kind: type, where):
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"{where}: missing field {key!r}")
    if not isinstance(obj[key], kind):
        raise ValueError(f"{where}: field {key!r} must be {kind.__name__}, got {type(obj[key]).__name__}")
    return obj[key]


# ------------------------------------------------------------------------------ writing files
def check_target(path, kind: str) -> Path:
    """Raise unless a `kind` file (LOGITLAB, LISTING, HF, TIKTOKEN) can be written at `path`
    without losing anything: ValueError for a directory, a symbolic link, something that is not
    a regular file, or an existing non-empty file of another kind; PermissionError when the
    nearest existing directory above it cannot be written. Returns the path."""
    path = Path(path)
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link; refusing to replace it with a {kind} (give the real path)")
    if path.is_dir():
        raise ValueError(f"cannot write a {kind} to {path}: it is a directory (give a file path, e.g. "
                         f"{path / ('tokenizer.vocab' if kind == LISTING else 'tokenizer.json')})")
    if path.exists():
        if not path.is_file():
            raise ValueError(f"cannot write a {kind} to {path}: it exists and is not a regular file")
        with open(path, "rb") as f:
            head = f.read(256)
        if head and not _STARTS[kind].match(head):
            raise ValueError(f"{path} exists and is not a {kind}; refusing to overwrite it (move it away "
                             f"or choose another path)")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"cannot write {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(13, f"directory {folder} is not writable", str(path))
    return path


def write_file(path, text: str, kind: str) -> None:
    """`text` (UTF-8) into `path` atomically, after `check_target`; missing folders are made. An
    OSError names `path` (not the temporary file beside it)."""
    path = check_target(path, kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, text.encode("utf-8"))
    except DiskFullError:
        raise
    except OSError as exc:
        if exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc  # the subclass follows errno


# ------------------------------------------------------------------------------ logitlab JSON
def fingerprint(tok) -> str:
    """sha256 over pattern, ordinary vocab, merges and special tokens (first 16 hex digits)."""
    canon = {
        "pattern": tok.pattern,
        "vocab": sorted((i, t.hex()) for i, t in tok._decoder.items()),
        "merges": [[a.hex(), b.hex()] for a, b in tok.merges],
        "special_tokens": sorted(tok.special_tokens.items()),
    }
    for key in ("normalization", "bos_token"):  # only when set, so that older files keep their fingerprints
        if getattr(tok, key, None):
            canon[key] = getattr(tok, key)
    return hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()[:16]


def readable_token(token: bytes) -> str:
    """A token for people: UTF-8 text; bytes that are not valid UTF-8 as \\xNN; control
    characters as \\uNNNN."""
    text = token.decode("utf-8", errors="backslashreplace")
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


def save_logitlab(tok, path) -> None:
    """JSON with tokens as hex (lossless) and, beside it, `<stem>.vocab`: one readable line per id."""
    path = Path(path)
    data = {
        "format": FORMAT,
        "version": VERSION,
        "pattern": tok.pattern_name or tok.pattern,
        "vocab_size": tok.vocab_size,
        "special_tokens": tok.special_tokens,
        "vocab": {str(i): t.hex() for i, t in sorted(tok._decoder.items())},
        "merges": [[a.hex(), b.hex()] for a, b in tok.merges],
        "fingerprint": tok.fingerprint(),
    }
    if tok.normalization is not None:
        data["normalization"] = tok.normalization
    if tok.bos_token is not None:
        data["bos_token"] = tok.bos_token
    if tok.missing_bytes:
        data["drop_missing_bytes"] = True  # the vocabulary lacks some bytes (byte_vocab.py)
    if getattr(tok, "chat_template", None) is not None:
        data["chat_template"] = tok.chat_template  # not in the fingerprint: it changes no id
    listing = path.with_suffix(".vocab")
    if listing == path:
        raise ValueError(f"cannot save the tokenizer as {path}: the readable listing goes beside it as "
                         f"<name>.vocab, so the tokenizer file needs another suffix (e.g. {path.with_suffix('.json')})")
    check_target(path, LOGITLAB)
    check_target(listing, LISTING)
    write_file(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n", LOGITLAB)
    made_by = {a + b: (a, b) for a, b in tok.merges}
    lines = []
    for i in range(tok.vocab_size):
        t = tok.token_bytes(i)
        line = f"{i}\t[{readable_token(t)}]"
        if tok.is_special(i):
            line += "\tspecial"
        elif t in made_by:
            a, b = made_by[t]
            line += f"\t<- [{readable_token(a)}] [{readable_token(b)}]"
        lines.append(line)
    write_file(listing, "\n".join(lines) + "\n", LISTING)


KINDS = ("byte_level", "sentencepiece")  # a logitlab file's "kind" (absent: byte_level)


def read_logitlab(path) -> tuple[str, dict]:
    """(kind, parsed JSON) of a logitlab tokenizer file; ValueError for anything else."""
    path = Path(path)
    data = _read_json(path, "tokenizer file")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a logitlab tokenizer file (field 'format' must be {FORMAT!r})")
    kind = data.get("kind", "byte_level")
    if kind not in KINDS:
        raise ValueError(f"{path}: unknown tokenizer kind {kind!r} (expected one of {KINDS})")
    return kind, data


def is_sentencepiece_json(data) -> bool:
    """True for a tokenizer.json that is not byte-level BPE (no ByteLevel pre-tokenizer or decoder)."""
    return isinstance(data, dict) and '"ByteLevel"' not in json.dumps([data.get("pre_tokenizer"), data.get("decoder")])


def load_logitlab(cls, path, data: dict | None = None):
    """A byte-level logitlab tokenizer file as `cls`; `data`: its parsed JSON when already read."""
    path = Path(path)
    kind, data = read_logitlab(path) if data is None else ("byte_level", data)
    if kind != "byte_level":
        raise ValueError(f"{path}: a {kind} tokenizer, not byte-level BPE")
    try:
        vocab = {int(i): bytes.fromhex(h) for i, h in _field(data, "vocab", dict, path).items()}
        merges = [(bytes.fromhex(a), bytes.fromhex(b)) for a, b in _field(data, "merges", list, path)]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: malformed 'vocab' or 'merges' entry: {exc}") from None
    specials = _field(data, "special_tokens", dict, path)
    pattern = _field(data, "pattern", str, path)
    bos, drop = data.get("bos_token"), data.get("drop_missing_bytes", False)
    if not (bos is None or isinstance(bos, str)) or not isinstance(drop, bool):
        raise ValueError(f"{path}: field 'bos_token' must be a string or null and 'drop_missing_bytes' a bool")
    try:
        tok = cls(vocab, merges, special_tokens=specials, pattern=pattern, normalization=data.get("normalization"),
                  bos_token=bos, drop_missing_bytes=drop)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    expected = data.get("fingerprint")
    if expected is not None and expected != tok.fingerprint():
        raise ValueError(f"{path}: fingerprint mismatch (file says {expected}, contents give "
                         f"{tok.fingerprint()}); the file was edited or damaged")
    template = data.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: field 'chat_template' must be str, got {type(template).__name__}")
    tok.chat_template = template
    tok.chat_template_origin = (template, str(path))  # chat.template_name: errors name the file
    return tok


# ------------------------------------------------------------------------------ GPT-2 files
def read_merges_txt(path) -> list[tuple[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"merges file not found: {p}")
    merges = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{p}:{n}: malformed merge line {line!r} (expected 'left right')")
        merges.append((parts[0], parts[1]))
    return merges


def _from_printable_vocab(raw, where) -> tuple[dict[int, bytes], dict[str, int]]:
    """printable token -> id  =>  (id -> bytes for byte-level tokens, other entries as specials)."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where}: vocab must be a non-empty object token -> id")
    vocab, undecodable = {}, {}
    for text, i in raw.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"{where}: token {text!r} has a bad id {i!r}")
        try:
            vocab[i] = from_printable(text, where)
        except ValueError:
            undecodable[text] = i
    return vocab, undecodable


def _build(cls, vocab, merges, where, specials, pattern="gpt2", normalization=None, bos=None, drop=False):
    """Entries that are neither single bytes nor merge results become special tokens. `bos`: the
    BOS token; `drop`: whether bytes the vocabulary lacks are dropped from the text (byte_vocab.py)."""
    ordinary = {bytes([b]) for b in range(256)} | {a + b for a, b in merges}
    known = set()
    for a, b in merges:
        for part in (a, b):
            if part not in ordinary:
                raise ValueError(f"{where}: merge part {to_printable(part)!r} is not a byte or an earlier merge")
        known.add(a + b)
    have = set(vocab.values())
    for tok in sorted(t for t in ordinary - have if len(t) > 1 or not drop):
        what = "merge result" if len(tok) > 1 else "byte token"
        raise ValueError(f"{where}: {what} {to_printable(tok)!r} is missing from the vocab")
    for i, t in list(vocab.items()):
        if t not in ordinary:
            specials[t.decode("utf-8", errors="replace")] = i
            del vocab[i]
    try:
        return cls(vocab, merges, special_tokens=specials, pattern=pattern, normalization=normalization,
                   bos_token=bos, drop_missing_bytes=drop)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_gpt2(cls, vocab_json, merges_txt):
    """GPT-2's `vocab.json` (encoder.json layout) + `merges.txt` (vocab.bpe layout)."""
    raw = _read_json(vocab_json, "vocab file")
    vocab, specials = _from_printable_vocab(raw, vocab_json)
    merges = [(from_printable(a, merges_txt), from_printable(b, merges_txt)) for a, b in read_merges_txt(merges_txt)]
    return _build(cls, vocab, merges, f"{vocab_json} + {merges_txt}", specials)


# ------------------------------------------------------------------------------ HF tokenizer.json
def save_hf(tok, path) -> None:
    """Hugging Face `tokenizer.json` for byte-level BPE (ids unchanged, specials as added tokens).
    A special token among the ordinary ids (SmolLM2's <|endoftext|> is 0) is in the BPE vocabulary
    too, as `tokenizers`' trainer writes it: an added token missing from it gets the next free id."""
    vocab = {to_printable(t): i for i, t in sorted(tok._decoder.items())}
    last = max(tok._decoder, default=-1)
    vocab |= {s: i for s, i in tok.special_tokens.items() if i < last and s not in vocab}
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}
                         for s, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])],
        "normalizer": {"type": tok.normalization} if tok.normalization else None,
        "pre_tokenizer": byte_level_pre_tokenizer(tok.pattern_name, tok.pattern),
        "post_processor": template_processing(tok.bos_token, tok.bos_id),
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
                  "merges": [[to_printable(a), to_printable(b)] for a, b in tok.merges]},
    }
    write_file(path, json.dumps(data, ensure_ascii=False, indent=1) + "\n", HF)


def load_hf(cls, path, data: dict | None = None):
    """A byte-level Hugging Face tokenizer.json as `cls`; `data`: its parsed JSON when already read."""
    data = _read_json(path, "tokenizer.json") if data is None else data
    model = _field(data, "model", dict, path)
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: model type {model.get('type')!r} is not BPE")
    pattern = byte_level_pattern(data.get("pre_tokenizer"), path)
    normalizer = data.get("normalizer")  # a Unicode normal form (Qwen's NFC), or none
    if normalizer is not None and (not isinstance(normalizer, dict) or
                                   normalizer.get("type") not in ("NFC", "NFD", "NFKC", "NFKD")):
        raise ValueError(f"{path}: normalizer {json.dumps(normalizer)[:120]} is not supported (a byte-level "
                         f"tokenizer takes none, or one Unicode normal form: NFC, NFD, NFKC or NFKD)")
    vocab, specials = _from_printable_vocab(_field(model, "vocab", dict, path), path)
    merges = []
    for n, m in enumerate(_field(model, "merges", list, path)):
        pair = m.split(" ") if isinstance(m, str) else m
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{path}: merge #{n} is malformed: {m!r}")
        merges.append((from_printable(pair[0], path), from_printable(pair[1], path)))
    for added in data.get("added_tokens") or []:
        specials[added["content"]] = added["id"]
        vocab.pop(added["id"], None)
    bos = checked_bos(data.get("post_processor"), specials, path)
    # A byte the vocabulary lacks: skipped by a BPE model without unk_token or byte fallback
    drop = model.get("unk_token") is None and not model.get("byte_fallback")
    tok = _build(cls, vocab, merges, str(path), specials, pattern, normalizer and normalizer["type"], bos, drop)
    from logitlab.tokenizer.chat import find_hf_chat_template  # the tokenizer_config.json beside it

    tok.chat_template, source = find_hf_chat_template(Path(path).parent)
    tok.chat_template_origin = (tok.chat_template, str(source))  # chat.template_name: errors name the file
    return tok


# ------------------------------------------------------------------------------ tiktoken ranks
def save_tiktoken(tok, path) -> None:
    """tiktoken's rank file: `base64(token) rank` per line (special tokens are not part of it)."""
    if tok.missing_bytes:
        raise ValueError(f"cannot write a tiktoken rank file: the vocabulary lacks {len(tok.missing_bytes)} of the "
                         f"256 byte tokens (e.g. {tok.missing_bytes[0]:#04x}), which tiktoken needs")
    lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in sorted(tok._decoder.items())]
    write_file(path, "\n".join(lines) + "\n", TIKTOKEN)
