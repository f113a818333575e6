"""logitlab: a decoder-only Transformer toolkit, text -> ids -> logits -> text, every step visible.

This module only re-exports the public API. The names are resolved lazily (PEP 562), so
`import logitlab` imports neither torch nor anything else until a name is used, and it
chooses no device, dtype, thread count or seed (see train/runtime.py). Each stage is a sub-package
(tokenizer, model, kernels, io, data, train, parallel, generate, inspect, cli); docs/design.md maps them.
"""

from __future__ import annotations

from logitlab._exports import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it. The functions train.train and generate.generate are
# reached through their modules (`from logitlab import generate; generate.generate(...)`):
# re-exporting them here would shadow the submodules of the same names.
_EXPORTS = {
    "Tokenizer": "tokenizer",
    "SentencePieceTokenizer": "tokenizer",
    "train_bpe": "tokenizer",
    "train_tokenizer": "tokenizer",
    "ModelConfig": "model",
    "RopeScaling": "model",
    "Transformer": "model",
    "KVCache": "model",
    "get_preset": "model",
    "PRESETS": "model",
    "SampleConfig": "generate",
    "SamplingError": "generate",
    "stream": "generate",
    "TrainConfig": "train",
    "save_model": "io.checkpoint",
    "load_model": "io.checkpoint",
    "load_for_inference": "io.checkpoint",
    "load_pretrained": "io.hf",
    "save_pretrained": "io.hf",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
