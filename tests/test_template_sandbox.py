"""The chat-template sandbox (tokenizer/sandbox.py, sizes.py): a template from a model directory
cannot cost more than its TemplateLimits. Memory and time bombs run in a subprocess under an
address-space limit and a timeout, so that a regression fails the test instead of the machine;
each bound is checked alone with small limits; refused statements and template errors become a
ValueError naming the template's file; and templates within the bounds render exactly as jinja2's
own sandbox renders them (the reference)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

jinja2 = pytest.importorskip("jinja2")

from logitlab.tokenizer.chat import ChatTemplateError, render  # noqa: E402
from logitlab.tokenizer.core import Tokenizer  # noqa: E402
from logitlab.tokenizer.sandbox import BoundedEnvironment, TemplateLimits  # noqa: E402
from logitlab.tokenizer.sizes import format_size, size_of  # noqa: E402

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "what is 2 + 2?"}]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens={"<|endoftext|>": 256})


def with_template(template: str) -> Tokenizer:
    tok = byte_tokenizer()
    tok.chat_template = template
    return tok


# -------------------- bombs, in a subprocess under RLIMIT_AS

BOMBS = {
    "repeat": "{{ 'x' * 4000000000 }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "in a macro's buffer": "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx"
                           "{% endfor %}{% endfor %}{% endmacro %}{% set s = m() %}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling with +": "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "center": "{{ 'x'|center(4000000000) }}",
    "ljust": "{{ 'x'.ljust(4000000000) }}",
    "% width": "{{ '%4000000000d' % 1 }}",
    "format width": "{{ '{:>999999999}{:>999999999}'.format(1, 2) }}",
    "power": "{{ 7 ** 1000000000 }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "replace": "{{ ('x' * 2000000)|replace('x', 'yyyyyyyyyyyyyyyy') }}",
    "join a repeated list": "{{ (['x' * 2000000] * 4000)|join }}",
    "print a repeated list": "{{ ['x' * 2000000] * 4000 }}",
    "tojson with an indent": "{{ [[[[[[[[range(100000)|list]]]]]]]]|tojson(indent=100000) }}",
    "recursive macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive loop": "{% for x in [[[1, 2], [3]]] recursive %}{{ loop([x]) }}{% endfor %}",
    "include": "{% include 'tokenizer_config.json' %}",
    "import": "{% import 'x' as x %}",
}

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    limit = int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from logitlab.tokenizer.core import Tokenizer
    root, templates = Path(sys.argv[1]), json.loads(sys.argv[2])
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens={"<|endoftext|>": 256})
    chat = [{"role": "user", "content": "hi"}]
    for name, template in templates.items():
        folder = root / str(len(list(root.iterdir())))
        folder.mkdir()
        tok.save_hf(folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        loaded = Tokenizer.from_hf(folder / "tokenizer.json")
        try:
            out = ["rendered", len(loaded.apply_chat_template(chat, tokenize=False))]
        except BaseException as exc:
            out = [type(exc).__name__, str(exc)]
        print(json.dumps([name, str(folder / "tokenizer_config.json")] + out), flush=True)
""")


