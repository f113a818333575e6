"""SentencePiece-style tokenizer files: Hugging Face tokenizer.json (read and written), the
tokenizer_config.json beside it, and logitlab's own JSON with its readable `.vocab` listing.

Reading a tokenizer.json gives the ids `tokenizers.Tokenizer.from_file` gives. When a
tokenizer_config.json lies beside it, it is read as transformers' AutoTokenizer reads it: the
chat template, the special tokens' names (bos_token, eos_token, ... -> `roles`), add_bos_token
(for a file without a post-processor: transformers 5 keeps a file's own), and, for the two
tokenizer classes that rebuild the pipeline from the file's vocabulary and merges
(`REBUILT_CLASSES`: Llama's and Gemma's), the steps that class builds instead of the file's. So a
model directory gives the ids transformers gives for it. (Llama's class, for instance, replaces
Llama-2's Prepend + Replace normalizer by a Metaspace pre-tokenizer, which gives no "▁" to text
after a special token unless tokenizer_config.json says legacy: true, and never a second "▁" to
text that starts with a space.)

Writing: tokenizer.json with the tokenizer's steps, vocabulary, merges, added tokens and a
TemplateProcessing post-processor for its BOS token; `tokenizers` and transformers read it back
with equal ids (the tokenizer_config.json written beside it by chat.write_hf_tokenizer_config
names tokenizer_class PreTrainedTokenizerFast, which keeps the file's steps).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from logitlab.tokenizer.formats import HF, LISTING, LOGITLAB, _field, _read_json, check_target, write_file
from logitlab.tokenizer.hf_steps import bos_of, template_processing
from logitlab.tokenizer.sp_bpe import SPACE, byte_of_piece
from logitlab.tokenizer.sp_pipeline import (
    LLAMA_DECODER,
    AddedToken,
    Metaspace,
    Replace,
    SentencePieceConfig,
    SplitAfter,
    config_to_json,
    decoder_from_json,
    normalizer_from_json,
    pre_tokenizer_from_json,
)

ROLE_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")


# ------------------------------------------------------------------------------ reading tokenizer.json
def _model(model: dict, where) -> tuple[dict[str, int], list[tuple[str, str]]]:
    if model.get("type") != "BPE":
        raise ValueError(f"{where}: model type {model.get('type')!r} is not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise ValueError(f"{where}: BPE dropout {model['dropout']!r} makes encoding random; not supported")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"{where}: BPE {key} {model[key]!r} is not supported (SentencePiece-style files "
                             f"have none)")
    vocab = _field(model, "vocab", dict, where)
    merges = []
    for n, m in enumerate(_field(model, "merges", list, where)):
        pair = m.split(" ") if isinstance(m, str) else m
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise ValueError(f"{where}: merge #{n} is malformed: {m!r}")
        merges.append((pair[0], pair[1]))
    return vocab, merges


def _added_tokens(entries, where) -> list[AddedToken]:
    out = []
    for n, t in enumerate(entries or []):
        if not isinstance(t, dict) or "content" not in t or "id" not in t:
            raise ValueError(f"{where}: added_tokens[{n}] must have 'id' and 'content'")
        for flag in ("single_word", "lstrip", "rstrip"):
            if t.get(flag):
                raise ValueError(f"{where}: added token {t['content']!r} has {flag}: true, which is not supported")
        out.append(AddedToken(t["content"], t["id"], bool(t.get("special", False)), bool(t.get("normalized", False))))
    return out


def config_from_json(data: dict, where) -> SentencePieceConfig:
    """The steps of a parsed tokenizer.json."""
    model = _field(data, "model", dict, where)
    try:
        return SentencePieceConfig(
            normalizer=normalizer_from_json(data.get("normalizer"), where),
            pre_tokenizer=pre_tokenizer_from_json(data.get("pre_tokenizer"), where),
            byte_fallback=bool(model.get("byte_fallback", False)), unk_token=model.get("unk_token"),
            fuse_unk=bool(model.get("fuse_unk", False)), ignore_merges=bool(model.get("ignore_merges", False)),
            decoder=decoder_from_json(data.get("decoder"), where), bos_token=bos_of(data.get("post_processor"), where))
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if text.startswith(str(where)) else f"{where}: {text}") from None


def load_hf(cls, path, data: dict | None = None):
    """A SentencePiece-style tokenizer.json (and the tokenizer_config.json beside it, if any) as `cls`
    (SentencePieceTokenizer); `data`: the file's JSON when already read."""
    from logitlab.tokenizer.chat import read_hf_chat_template

    path = Path(path)
    data = _read_json(path, "tokenizer.json") if data is None else data
    vocab, merges = _model(_field(data, "model", dict, path), path)
    config = config_from_json(data, path)
    added = _added_tokens(data.get("added_tokens"), path)
    roles = {"bos_token": config.bos_token} if config.bos_token else {}
    settings = _tokenizer_config(path.parent)
    if settings:
        post = data.get("post_processor") is not None
        config, added, roles = _as_transformers_reads(settings, config, added, vocab, post, path)
    try:
        tok = cls(vocab, merges, config, added, roles)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    tok.chat_template = read_hf_chat_template(path.parent)
    return tok


