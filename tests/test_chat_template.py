"""Chat templates: ChatML in plain Python equals its Jinja form; a Jinja template gives the ids
transformers' apply_chat_template gives for the same template and vocabulary; the template and
special tokens exported to tokenizer_config.json make AutoTokenizer apply the same template; and
chat_turns cuts a conversation into pieces that concatenate to it."""

from __future__ import annotations

import pytest

from logitlab.tokenizer.bpe import train_tokenizer
from logitlab.tokenizer.chat import (
    CHATML_TEMPLATE,
    GENERATION_PROMPT,
    apply_chat_template,
    chat_turns,
    read_hf_chat_template,
    render_chatml,
    write_hf_tokenizer_config,
)
from logitlab.tokenizer.special import add_special_tokens

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

TEXT = "The quick brown fox jumps over the lazy dog. What does len do? It returns the length.\n" * 30
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What does len do?"},
        {"role": "assistant", "content": "It returns the length."},
        {"role": "user", "content": "And the fox?"}]
# A Llama-2-like template that reads bos/eos and uses loop controls and raise_exception.
LLAMA_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + (sys + ' ' if loop.first and sys else '')"
    " + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "a.txt"
    path.write_text(TEXT)
    base = train_tokenizer(path, 300, ["<|endoftext|>"], workers=1)
    return add_special_tokens(base, ["<|im_start|>", "<|im_end|>"])[0]


def export(tok, directory):
    directory.mkdir()
    tok.save_hf(directory / "tokenizer.json")
    write_hf_tokenizer_config(tok, directory, model_max_length=64)
    return directory


def test_chatml_jinja_equals_the_plain_python_reference(tok):
    for gen in (False, True):
        tok.chat_template = CHATML_TEMPLATE
        jinja = apply_chat_template(tok, CHAT, gen, tokenize=False)
        tok.chat_template = None
        assert jinja == render_chatml(CHAT, gen) == tok.apply_chat_template(CHAT, gen, tokenize=False)


@pytest.mark.parametrize("template", [None, LLAMA_LIKE])
def test_ids_equal_transformers(tok, tmp_path, template):
    tok.chat_template = template
    try:
        directory = export(tok, tmp_path / "hf")
    finally:
        tok.chat_template = None
    assert read_hf_chat_template(directory) == (template or CHATML_TEMPLATE)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    tok.chat_template = template
    try:
        for gen in (False, True):
            ours = tok.apply_chat_template(CHAT, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert ours == list(theirs)
            assert tok.decode(ours) == hf.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
    finally:
        tok.chat_template = None


def test_explicit_tokenizer_file_with_the_same_template(tok, tmp_path):
    directory = export(tok, tmp_path / "hf")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    ids = fast.apply_chat_template(CHAT, chat_template=CHATML_TEMPLATE, add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert list(ids) == tok.apply_chat_template(CHAT, add_generation_prompt=True)


def test_chat_turns_concatenate_and_mark_the_generation_prompt(tok):
    turns = chat_turns(tok, CHAT[:3])
    roles = [r for r, _ in turns]
    assert roles == ["system", "user", GENERATION_PROMPT, "assistant"]
    assert sum((ids for _, ids in turns), []) == tok.apply_chat_template(CHAT[:3])
    assistant = dict(turns)["assistant"]
    assert tok.decode(assistant) == "It returns the length.<|im_end|>\n"
    assert tok.decode(dict(turns)[GENERATION_PROMPT]) == "<|im_start|>assistant\n"


def test_bad_messages_and_missing_specials_are_named(tok, tmp_path):
    with pytest.raises(ValueError, match="message 1: field 'content'"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="must be a list"):
        tok.apply_chat_template("hello")
    path = tmp_path / "a.txt"
    path.write_text(TEXT)
    plain = train_tokenizer(path, 280, ["<|endoftext|>"], workers=1)
    with pytest.raises(ValueError, match="add-special"):
        plain.apply_chat_template(CHAT)
    tok.chat_template = "{% for m in messages %}"
    try:
        with pytest.raises(ValueError, match="does not parse"):
            tok.apply_chat_template(CHAT)
        tok.chat_template = "{{ raise_exception('no system messages') }}"
        with pytest.raises(ValueError, match="no system messages"):
            tok.apply_chat_template(CHAT)
    finally:
        tok.chat_template = None


def test_fit_history_drops_the_oldest_turns_and_keeps_the_system(tok):
    from logitlab.tokenizer.chat import fit_history

    full = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert fit_history(tok, CHAT, len(full)) == (full, 0)
    ids, dropped = fit_history(tok, CHAT, len(full) - 1)
    assert dropped == 2          # the first user turn and its reply; the history restarts at a user turn
    assert ids == tok.apply_chat_template([CHAT[0], CHAT[3]], add_generation_prompt=True)
    with pytest.raises(ValueError, match="does not fit"):
        fit_history(tok, CHAT, 5)


def test_a_hf_directory_brings_its_template_back(tok, tmp_path):
    from logitlab.tokenizer.core import Tokenizer

    tok.chat_template = LLAMA_LIKE
    try:
        directory = export(tok, tmp_path / "hf")
    finally:
        tok.chat_template = None
    back = Tokenizer.from_hf(directory / "tokenizer.json")
    assert back.chat_template == LLAMA_LIKE and back.special_tokens == tok.special_tokens
    (directory / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="tokenizer_config.json: not JSON"):
        Tokenizer.from_hf(directory / "tokenizer.json")
