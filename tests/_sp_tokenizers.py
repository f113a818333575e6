"""Tiny SentencePiece-style tokenizer.json files, trained here with the `tokenizers` library.

Three kinds, as the model families ship them:
* "llama": Llama-2 / Mistral-v0.1 / TinyLlama's older files: normalizer Prepend("▁") +
  Replace(" ", "▁"), no pre-tokenizer, decoder Replace + ByteFallback + Fuse + Strip, <s> added;
* "metaspace": newer files: a Metaspace pre-tokenizer (prepend_scheme "first", split false) in
  place of the normalizer;
* "gemma": normalizer Replace(" ", "▁") only, no Strip, <bos> added, Gemma's special tokens, and
  merges learned across "▁" (so pieces hold "▁" inside, as "x▁" does).

Each has <unk> and the 256 byte tokens <0x00>..<0xFF> in its BPE vocabulary (byte fallback), and
learns its pieces from the Python standard library's source plus a little non-ASCII text, with a
small alphabet, so that most CJK and emoji characters fall back to bytes.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

KINDS = ("llama", "metaspace", "gemma")
SPECIALS = {"llama": ["<unk>", "<s>", "</s>"], "metaspace": ["<unk>", "<s>", "</s>"],
            "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]}
BOS = {"llama": "<s>", "metaspace": "<s>", "gemma": "<bos>"}
EOS = {"llama": "</s>", "metaspace": "</s>", "gemma": "<eos>"}


def corpus() -> list[str]:
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]:
        lines += path.read_text(encoding="utf-8", errors="replace")[:3000].splitlines()
    lines += ["naïve café über señor — “quoted” 日本語のテキスト 中文 🎉🙂"] * 3
    return [line for line in lines if line.strip()]


def _learned(kind: str, vocab_size: int) -> tuple[dict[str, int], list]:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "gemma":
        tok.normalizer = normalizers.Replace(" ", "▁")  # one word per line: pieces may hold "▁" inside
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], limit_alphabet=90, show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def build(kind: str, directory: Path, vocab_size: int = 700, byte_fallback: bool = True):
    """Write directory/tokenizer.json of `kind`; returns the `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    learned, merges = _learned(kind, vocab_size)
    specials = SPECIALS[kind]
    vocab = {s: n for n, s in enumerate(specials)}
    if byte_fallback:
        vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece in sorted(learned, key=learned.get):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                               byte_fallback=byte_fallback))
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if kind == "llama":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(steps if kind == "gemma" else [*steps, decoders.Strip(" ", 1, 0)])
    bos = BOS[kind]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab[bos])])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return tok


def write_config(directory: Path, kind: str, **settings) -> None:
    """A tokenizer_config.json naming the kind's special tokens, plus `settings`."""
    config = {"bos_token": BOS[kind], "eos_token": EOS[kind], "unk_token": "<unk>", **settings}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
