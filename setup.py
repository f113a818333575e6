"""Build hook for the optional native parts; all other metadata lives in pyproject.toml.

- logitlab.tokenizer._bpe_fast: the BPE merge loop and GPT-2 pre-token counts (tokenizer/bpe.py);
- logitlab.data._text_fast: the cleaning filters' text counts (data/measures.py) and the exact-dedup
  normalisation of ASCII text (data/dedup.py).

`optional=True`: without a C compiler the install still succeeds, and each caller uses its
pure-Python path (same results, tested)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("logitlab.tokenizer._bpe_fast", ["logitlab/tokenizer/_bpe_fast.c"], extra_compile_args=["-O3"],
              optional=True),
    Extension("logitlab.data._text_fast", ["logitlab/data/_text_fast.c"], extra_compile_args=["-O3"],
              optional=True),
])
