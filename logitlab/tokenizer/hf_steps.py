"""The steps around a tokenizer.json's BPE model that logitlab reads and writes itself: the
post-processor's BOS token (both kinds: formats.py for byte-level BPE, sp_files.py for
SentencePiece-style BPE) and the byte-level pre-tokenizers (formats.py).

Post-processor. `tokenizers` runs it on the ids of a text when asked to add special tokens (what
transformers' `add_special_tokens=True`, the default, asks). logitlab's `encode(text,
add_bos=True)` adds at most one token, before the text, so a post-processor is read as that token:

* none, or `ByteLevel` (it adjusts the offsets of the pieces and adds no token): no BOS token;
* `TemplateProcessing` whose `single` template is one special token then `$A` (Llama 3's
  <|begin_of_text|>, Mistral's and Llama-2's <s>): that token; `$A` alone: none;
* a `Sequence` of these: `ByteLevel` steps skipped, at most one `TemplateProcessing` (Llama 3's
  file has `[ByteLevel, TemplateProcessing]`).

Anything else is refused by name: a template with a token after the text (an end-of-sequence token)
or two before it, and the processors that add such tokens (`RobertaProcessing`, `BertProcessing`).
The `pair` template is not read (logitlab encodes one text at a time).

Byte-level pre-tokenizers. `ByteLevel` (use_regex: GPT-2's pattern) is pattern "gpt2";
`Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]` (Llama 3, Qwen, Mistral's
Tekken) is that regex; `Sequence[Digits(individual_digits=true), ByteLevel]` (StarCoder, SmolLM) is
"gpt2_digits" (patterns.py). Any other shape is refused by name.
"""

from __future__ import annotations

import json


# ------------------------------------------------------------------------------ post-processor
def bos_of(processor, where) -> str | None:
    """The token a tokenizer.json's post-processor puts before the text (None: none)."""
    if processor is None:
        return None
    steps = [processor]
    if isinstance(processor, dict) and processor.get("type") == "Sequence":
        steps = processor.get("processors") or []
    steps = [s for s in steps if not (isinstance(s, dict) and s.get("type") == "ByteLevel")]
    if not steps:
        return None
    if len(steps) != 1 or not isinstance(steps[0], dict) or steps[0].get("type") != "TemplateProcessing":
        raise ValueError(f"{where}: unsupported post_processor {json.dumps(processor)[:160]} (expected "
                         f"TemplateProcessing, ByteLevel, or a Sequence of them)")
    return _template_bos(steps[0], where)


def _template_bos(template: dict, where) -> str | None:
    single, specials = template.get("single") or [], template.get("special_tokens") or {}
    names = [item.get("SpecialToken", {}).get("id") for item in single if isinstance(item, dict)]
    if (len(single) not in (1, 2) or not isinstance(single[-1], dict) or "Sequence" not in single[-1]
            or (len(single) == 2 and names[0] is None)):
        raise ValueError(f"{where}: post_processor template {json.dumps(single)[:160]} is not supported: "
                         f"logitlab's encode(add_bos=True) puts at most one token before the text and none after")
    if len(single) == 1:
        return None
    tokens = (specials.get(names[0]) or {}).get("tokens") or [names[0]]
    if len(tokens) != 1:
        raise ValueError(f"{where}: post_processor special token {names[0]!r} stands for {len(tokens)} tokens")
    return tokens[0]


def checked_bos(processor, specials: dict[str, int], where) -> str | None:
    """`bos_of` for a byte-level file: the token must be an added token, at the id the template
    gives it (`tokenizers` puts the template's ids)."""
    bos = bos_of(processor, where)
    if bos is None:
        return None
    if bos not in specials:
        raise ValueError(f"{where}: the post_processor puts {bos!r} before the text, but it is not an added token")
    steps = processor.get("processors") or [] if processor.get("type") == "Sequence" else [processor]
    for step in steps:
        entry = (step.get("special_tokens") or {}).get(bos) if isinstance(step, dict) else None
        ids = entry.get("ids") if isinstance(entry, dict) else None
        if ids is not None and ids != [specials[bos]]:
            raise ValueError(f"{where}: the post_processor gives {bos!r} the ids {ids}, but it is token "
                             f"{specials[bos]}")
    return bos


def template_processing(bos: str | None, bos_id: int | None) -> dict | None:
    """The post-processor that puts `bos` before every text (None when there is no BOS token)."""
    if bos is None:
        return None
    return {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


# ------------------------------------------------------------------------------ byte-level pre-tokenizers
def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def byte_level_pre_tokenizer(pattern_name: str | None, pattern: str) -> dict:
    """The pre_tokenizer object for a byte-level tokenizer's split pattern."""
    if pattern_name == "gpt2":
        return _byte_level(True)
    if pattern_name == "gpt2_digits":
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)]}
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}, _byte_level(False)]}


def byte_level_pattern(pre, where) -> str:
    """A byte-level pre_tokenizer object -> the split pattern ("gpt2", "gpt2_digits" or a regex)."""
    if pre is None:
        raise ValueError(f"{where}: pre_tokenizer is null; byte-level BPE needs ByteLevel")
    if pre.get("type") == "ByteLevel":
        _check_byte_level(pre, True, where)
        return "gpt2"
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[1].get("use_regex", True):
        if not steps[0].get("individual_digits"):
            raise ValueError(f"{where}: pre_tokenizer Digits with individual_digits=false (digit runs kept "
                             f"whole) is not supported; individual_digits=true is")
        _check_byte_level(steps[1], True, where)
        return "gpt2_digits"
    if (kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True)
            and "Regex" in (steps[0].get("pattern") or {}) and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert")):
        _check_byte_level(steps[1], False, where)
        return steps[0]["pattern"]["Regex"]
    raise ValueError(f"{where}: unsupported pre_tokenizer {json.dumps(pre)[:200]} (expected ByteLevel, "
                     f"Split(regex, Isolated) followed by ByteLevel(use_regex=false), or "
                     f"Digits(individual_digits=true) followed by ByteLevel)")


def _check_byte_level(step: dict, use_regex: bool, where) -> None:
    if step.get("add_prefix_space") or step.get("use_regex", True) != use_regex:
        raise ValueError(f"{where}: ByteLevel pre_tokenizer with add_prefix_space={step.get('add_prefix_space')} "
                         f"and use_regex={step.get('use_regex', True)} is not supported here (a lone ByteLevel "
                         f"or one after Digits: add_prefix_space=false, use_regex=true; after Split: use_regex=false)")
