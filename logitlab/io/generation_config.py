"""A Hugging Face model's own generation settings: its generation_config.json.

generation_config.py reads the fields logitlab uses (sampling defaults and the ids that end
generation) and checks their JSON types, naming the file and the field; the CLI turns them into the
defaults of generate, chat and serve (sample_defaults), which the command line and each request
override.
"""

from __future__ import annotations

import os
from pathlib import Path

from logitlab.io import model_dir

# generation_config.json fields logitlab reads, and the JSON types each may have
_GENERATION_FIELDS = {"do_sample": (bool,), "temperature": (int, float), "top_k": (int,), "top_p": (int, float),
                      "min_p": (int, float), "repetition_penalty": (int, float), "max_new_tokens": (int,),
                      "eos_token_id": (int, list), "bos_token_id": (int,), "pad_token_id": (int,)}


def read_generation_config(directory: str | os.PathLike) -> dict:
    """The fields of a directory's generation_config.json that logitlab uses (_GENERATION_FIELDS;
    others and nulls are left out), {} when there is none. A value of the wrong type is a
    ValueError naming the file and the field; the values themselves are checked where they are
    used (SampleConfig)."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    data = model_dir.read_json_object(path, "generation config")
    out = {}
    for key, types in _GENERATION_FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if isinstance(value, list):
            ok = all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        if not ok:
            raise ValueError(f"{path}: field {key!r} has {value!r}, expected "
                             f"{' or '.join('a list of ids' if t is list else t.__name__ for t in types)}")
        out[key] = value
    return out


# generation_config.json key -> the SampleConfig field it sets (do_sample: false makes temperature 0)
_SAMPLE_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_new_tokens"}


def sample_defaults(generation: dict) -> dict:
    """SampleConfig field values from a read_generation_config dict: its explicit values only (an
    absent one keeps logitlab's default); do_sample false, or absent as transformers reads it,
    means greedy (temperature 0). {} for a model without a generation_config.json."""
    if not generation:
        return {}
    out = {field: generation[key] for key, field in _SAMPLE_FIELDS.items() if generation.get(key) is not None}
    if not generation.get("do_sample", False):
        out["temperature"] = 0.0
    return out
