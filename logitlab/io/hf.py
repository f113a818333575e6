"""Hugging Face model directories: import, export, and verification against `transformers`.

hf.py owns the files of a Hugging Face checkpoint: config.json plus model.safetensors, sharded
safetensors (model.safetensors.index.json), or legacy pytorch_model.bin (read with
torch.load(weights_only=True): no code is ever unpickled). Loading checks the config's sizes, its
layer count against the files and the memory it needs before anything is built (the files'
tensors are listed and read by weights.py), then streams: names and shapes are checked before any
tensor is read, then each tensor is read once, cast, translated by the pure functions of
families.py and placed in turn. logitlab's own directories are handed to model_dir.py; a run
(its latest or best checkpoint, checkpoint.py) is exported with its tokenizer by export_hf. Writes
are atomic and never replace what logitlab did not write (files.atomic_directory).
`transformers` is imported only by verification.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from logitlab.io import checkpoint, files, hub, model_dir
from logitlab.io.hf_stream import check_hf_state, stream_model  # noqa: F401  (importable from here)
from logitlab.io.weights import (  # noqa: F401  (the layouts' file names, importable from here)
    SAFETENSORS,
    SAFETENSORS_INDEX,
    TORCH_BIN,
    TORCH_BIN_INDEX,
    WeightFiles,
    check_layers,
)
from logitlab.model import families, memory
from logitlab.model.transformer import ModelConfig, Transformer

# Largest |ours - transformers|, relative to max(1, max |transformers|), that verification accepts.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 1e-2}

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}") from None


def read_hf_config(directory: str | os.PathLike) -> dict:
    """The config.json of a directory as a dict; ValueError naming the file (line and column)
    when it is not valid JSON or not a JSON object."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    return model_dir.read_json_object(path, "config file")


def resolve_checked(spec, revision: str | None = None, dtype=None, device="cpu", max_memory=None):
    """hub.resolve_model, but for a hub id its config.json is fetched first and checked (its sizes
    bounded, its weights' memory estimated against max_memory) before any weight is downloaded:
    a model that cannot load is refused without fetching gigabytes. The estimate's dtype is
    `dtype`, else the one config.json declares (torch_dtype / dtype), else bf16 (two bytes: no
    floating checkpoint read here stores less). A local path is returned as it is."""
    if Path(spec).exists() or not hub.looks_like_hub_id(str(spec)):
        return hub.resolve_model(spec, revision)
    shape = hub.resolve_model(spec, revision, files=["config.json"]).directory
    if not model_dir.is_logitlab_dir(shape):
        raw, path = read_hf_config(shape), shape / "config.json"
        config = families.config_from_hf(raw, source=str(path))
        declared = raw.get("torch_dtype") or raw.get("dtype")
        target = parse_dtype(dtype) or (_DTYPES.get(declared) if isinstance(declared, str) else None) or torch.bfloat16
        from logitlab.model.hf_config_moe import hf_field_names

        memory.check_fits(config, target.itemsize, dtype=str(target).removeprefix("torch."), source=str(path),
                          names=hf_field_names(raw), max_memory=max_memory, device=device)
    return hub.resolve_model(spec, revision)


