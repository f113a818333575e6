"""logitlab: a decoder-only Transformer toolkit, text -> ids -> logits -> text, every step visible.

This module only re-exports the public API; importing it has no side effects (no device,
dtype, thread or seed is chosen here: see runtime.py).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
