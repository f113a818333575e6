"""logitlab: a decoder-only Transformer toolkit, text -> ids -> logits -> text, every step visible.

This module only re-exports the public API. The names are resolved lazily (PEP 562), so
`import logitlab` imports neither torch nor anything else until a name is used, and it
chooses no device, dtype, thread count or seed (see runtime.py).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it. The functions train.train and generate.generate are
# reached through their modules (`from logitlab import generate; generate.generate(...)`):
# re-exporting them here would shadow the submodules of the same names.
_EXPORTS = {
    "Tokenizer": "tokenizer",
    "train_bpe": "bpe",
    "train_tokenizer": "bpe",
    "ModelConfig": "model",
    "RopeScaling": "model",
    "Transformer": "model",
    "KVCache": "kv_cache",
    "get_preset": "families",
    "PRESETS": "families",
    "SampleConfig": "sampling",
    "SamplingError": "sampling",
    "stream": "generate",
    "TrainConfig": "train",
    "save_model": "checkpoint",
    "load_model": "checkpoint",
    "load_for_inference": "checkpoint",
    "load_pretrained": "hf",
    "save_pretrained": "hf",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'logitlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"logitlab.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