def read_hf_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory, whichever of the four layouts it uses (CPU; a
    .bin's may be memory-mapped). Loading a model streams instead (load_pretrained)."""
    files = WeightFiles(directory)
    return dict(files.tensors({k: k for k in files.shapes}))


def load_tokenizer(directory: str | os.PathLike, revision: str | None = None):
    """The tokenizer stored in a model directory (or of a hub id, hub.resolve_model), or None when
    there is none. Looked for in this order: tokenizer.json (Hugging Face: byte-level BPE as a
    Tokenizer, SentencePiece-style BPE as a SentencePieceTokenizer, read with the
    tokenizer_config.json beside it as transformers reads them), vocab.json + merges.txt (GPT-2),
    tokenizer.logitlab.json (logitlab's own, either kind). A file that is there but cannot be read
    raises ValueError naming it."""
    from logitlab.tokenizer.core import Tokenizer

    d = hub.resolve_model(directory, revision, files=hub.TOKENIZER_FILES).directory
    if (d / "tokenizer.json").is_file():
        return Tokenizer.from_hf(d / "tokenizer.json")
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return Tokenizer.from_gpt2_files(d / "vocab.json", d / "merges.txt")
    if (d / model_dir.TOKENIZER_FILE).is_file():
        return Tokenizer.load(d / model_dir.TOKENIZER_FILE)
    return None


def load_pretrained(directory: str | os.PathLike, verify: bool = False, dtype=None,
                    device: str | torch.device = "cpu", revision: str | None = None,
                    max_memory=None, mmap: bool = True) -> Transformer:
    """Load a Hugging Face directory (families.SUPPORTED_ARCHITECTURES), a logitlab one, or a hub id
    (`load_pretrained("gpt2")`, `"Qwen/Qwen3-0.6B@main"`, or revision=...), which hub.resolve_model
    fetches into the hub cache first.

    dtype None keeps the stored dtype. Before anything is built, the config's sizes are bounded
    (config.SIZE_LIMITS), its layer count is checked against the layers the files hold, and the
    weights' memory in the dtype asked for is estimated from the config's numbers: more than
    `max_memory` ("8GB", "512MiB" or bytes; default: what the machine has available) is refused,
    naming the field that drives the size, its value, the estimate and what would fit.
    A Hugging Face checkpoint is then streamed: names and shapes are checked from the file headers,
    each tensor is read once, cast to `dtype` as it arrives (a large one in slices of rows, into its
    final storage), moved to `device`, converted and placed, so the peak is about the loaded model
    plus the tensors in flight (never the file and a converted copy together). A floating tensor
    that holds NaN or inf is refused before the model is returned, naming its file and key.

    mmap=True (the default): a safetensors tensor kept as stored (same dtype, not transposed or
    split: the embeddings, o_proj, down_proj, the head, and the parts of the fused q/k/v and gate/up
    projections, laid out side by side from mappings of their pages) is not copied but left as a private,
    copy-on-write mapping of the file's bytes, as transformers and llama.cpp leave their weights:
    loading skips zeroing and filling fresh memory for it, and the pages are the page cache's,
    shared with the file and with every process that maps it. Writes to the model (training) copy
    the pages they touch and never reach the file. The file must then stay as it is while the model
    lives: replacing it by a rename (how logitlab, huggingface_hub and most tools write) or deleting
    it is safe, but truncating it in place kills the process with SIGBUS on the next touch of a page
    past the new end (even a page the model had written), rewriting it in place changes the weights
    that no write had copied yet, and a network filesystem that fails a read does the same as a
    truncation. mmap=False (`--no-mmap`) reads every tensor into memory the model owns, which never
    depends on the files again. verify=True runs
    `verify_against_transformers` on the directory and raises ValueError when any hidden state or
    the logits differ beyond TOLERANCE."""
    directory = resolve_checked(directory, revision, dtype, device, max_memory).directory
    dtype = parse_dtype(dtype)
    if model_dir.is_logitlab_dir(directory):
        model = model_dir.load_model(directory, device=device, dtype=dtype, max_memory=max_memory, mmap=mmap)
    else:
        model = _load_hf(directory, dtype, device, max_memory, mmap)
    model.eval()
    if verify:
        native = model_dir.is_logitlab_dir(directory)   # then compare with its own HF export
        report = verify_against_transformers(model, None if native else directory)
        if not report["ok"]:
            raise ValueError(f"{directory}: logitlab disagrees with transformers: {format_report(report)}")
    return model


def _load_hf(directory: Path, dtype, device, max_memory, mapped: bool = False) -> Transformer:
    """A Hugging Face directory, checked in the order that costs least: the config's types and
    bounds, its layer (and expert) count against the file headers, the memory estimate; then built
    and read."""
    from logitlab.model.config import SIZE_LIMITS
    from logitlab.model.hf_config_moe import hf_field_names
    from logitlab.model.keymap import hf_layer_indices
    from logitlab.model.keymap_moe import hf_expert_indices

    path = directory / "config.json"
    raw = read_hf_config(directory)
    config = families.config_from_hf(raw, source=str(path))
    weights = WeightFiles(directory)
    names = hf_field_names(raw)
    extra = range(config.n_layers, config.n_layers + int(raw.get("num_nextn_predict_layers") or 0))
    layers = {i for i in hf_layer_indices(weights.shapes) if i not in extra}   # DeepSeek's MTP layers: not loaded
    check_layers(layers, config.n_layers, names["n_layers"], path, weights.describe())
    if config.is_moe:     # before one name per expert and layer is made (hf_stream.check_hf_state)
        held = hf_expert_indices(weights.shapes, SIZE_LIMITS["n_experts"] + 1)
        check_layers(held, config.n_experts, names["n_experts"], path, weights.describe(), kind="experts")
    target = dtype or weights.stored_dtype()
    memory.check_fits(config, target.itemsize, dtype=str(target).removeprefix("torch."), source=str(path),
                      names=names, max_memory=max_memory, device=device)

    return stream_model(weights, config, str(directory), dtype, device, mapped)


def _unwrap(model):
    model = getattr(model, "_orig_mod", model)    # torch.compile
    return getattr(model, "module", model)         # DDP / FSDP wrappers


def write_hf_files(model, directory: str | os.PathLike, tokenizer=None) -> None:
    """Write config.json + model.safetensors of `model` into an existing directory, and with a
    tokenizer its tokenizer.json, tokenizer_config.json and special_tokens_map.json (what
    AutoTokenizer reads); save_pretrained is the atomic entry point."""
    from safetensors.torch import save_file

    model = _unwrap(model)
    config: ModelConfig = model.config
    from logitlab.quant.apply import quantization_of

    if quantization_of(model) is not None:
        raise ValueError(f"the model's weights are quantized ({quantization_of(model).label}): a Hugging Face "
                         "directory holds dense weights; export the model before quantizing it")
    dtype = next(model.parameters()).dtype
    hf_config = families.config_to_hf(config, dtype=str(dtype).removeprefix("torch."))
    # Always written: left out, transformers falls back to its class defaults (GPT-2: 50256,
    # Llama: 1 and 2), ids that are another token here or lie outside a small vocabulary, so
    # generate stops on a wrong token or never. Without a tokenizer's end-of-text id the model
    # has none that we know of: null, and transformers' generate runs to max_new_tokens.
    eot = tokenizer.eot_id if tokenizer is not None else None
    end_of_turn = tokenizer.special_tokens.get("<|im_end|>") if tokenizer is not None else None
    # a chat model ends its turn with <|im_end|>: transformers' generate stops on either
    eos = [end_of_turn, eot] if end_of_turn is not None and eot is not None else eot
    bos = tokenizer.bos_id if tokenizer is not None else None  # <s> of a SentencePiece-style tokenizer
    hf_config.update(bos_token_id=eot if bos is None else bos, eos_token_id=eos)
    state = families.state_dict_to_hf(model.state_dict(), config)
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    directory = Path(directory)
    save_file(state, str(directory / SAFETENSORS), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if tokenizer is not None:
        from logitlab.tokenizer.chat import write_hf_tokenizer_config

        tokenizer.save_hf(directory / "tokenizer.json")
        # the chat template (when the tokenizer has one, or ChatML's markers) and the special tokens
        write_hf_tokenizer_config(tokenizer, directory, config.context_length)


HF_KIND = "Hugging Face model"


def check_exportable(config: ModelConfig, source: str | os.PathLike | None = None) -> None:
    """ValueError, before anything is read or written, when no Hugging Face class holds `config`.
    The training recipe's options (keymap.features_without_hf_class: value embeddings, ReLU² MLPs,
    soft-capped logits...) are named together in one line with what to do instead; any other
    refusal is families.config_to_hf's, naming its field. source: the run or model directory the
    config came from, named in the message."""
    found = families.features_without_hf_class(config)
    if found:
        has = families.listed(found)
        what, keep = ((f"{source}", f"keep using {source} as it is (generate, chat, serve, eval and inspect all "
                       "load it)") if source is not None else
                      ("this model", "save it with logitlab.save_model (every logitlab command loads that directory)"))
        raise ValueError(f"cannot export {what} to Hugging Face: its model has {has}, which no Hugging Face class "
                         f"that logitlab writes has a place for; {keep}, or train with --recipe none "
                         f"(`logitlab train --recipe none`, `logitlab demo --recipe none`) for a model that exports")
    families.config_to_hf(config)


def save_pretrained(model, directory: str | os.PathLike, tokenizer=None, *, overwrite: bool = False,
                    source: str | os.PathLike | None = None) -> Path:
    """Atomically write config.json + model.safetensors that transformers.AutoModelForCausalLM
    loads as the matching class (families.hf_architecture). A tied head is stored once, as the
    embedding, as Hugging Face expects. A logitlab Tokenizer, when given, goes in as tokenizer.json
    with the two files AutoTokenizer also reads (write_hf_files).

    `directory` must be new or empty, or (overwrite=True) a Hugging Face directory that logitlab
    wrote: then only logitlab's files are replaced and every other file there is kept. It may not
    be `source` (the directory the model came from) or contain it. A model no Hugging Face class
    holds is refused before anything is written (check_exportable)."""
    check_exportable(_unwrap(model).config, source)
    with files.atomic_directory(directory, HF_KIND, overwrite=overwrite, source=source) as tmp:
        write_hf_files(model, tmp, tokenizer)
    return Path(directory)


def export_hf(run_dir: str | os.PathLike, out_dir: str | os.PathLike, which: str = "latest", *,
              overwrite: bool = False) -> Path:
    """Model + tokenizer.json, tokenizer_config.json, special_tokens_map.json (save_pretrained),
    so transformers' AutoModelForCausalLM and AutoTokenizer load the directory. `out_dir` must be
    new or empty (it may lie inside the run), or with overwrite=True an export logitlab wrote."""
    check_exportable(model_dir.read_model_config(checkpoint.resolve_model_dir(run_dir, which)), run_dir)
    files.check_output_dir(out_dir, HF_KIND, overwrite=overwrite, source=run_dir)  # before loading anything
    model, tokenizer = checkpoint.load_for_inference(run_dir, which)
    return save_pretrained(model, out_dir, tokenizer, overwrite=overwrite, source=run_dir)


def _load_transformers_model(directory, dtype: torch.dtype):
    """transformers' model of `directory`, loaded without its progress bar (a report of ours
    follows; the bar's carriage returns would land in it). The bar's setting is restored after."""
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise ImportError("verifying against transformers needs it: pip install 'logitlab[hf]'",
                          name="transformers") from exc
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), attn_implementation="eager", **{key: dtype}).eval()
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@torch.no_grad()
def verify_against_transformers(model: Transformer, hf_dir_or_model=None,
                                ids: torch.Tensor | None = None) -> dict:
    """Run `model` and the transformers model on the same ids and compare.

    hf_dir_or_model: a Hugging Face directory, a transformers model, or None (export `model` to a
    temporary directory and load that). ids default: 2 x 16 seeded random ids.
    -> {"hidden": [max |diff| of hidden state i, i = 0..L], "logits": max |diff|, "scale":
        max |logits|, "tolerance", "ok", "dtype"} (hidden[L] has the final norm applied)."""
    import tempfile

    model = _unwrap(model).eval()
    param = next(model.parameters())
    cfg = model.config
    if ids is None:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (2, min(16, cfg.context_length)), generator=gen)
    ids = ids.to(param.device)
    with tempfile.TemporaryDirectory() as tmp:
        if hf_dir_or_model is None:
            save_pretrained(model, Path(tmp) / "hf")
            hf_dir_or_model = Path(tmp) / "hf"
        hf_model = (hf_dir_or_model if isinstance(hf_dir_or_model, torch.nn.Module)
                    else _load_transformers_model(hf_dir_or_model, param.dtype))
        hf_model = hf_model.to(param.device)
        ref = hf_model(input_ids=ids, output_hidden_states=True)
    logits, hidden = model.forward_with_hidden(ids)
    if len(hidden) != len(ref.hidden_states):
        raise ValueError(f"logitlab returns {len(hidden)} hidden states, "
                         f"transformers {len(ref.hidden_states)}")
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(hidden, ref.hidden_states)]
    ref_logits = ref.logits[..., :cfg.vocab_size].float()
    logit_diff = float((logits.float() - ref_logits).abs().max())
    scale = max(1.0, float(ref_logits.abs().max()))
    tol = TOLERANCE.get(param.dtype, 1e-4)
    ok = all(d <= tol * max(1.0, float(h.float().abs().max())) for d, h in zip(diffs, ref.hidden_states))
    ok = ok and logit_diff <= tol * scale
    return {"hidden": diffs, "logits": logit_diff, "scale": scale, "tolerance": tol, "ok": ok,
            "dtype": str(param.dtype).removeprefix("torch."), "ids_shape": tuple(ids.shape)}


def format_report(report: dict) -> str:
    layers = ", ".join(f"{i}: {d:.2e}" for i, d in enumerate(report["hidden"]))
    return f"max |diff| per hidden state {{{layers}}}; logits {report['logits']:.2e}"
