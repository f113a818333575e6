"""ids -> logits: ModelConfig (config.py), the block's parts (norms.py, rope.py, attention.py,
mlp.py; the block in layers.py), the Transformer (transformer.py), the KV cache (cache.py),
presets and Hugging Face config mapping (families.py), state-dict key maps (keymap.py) and exact
accounting (accounting.py). The model reads no files and imports nothing above itself."""

from logitlab.model.cache import KVCache
from logitlab.model.config import ModelConfig, RopeScaling
from logitlab.model.families import PRESETS, get_preset
from logitlab.model.transformer import Transformer

__all__ = ["KVCache", "ModelConfig", "PRESETS", "RopeScaling", "Transformer", "get_preset"]