# ------------------------------------------------------------------------------ tokenizer_config.json
def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    data = _read_json(path, "tokenizer_config.json")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _name(value) -> str | None:
    """A special token as tokenizer_config.json names it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


# What transformers' tokenizer classes that rebuild the pipeline build, from the settings of
# tokenizer_config.json (their __init__ arguments, with their defaults).
def _llama_steps(settings: dict, config: SentencePieceConfig) -> SentencePieceConfig:
    prefix = settings.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if settings.get("legacy") else "first") if prefix else "never"
    return SentencePieceConfig(normalizer=(), pre_tokenizer=Metaspace(SPACE, scheme, False), byte_fallback=True,
                               unk_token=None, fuse_unk=True, decoder=LLAMA_DECODER if prefix else LLAMA_DECODER[:3],
                               bos_token=config.bos_token)


def _gemma_steps(settings: dict, config: SentencePieceConfig) -> SentencePieceConfig:
    return SentencePieceConfig(normalizer=(Replace(" ", SPACE),), pre_tokenizer=SplitAfter(" "), byte_fallback=True,
                               unk_token=_name(settings.get("unk_token")) or "<unk>", fuse_unk=True,
                               decoder=LLAMA_DECODER[:3], bos_token=config.bos_token)


REBUILT_CLASSES = {  # tokenizer_class -> (its steps, its default special tokens)
    "LlamaTokenizer": (_llama_steps, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "GemmaTokenizer": (_gemma_steps, {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                                      "pad_token": "<pad>", "mask_token": "<mask>"}),
}


def _as_transformers_reads(settings: dict, config, added, vocab, has_post_processor: bool, where):
    """(config, added tokens, roles) as AutoTokenizer (transformers 5) builds them from
    tokenizer_config.json: a rebuilt class's steps; the file's added tokens, those the config
    declares and the named special tokens; add_bos_token only for a file without a post-processor."""
    cls = str(settings.get("tokenizer_class") or "").removesuffix("Fast")
    rebuild, defaults = REBUILT_CLASSES.get(cls, (None, {}))
    roles = {k: _name(settings[k]) if k in settings else defaults.get(k) for k in ROLE_NAMES}
    roles = {k: v for k, v in roles.items() if v is not None}
    if rebuild is not None:
        config = rebuild(settings, config)
        if config.unk_token is not None and config.unk_token not in vocab:
            config = _replace(config, unk_token=None)
    known = {t.content for t in added}
    for t in _declared(settings, Path(where).parent / "tokenizer_config.json"):
        if t.content not in known:
            added.append(t)
            known.add(t.content)
    extra = [_name(t) for key in ("additional_special_tokens", "extra_special_tokens")
             for t in (settings.get(key) if isinstance(settings.get(key), list) else [])]
    for token in [*roles.values(), *extra]:  # named special tokens become added tokens, as transformers adds them
        if token and token not in known and token in vocab:
            added.append(AddedToken(token, vocab[token], special=True, normalized=False))
            known.add(token)
    roles = {k: v for k, v in roles.items() if v in known or v in vocab}
    if not has_post_processor:  # transformers builds one from add_bos_token / add_eos_token
        if settings.get("add_eos_token"):
            raise ValueError(f"{where}: tokenizer_config.json has add_eos_token: true (an end-of-sequence token "
                             f"after every text); logitlab's encode adds at most a BOS token before it")
        config = _replace(config, bos_token=roles.get("bos_token") if settings.get("add_bos_token") else None)
    return config, list(added), roles


def _declared(settings: dict, where: Path) -> list[AddedToken]:
    """tokenizer_config.json's added_tokens_decoder: {"32000": {"content": ..., "special": ...}}."""
    declared = settings.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ValueError(f"{where}: added_tokens_decoder must be an object id -> token")
    entries = []
    for i, t in declared.items():
        if not str(i).isdigit() or not isinstance(t, dict):
            raise ValueError(f"{where}: added_tokens_decoder entry {i!r} must be an id with a token object")
        entries.append({**t, "id": int(i)})
    return _added_tokens(entries, where)


