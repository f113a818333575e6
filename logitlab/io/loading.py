"""Any model a user can name, with its tokenizer and its own settings, in one call.

loading.py owns the step from a name to a model ready to run. The name is a run directory (its
latest checkpoint), a checkpoint or logitlab model directory, a Hugging Face directory, a hub id
ORG/NAME[@REVISION] (hub.py fetches it into the hub cache), or a GGUF file beside its tokenizer;
which kind it is comes from what is on disk. The result carries what generation needs besides
the weights: the tokenizer (with its chat template), the ids that end generation (end-of-text,
then the model's eos ids from config.json and generation_config.json), the model's
generation_config.json (generation_config.py) and where the model came from
(hub.Resolved.provenance(), recorded in runs and exports).
"""

from __future__ import annotations

import dataclasses
import os

from logitlab.io import checkpoint, generation_config, hf


@dataclasses.dataclass
class Loaded:
    """A model ready to run: weights (eval mode), tokenizer, the ids that end generation, where it
    came from and its generation_config.json fields ({} when there is none)."""

    model: object
    tokenizer: object
    end_ids: tuple[int, ...]  # end-of-text first, then the model's eos ids
    provenance: dict = dataclasses.field(default_factory=dict)
    generation: dict = dataclasses.field(default_factory=dict)
    pinned: str | None = None   # a name that loads exactly this model again (hub.Resolved.pinned)

    @property
    def eot_id(self) -> int | None:
        return self.end_ids[0] if self.end_ids else None


def is_hf_dir(path) -> bool:
    """A directory with a config.json that is not logitlab's own."""
    from pathlib import Path

    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and not checkpoint.is_logitlab_dir(p)


def load_model_and_tokenizer(spec: str | os.PathLike, revision: str | None = None, dtype=None,
                             device: str = "cpu", max_memory=None, mmap: bool = True) -> Loaded:
    """Any model (see the module docstring) with its tokenizer, in eval mode, cast to `dtype`
    (None keeps the stored dtype). A model whose weights need more than `max_memory` ("8GB",
    "512MiB" or bytes; default: what the machine has available) is refused before it is built,
    naming the field that drives the size (a hub id's before its weights are downloaded). A model
    without a tokenizer is a FileNotFoundError naming it. mmap (default True): the safetensors
    tensors kept as stored stay private mappings of the files (hf.load_pretrained's mmap; not for
    GGUF files)."""
    if str(spec).endswith(".gguf"):
        return load_gguf_and_tokenizer(spec, dtype, device, max_memory)
    resolved = hf.resolve_checked(spec, revision, dtype, device, max_memory)   # a hub id: its config first
    d = resolved.directory
    dtype = hf.parse_dtype(dtype)
    eos: list = []
    generation: dict = {}
    if is_hf_dir(d):
        model = hf.load_pretrained(d, dtype=dtype, device=device, max_memory=max_memory, mmap=mmap)
        tok = hf.load_tokenizer(d)
        if tok is None:
            raise FileNotFoundError(f"{spec}: no tokenizer.json, vocab.json + merges.txt, or "
                                    f"{checkpoint.TOKENIZER_FILE}")
        generation = generation_config.read_generation_config(d)
        for value in (hf.read_hf_config(d).get("eos_token_id"), generation.get("eos_token_id")):
            eos += [value] if isinstance(value, int) else list(value or [])
    else:
        model, tok = checkpoint.load_for_inference(d, device=device, dtype=dtype, max_memory=max_memory,
                                                   mmap=mmap)
        if tok is None:
            raise FileNotFoundError(f"{spec}: no {checkpoint.TOKENIZER_FILE} beside the model")
    end = [tok.eot_id] if tok.eot_id is not None else []
    end += [i for i in eos if isinstance(i, int) and i not in end and 0 <= i < model.config.vocab_size]
    return Loaded(model.eval(), tok, tuple(end), resolved.provenance(), generation, resolved.pinned())


def load_gguf_and_tokenizer(path: str | os.PathLike, dtype=None, device: str = "cpu", max_memory=None) -> Loaded:
    """A GGUF file (quant.gguf.load_gguf: its weights dequantized, float32 unless `dtype`) with the
    tokenizer of the directory it lies in (tokenizer.json, GPT-2 files or logitlab's own): the
    tokenizer inside the GGUF file is not read."""
    from pathlib import Path

    from logitlab.quant.gguf import load_gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    model = load_gguf(path, dtype=hf.parse_dtype(dtype), device=device, max_memory=max_memory)
    tok = hf.load_tokenizer(path.parent)
    if tok is None:
        raise FileNotFoundError(f"{path}: a GGUF file's own tokenizer is not read; put the model's tokenizer.json "
                                f"(or {checkpoint.TOKENIZER_FILE}) beside it in {path.parent}")
    end = [tok.eot_id] if tok.eot_id is not None else []
    return Loaded(model.eval(), tok, tuple(end), {"source": str(path.resolve())})
