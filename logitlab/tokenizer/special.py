"""Adding special tokens to a trained tokenizer, and the chat special tokens' names.

special.py owns the tokenizer's half of "new special tokens": a new Tokenizer with the same
ordinary vocabulary and merges, the old special tokens at their old ids, and each new special
token at the next free id (vocab_size, vocab_size + 1, ...). No existing id moves, so text that
holds none of the new strings encodes to the same ids as before, and a model trained on the old
ids reads them unchanged. The model's half (its visible vocabulary growing into padded rows of
the embedding and LM head, or an explicit resize) is logitlab.train.vocab's; the tokenizer knows
nothing of the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from logitlab.tokenizer.patterns import check_special_tokens

# ChatML's turn markers (the default chat template's, chat.py) and GPT-2's end of text.
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_SPECIAL_TOKENS = (IM_START, IM_END)


def add_special_tokens(tok, tokens: Iterable[str]):
    """-> (new Tokenizer, {token: id} of the tokens that were added).

    A token that is already a special token keeps its id and is not counted as added; one whose
    UTF-8 bytes are an ordinary token's is refused (it would change how that text encodes, and
    the ordinary id would become unreachable). The chat template is carried over."""
    wanted = check_special_tokens(list(tokens))
    if not wanted:
        raise ValueError("add_special_tokens: no tokens given")
    specials = dict(tok.special_tokens)
    added: dict[str, int] = {}
    next_id = tok.vocab_size
    for s in wanted:
        if s in specials:
            continue
        try:
            ordinary = tok.token_to_id(s.encode("utf-8"))
        except ValueError:
            ordinary = None
        if ordinary is not None:
            raise ValueError(f"special token {s!r} is already ordinary token {ordinary}; "
                             f"choose a string the vocabulary does not hold as one token")
        added[s] = specials[s] = next_id
        next_id += 1
    if getattr(tok, "kind", None) == "sentencepiece":  # the new ones as special added tokens
        new = tok.with_added_tokens(added)
    else:
        new = type(tok)(dict(tok._decoder), tok.merges, special_tokens=specials,
                        pattern=tok.pattern_name or tok.pattern, normalization=tok.normalization,
                        bos_token=tok.bos_token, drop_missing_bytes=bool(tok.missing_bytes))
    new.chat_template = getattr(tok, "chat_template", None)
    new.chat_template_origin = getattr(tok, "chat_template_origin", None)
    return new, added


def prefix_overlap(specials: Iterable[str]) -> bool:
    """True when one special token is a prefix of another: tiktoken's alternation order is then
    unspecified, so the Tokenizer cuts at special tokens itself (longest first)."""
    items = sorted(specials)
    return any(b.startswith(a) for a, b in zip(items, items[1:]))


def split_at_specials(text: str, rx, specials: dict[str, int]) -> Iterator[tuple[str, int | None]]:
    """(piece, None) for each stretch of ordinary text and ("", id) for each special token that
    `rx` (patterns.special_regex: leftmost, longest first) finds, in order."""
    start = 0
    if rx is not None:
        for m in rx.finditer(text):
            if m.start() > start:
                yield text[start:m.start()], None
            yield "", specials[m.group()]
            start = m.end()
    if start < len(text):
        yield text[start:], None


def place_specials(special_tokens, others: dict[int, bytes], next_id: int) -> dict[str, int]:
    """The Tokenizer's special tokens -> ids. `special_tokens`: None, a dict str -> id, or a list
    of strings, each looked up by its bytes among `others` (vocab entries that are neither bytes
    nor merge results) or else given the next id from `next_id` on. Every entry of `others` must
    be a special token, and no two special tokens may share an id."""
    if special_tokens is None:
        special_tokens = []
    if isinstance(special_tokens, dict):
        check_special_tokens(special_tokens)
        specials = {s: int(i) for s, i in special_tokens.items()}
    else:
        specials = {}
        by_bytes = {t: i for i, t in sorted(others.items(), reverse=True)}
        for s in check_special_tokens(special_tokens):
            i = by_bytes.get(s.encode("utf-8"))
            if i is None:
                i, next_id = next_id, next_id + 1
            specials[s] = i
    for i, tok in others.items():
        if i not in specials.values():
            raise ValueError(f"vocab id {i} ({tok!r}) is neither a byte, a merge result "
                             f"nor a special token")
    if len(set(specials.values())) != len(specials):
        raise ValueError(f"special tokens share ids: {specials}")
    return specials
