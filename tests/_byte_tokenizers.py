"""Tiny byte-level tokenizer.json files of the published families' shapes, trained here with the
`tokenizers` library (nothing is downloaded). Each learns its merges from the Python standard
library's source plus a little text with digits, accents, CJK and emoji:

* "llama3": Llama 3's layout: BPE with ignore_merges, pre_tokenizer Split(cl100k's regex,
  Isolated) + ByteLevel(use_regex=false), the special tokens after the vocabulary, and the
  post_processor Sequence[ByteLevel, TemplateProcessing("<|begin_of_text|> $A")];
* "smollm2": SmolLM2's (and StarCoder's) layout: the special tokens first (<|endoftext|> is 0),
  pre_tokenizer Sequence[Digits(individual_digits=true), ByteLevel(use_regex=true)], a ByteLevel
  post_processor, and a vocabulary without the 21 byte tokens SmolLM2's lacks (SMOLLM2_MISSING);
* "qwen": Qwen2.5's layout: NFC, Split(Qwen's regex) + ByteLevel(use_regex=false), a ByteLevel
  post_processor (no BOS).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

CL100K = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
          r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
        r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS = "<|begin_of_text|>"
SMOLLM2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>"]
# The byte values SmolLM2's vocabulary has no token for (C0, C1, F1, F2, F5..FF: never in UTF-8 of
# an assigned code point; and six control characters)
SMOLLM2_MISSING = (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100))
# Llama 3's chat template (its turns, and bos_token before the first)
LLAMA3_TEMPLATE = ("{% for m in messages %}{% set content = '<|start_header_id|>' + m['role'] + "
                   "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
                   "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def corpus() -> list[str]:
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]:
        lines += path.read_text(encoding="utf-8", errors="replace")[:3000].splitlines()
    lines += ["In 2024, 1,234.56 units cost $78 (12% off) — x = 10; y=3.14e-5", "naïve café Ångström über",
              "日本語のテキスト 中文分词 한국어", "emoji 🎉🙂👍🏽", "'s 've 'll 12th 3rd"] * 3
    return [line for line in lines if line.strip()]


def _alphabet(missing=()):
    from tokenizers import pre_tokenizers

    gone = set(_printable(missing))
    return [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in gone]


def _printable(values) -> str:
    from logitlab.tokenizer.formats import bytes_to_unicode

    return "".join(bytes_to_unicode()[b] for b in values)


def build(kind: str, directory: Path, vocab_size: int = 700):
    """Write directory/tokenizer.json of `kind`; returns the `tokenizers.Tokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
    tok.decoder = decoders.ByteLevel()
    first, missing = [], ()
    if kind == "smollm2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        first, missing = SMOLLM2_SPECIALS, SMOLLM2_MISSING
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(CL100K if kind == "llama3" else QWEN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if kind == "qwen":
        tok.normalizer = normalizers.NFC()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=first, initial_alphabet=_alphabet(missing),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    if kind == "llama3":
        tok.add_special_tokens(LLAMA3_SPECIALS)
        bos = tok.token_to_id(BOS)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1",
                                          special_tokens=[(BOS, bos)])])
    else:
        if kind == "qwen":
            tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return tok


def write_config(directory: Path, **fields) -> None:
    """directory/tokenizer_config.json with `fields` (tokenizer_class PreTrainedTokenizerFast unless given)."""
    data = {"tokenizer_class": "PreTrainedTokenizerFast", **fields}
    (directory / "tokenizer_config.json").write_text(json.dumps(data))


def auto(directory):
    """transformers' AutoTokenizer for `directory`, quietly."""
    import warnings

    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(directory))