def run_bounded(tmp_path, templates: dict, memory: int = 768 << 20, timeout: float = 300) -> dict:
    """Render each template from a model directory of its own in one subprocess limited to
    `memory` bytes of address space -> name -> (its tokenizer_config.json, outcome, detail)."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), json.dumps(templates), str(memory)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {name: (config, outcome, detail) for name, config, outcome, detail in rows}


def test_bombs_in_a_model_directory_are_refused_naming_the_file(tmp_path):
    control = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"
    results = run_bounded(tmp_path, {"control": control, **BOMBS})
    assert results["control"][1:] == ("rendered", len("user: hi"))
    for name in BOMBS:
        config, outcome, detail = results[name]
        assert outcome == "ChatTemplateError", (name, outcome, detail)
        assert f"chat template {config}" in detail, (name, detail)
    nested = results["nested ranges"][2]
    assert "max_loop_steps" in nested or "max_seconds" in nested  # which comes first depends on the machine
    assert "4000000000" in results["repeat"][2]
    assert "max_call_depth" in results["recursive macro"][2] and "{% include %}" in results["include"][2]


# -------------------- each bound alone

@pytest.mark.parametrize("template, limits, bound", [
    ("{% for i in range(10) %}{% for j in range(10) %}{% endfor %}{% endfor %}", dict(max_loop_steps=50),
     "max_loop_steps"),
    ("{% for i in range(1001) %}{% endfor %}", dict(max_range=1000), "max_range"),
    ("{% for i in range(100) %}xxxxxxxxxx{% endfor %}", dict(max_output_chars=500), "max_output_chars"),
    ("{% set s %}{% for i in range(100) %}xxxxxxxxxx{% endfor %}{% endset %}", dict(max_output_chars=500),
     "max_output_chars"),  # text that is never printed still counts
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(20) }}", dict(max_call_depth=10),
     "max_call_depth"),
    ("{% macro a() %}{{ b() }}{% endmacro %}{% macro b() %}{{ a() }}{% endmacro %}{{ a() }}", {},
     "max_call_depth"),
    ("{{ 'ab' * 300 }}", dict(max_output_chars=500), "max_output_chars"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% if i == j %}{% endif %}{% endfor %}{% endfor %}",
     dict(max_seconds=0.05, max_loop_steps=10**12), "max_seconds"),
])
def test_each_bound_is_refused_with_its_name(template, limits, bound):
    with pytest.raises(ChatTemplateError, match=bound) as caught:
        render(with_template(template), CHAT, limits=TemplateLimits(**limits))
    assert not caught.value.raised and "chat template (the tokenizer's chat_template)" in str(caught.value)


def test_bounded_recursion_and_loops_within_the_limits_render():
    nested = ("{% macro show(x) %}{% if x is mapping %}{{ '{' }}{% for k, v in x|dictsort %}{{ k }}: {{ show(v) }}"
              "{% if not loop.last %}, {% endif %}{% endfor %}{{ '}' }}{% else %}{{ x }}{% endif %}{% endmacro %}"
              "{{ show({'a': {'b': {'c': 1}}, 'd': 2}) }}")
    assert render(with_template(nested), CHAT) == "{a: {b: {c: 1}}, d: 2}"
    steps = "{% for i in range(10) %}{% for j in range(10) %}.{% endfor %}{% endfor %}"
    assert render(with_template(steps), CHAT, limits=TemplateLimits(max_loop_steps=110)) == "." * 100


@pytest.mark.parametrize("template, refused", [
    ("{% extends 'base' %}", "{% extends %}"), ("{% include 'x' %}", "{% include %}"),
    ("{% import 'x' as y %}", "{% import %}"), ("{% from 'x' import y %}", "{% from ... import %}"),
])
def test_statements_that_load_templates_are_refused(template, refused):
    with pytest.raises(ChatTemplateError, match=f"{refused} .line 1. is not allowed"):
        render(with_template(template), CHAT)


def test_errors_inside_a_template_are_value_errors_naming_it(tmp_path):
    tok = byte_tokenizer()
    tok.save_hf(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 + 'a' }}"}))
    loaded = Tokenizer.from_hf(tmp_path / "tokenizer.json")
    with pytest.raises(ChatTemplateError, match=rf"chat template {tmp_path / 'tokenizer_config.json'} failed: "
                                                r"TypeError"):
        loaded.apply_chat_template(CHAT)
    loaded.chat_template = "{{ raise_exception('roles must alternate') }}"  # no longer the file's template
    with pytest.raises(ChatTemplateError, match=r"\(the tokenizer's chat_template\) refused the conversation: "
                                                r"roles must alternate") as caught:
        loaded.apply_chat_template(CHAT)
    assert caught.value.raised and isinstance(caught.value, ValueError)
    for escape in ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ lipsum(10) }}",
                   "{{ cycler.__init__.__globals__ }}", "{{ messages.append(1) }}"):
        with pytest.raises(ChatTemplateError):
            render(with_template(escape), CHAT)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_seconds must be a finite number > 0"):
        TemplateLimits(max_seconds=0)
    with pytest.raises(ValueError, match="max_range must be an integer >= 1"):
        TemplateLimits(max_range=True)


def test_sizes():
    assert size_of("abc", 100) == 3 and size_of(["ab", {"c": "de"}], 100) == 2 + 2 + 1 + 1 + 2
    big = ["x" * 1000] * 1000
    assert 1000 < size_of(big, 5000) <= 6000  # counting stops past the limit
    assert format_size("%5d|%s", (1, "abc"), 100) == len("%5d|%s") + 1 + 3 + 5
    assert format_size("%*d", (10**6, 1), 100) > 10**6


# -------------------- the reference: jinja2's own sandbox

FEATURES = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.role|upper }}{% if loop.first %}!"
    "{% endif %}{% if not loop.last %}, {% endif %}{% endfor %}",
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{{ ns.last }} {{ messages|selectattr('role', 'eq', 'user')|list|length }}",
    "{{ messages|map(attribute='content')|join(' | ') }} {{ messages[1:]|length }} {{ messages[::-1][0].role }}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% continue %}{% endif %}"
    "{{ m.content|trim|replace('i', 'I') }}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}",
    "{{ messages[0]|tojson }} {{ {'b': [1, 2], 'a': 'x'}|tojson(indent=2, sort_keys=True) }} "
    "{{ '%s-%03d' % ('a', 7) }}",
    "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}{{ bos_token }}"
    "{% endcall %}{% set block %}{{ eos_token ~ '|' ~ 3 }}{% endset %}{{ block * 2 }} {{ '{}:{}'.format(1, 'x') }}",
    "{%- for i in range(3) -%}\n  {{ i ** 2 }}{{ ',' if not loop.last }}\n{%- endfor %} {{ (range(5)|sum) // 2 }}"
    " {{ [3, 1, 2]|sort|first }} {{ none|default('d') }} {{ {'k': 'v'}.items()|list }} {{ 'a b'.split() }}",
    "{% for x in [[1, [2]], 3] recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}{{ x }}{% endif %}"
    "{% endfor %} {{ add_generation_prompt }} {{ undefined_name is defined }} {{ 'ab'|center(6) }}|",
]


@pytest.mark.parametrize("template", FEATURES, ids=range(len(FEATURES)))
def test_templates_within_the_bounds_render_as_jinja2s_sandbox_does(template):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from logitlab.tokenizer.chat import template_variables

    tok = with_template(template)
    options = dict(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    plain = ImmutableSandboxedEnvironment(**options)
    plain.filters["tojson"] = tojson = lambda x, indent=None, sort_keys=False: json.dumps(  # noqa: E731
        x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)
    variables = dict(messages=CHAT, add_generation_prompt=True, **template_variables(tok))
    want = plain.from_string(template).render(**variables)
    assert render(tok, CHAT, add_generation_prompt=True) == want
    bounded = BoundedEnvironment(filters={"tojson": tojson}, **options)
    assert bounded.render(bounded.compile_template(template), **variables) == want
