"""ids -> logits: ModelConfig (config.py), the block's parts (norms.py, rope.py, attention.py,
mlp.py; the block in layers.py), the Transformer (transformer.py), the KV cache (cache.py) and
the paged one (paged.py, paged_blocks.py), presets and Hugging Face config mapping (families.py),
state-dict key maps (keymap.py) and exact accounting (accounting.py). The model reads no files and
imports nothing above itself.

The names are resolved on first use (PEP 562), so importing the package, or one
module of it, imports nothing else of it."""

from __future__ import annotations

from logitlab._exports import lazy_exports

_EXPORTS = {
    "KVCache": "cache",
    "ModelConfig": "config",
    "PagedCache": "paged",
    "PRESETS": "families",
    "RopeScaling": "config",
    "Transformer": "transformer",
    "get_preset": "families",
}

__all__ = ["KVCache", "ModelConfig", "PagedCache", "PRESETS", "RopeScaling", "Transformer", "get_preset"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