def _replace(config: SentencePieceConfig, **changes) -> SentencePieceConfig:
    from dataclasses import replace

    return replace(config, **changes)


# ------------------------------------------------------------------------------ writing tokenizer.json
def hf_json(tok) -> dict:
    config = tok.config
    post = template_processing(config.bos_token, tok.bos_id)
    steps = config_to_json(config)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": t.id, "content": t.content, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": t.normalized, "special": t.special}
                         for t in sorted(tok.added_tokens, key=lambda t: t.id)],
        "normalizer": steps["normalizer"], "pre_tokenizer": steps["pre_tokenizer"], "post_processor": post,
        "decoder": steps["decoder"],
        "model": {"type": "BPE", "dropout": None, "unk_token": config.unk_token, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": config.fuse_unk, "byte_fallback": config.byte_fallback,
                  "ignore_merges": config.ignore_merges,
                  "vocab": dict(sorted(tok.pieces.items(), key=lambda kv: kv[1])),
                  "merges": [[a, b] for a, b in tok.merges]},
    }


def save_hf(tok, path) -> None:
    write_file(path, json.dumps(hf_json(tok), ensure_ascii=False, indent=1) + "\n", HF)


# ------------------------------------------------------------------------------ logitlab JSON
def fingerprint(tok) -> str:
    """sha256 over everything that decides ids: steps, vocabulary, merges, added tokens (16 hex digits)."""
    data = hf_json(tok)
    data.pop("version")
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def save_logitlab(tok, path) -> None:
    """logitlab's JSON (the tokenizer.json object, the roles, the chat template) and `<stem>.vocab`:
    one line per id with its piece, and what it is (a byte, a special token, a merge's parts)."""
    path = Path(path)
    listing = path.with_suffix(".vocab")
    if listing == path:
        raise ValueError(f"cannot save the tokenizer as {path}: the readable listing goes beside it as "
                         f"<name>.vocab, so the tokenizer file needs another suffix (e.g. {path.with_suffix('.json')})")
    data = {"format": "logitlab-tokenizer", "version": 1, "kind": tok.kind, "vocab_size": tok.vocab_size,
            "tokenizer_json": hf_json(tok), "roles": tok.roles, "fingerprint": tok.fingerprint()}
    if tok.chat_template is not None:
        data["chat_template"] = tok.chat_template
    check_target(path, LOGITLAB)
    check_target(listing, LISTING)
    write_file(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n", LOGITLAB)
    write_file(listing, "\n".join(listing_lines(tok)) + "\n", LISTING)


def listing_lines(tok) -> list[str]:
    from logitlab.tokenizer.formats import readable_token

    made_by = {a + b: (a, b) for a, b in tok.merges}
    lines = []
    for i in range(tok.vocab_size):
        piece = tok.piece(i)
        line = f"{i}\t[{readable_token(piece.encode())}]"
        if tok.is_special(i):
            line += "\tspecial"
        elif byte_of_piece(piece) is not None:
            line += f"\tbyte {byte_of_piece(piece):02x}"
        elif piece in made_by:
            a, b = made_by[piece]
            line += f"\t<- [{readable_token(a.encode())}] [{readable_token(b.encode())}]"
        lines.append(line)
    return lines


def load_logitlab(cls, data: dict, path):
    """A logitlab JSON file's parsed `data` ("kind": "sentencepiece") as `cls`."""
    inner = _field(data, "tokenizer_json", dict, path)
    vocab, merges = _model(_field(inner, "model", dict, path), path)
    roles = data.get("roles") or {}
    if not isinstance(roles, dict):
        raise ValueError(f"{path}: field 'roles' must be an object")
    try:
        tok = cls(vocab, merges, config_from_json(inner, path),
                                     _added_tokens(inner.get("added_tokens"), path), roles)
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
    return tok
