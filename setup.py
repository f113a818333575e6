"""Build hook for the optional native parts; all other metadata lives in pyproject.toml.

- logitlab.tokenizer._bpe_fast: the BPE merge loop and GPT-2 pre-token counts (tokenizer/bpe.py);
- logitlab.data._text_fast: the cleaning filters' text counts (data/measures.py) and the exact-dedup
  normalisation of ASCII text (data/dedup.py);
- logitlab.quant._int8dot: int8 x int8 products for quantized layers, with OpenMP threads (the
  quant.routes "int8dot" route; the other routes without it).

`optional=True`: without a C compiler (or, for _int8dot, without OpenMP) the install still
succeeds, and each caller uses its pure-Python or torch path (same results, tested)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("logitlab.tokenizer._bpe_fast", ["logitlab/tokenizer/_bpe_fast.c"], extra_compile_args=["-O3"],
              optional=True),
    Extension("logitlab.data._text_fast", ["logitlab/data/_text_fast.c"], extra_compile_args=["-O3"],
              optional=True),
    Extension("logitlab.quant._int8dot", ["logitlab/quant/_int8dot.c"],
              extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"], extra_link_args=["-fopenmp"],
              optional=True),
])
