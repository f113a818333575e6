"""Build hook for the optional native BPE merge loop; all other metadata lives in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and the tokenizer trainer uses
its pure-Python path."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("logitlab.tokenizer._bpe_fast", ["logitlab/tokenizer/_bpe_fast.c"],
                             extra_compile_args=["-O3"], optional=True)])
