"""Files on disk: file primitives (files.py: atomic directories that never replace what we did
not write, locks, JSON read with the file named), reading tensors once and lean (tensors.py:
safetensors opened so that errors name the file, read straight into their final memory),
logitlab's own model directory (model_dir.py), the weight files of a Hugging Face directory listed
before anything is read (weights.py), run checkpoints and loading for inference (checkpoint.py)
and Hugging Face directories (hf.py: import, export, verify).

Its modules are imported by name (`from logitlab.io import checkpoint`); this file imports none of
them, so that io.files, which every stage may use, never pulls in the rest."""

__all__ = ["checkpoint", "files", "hf", "model_dir", "tensors", "weights"]
