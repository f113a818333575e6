"""Build hook for the optional native parts; all other metadata lives in pyproject.toml.

- logitlab.tokenizer._bpe_fast: the BPE merge loop (the tokenizer trainer's pure-Python path
  without it);
- logitlab.quant._int8dot: int8 x int8 products for quantized layers, with OpenMP threads (the
  quant.routes "int8dot" route; the other routes without it).

`optional=True`: without a C compiler (or, for _int8dot, without OpenMP) the install still
succeeds and the pure-Python or torch paths run instead."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("logitlab.tokenizer._bpe_fast", ["logitlab/tokenizer/_bpe_fast.c"],
              extra_compile_args=["-O3"], optional=True),
    Extension("logitlab.quant._int8dot", ["logitlab/quant/_int8dot.c"],
              extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"], extra_link_args=["-fopenmp"],
              optional=True),
])
