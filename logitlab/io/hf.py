"""Hugging Face model directories: import, export, and verification against `transformers`.

hf.py owns the files of a Hugging Face checkpoint: config.json plus model.safetensors, sharded
safetensors (model.safetensors.index.json), or legacy pytorch_model.bin (read with
torch.load(weights_only=True): no code is ever unpickled). Loading streams: names and shapes are
checked before any tensor is read, then each tensor is read, cast, translated by the pure functions
of families.py and placed in turn. logitlab's own directories are handed to model_dir.py; a run
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
from logitlab.model import families
from logitlab.model.transformer import ModelConfig, Transformer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"

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


class _WeightFiles:
    """The tensors of a Hugging Face directory, whichever of the four layouts it uses, listed
    before any is read: `shapes` (name -> shape, from the safetensors headers or a memory-mapped
    .bin) lets names and shapes be checked first, and `tensors(names)` then reads the wanted
    tensors one at a time, file by file, so a loader converts and drops each before the next.

    safetensors are read with pread(2) into fresh CPU tensors (safetensors releases without the
    `backend` option memory-map instead). A .bin is memory-mapped where torch's zip format allows
    (torch.load(mmap=True, weights_only=True): never unpickles code, and only the pages of tensors
    read become resident); this reader lets go of each file's map once its tensors are read, but a
    tensor the loader keeps as it is (no cast, no transpose) still points into the map, which then
    lives as long as the model."""

    def __init__(self, directory: str | os.PathLike):
        d = Path(directory)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._file_of: dict[str, Path] = {}        # tensor name -> the file that holds it
        self._bin: dict[Path, dict] = {}           # .bin file -> its (memory-mapped) tensors
        if (d / SAFETENSORS).is_file():
            self._add(d / SAFETENSORS)
            return
        for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
            if (d / index_name).is_file():
                weight_map = model_dir.read_json_object(d / index_name, "index file").get("weight_map")
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise ValueError(f"{d / index_name} has no weight_map (an object of tensor name -> file name)")
                for shard in sorted(set(weight_map.values())):
                    if not (d / shard).is_file():
                        raise FileNotFoundError(f"shard {shard} named in {d / index_name} is missing")
                    self._add(d / shard)
                missing = sorted(set(weight_map) - set(self.shapes))
                if missing:
                    raise ValueError(f"{d / index_name} lists tensors its shards lack: {missing[:5]}")
                return
        if (d / TORCH_BIN).is_file():
            self._add(d / TORCH_BIN)
            return
        raise FileNotFoundError(f"no weights in {d}: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                                f"{TORCH_BIN} or {TORCH_BIN_INDEX}")

    def _add(self, path: Path) -> None:
        if path.suffix == ".safetensors":
            with model_dir.open_safetensors(path) as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        else:
            import zipfile

            # tensors only, no code; a pre-1.6 (non-zip) file cannot be memory-mapped
            state = model_dir.load_torch_file(path, mmap=zipfile.is_zipfile(path))
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ValueError(f"{path}: expected a state dict (tensor name -> tensor), got {type(state).__name__}")
            self._bin[path] = state
            shapes = {k: tuple(v.shape) for k, v in state.items()}
        self.shapes.update(shapes)
        self._file_of.update(dict.fromkeys(shapes, path))

    def tensors(self, names: dict[str, str], finite: bool = False):
        """(key, tensor) for each key -> file name in `names`, in file order, read one at a time.
        A .bin file's memory map (and its unread tensors) is released after its last tensor.
        finite=True: a floating tensor that holds NaN or inf is a ValueError naming file and name."""
        def checked(path: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
            if finite:
                model_dir.require_finite(path, name, tensor)
            return tensor

        by_file: dict[Path, list[tuple[str, str]]] = {}
        for key, name in names.items():
            by_file.setdefault(self._file_of[name], []).append((key, name))
        for path in sorted(by_file):
            wanted = sorted(by_file[path], key=lambda kn: kn[1])
            if path in self._bin:
                state = self._bin.pop(path)
                for key, name in wanted:
                    yield key, checked(path, name, state.pop(name))
                del state
            else:
                with model_dir.open_safetensors(path) as f:
                    for key, name in wanted:
                        yield key, checked(path, name, f.get_tensor(name))


def read_hf_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory, whichever of the four layouts it uses (CPU; a
    .bin's may be memory-mapped). Loading a model streams instead (load_pretrained)."""
    files = _WeightFiles(directory)
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


def _name_first(keys: list[str]) -> str:
    more = f" (and {len(keys) - 1} more: {keys[1:4]})" if len(keys) > 1 else ""
    return f"{keys[0]!r}{more}"


def check_hf_state(hf_state: dict, config: ModelConfig, source: str = "checkpoint") -> None:
    """Refuse a checkpoint whose tensor names or shapes disagree with `config`, naming the key.
    Only names and shapes are read: meta tensors stand in for a checkpoint not yet loaded."""
    got = families.clean_hf_state(hf_state, config)
    with torch.device("meta"):   # an MoE's experts: stored one per expert or stacked, as this checkpoint has them
        expected = families.state_dict_to_hf(Transformer(config).state_dict(), config,
                                             expert_layout=families.expert_layout_of(got))
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        raise ValueError(f"{source}: missing tensor {_name_first(missing)} that config.json requires")
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {_name_first(unexpected)} for this config.json")
    for key, ref in expected.items():
        if tuple(got[key].shape) != tuple(ref.shape):
            raise ValueError(f"{source}: tensor {key!r} has shape {tuple(got[key].shape)}, "
                             f"config.json implies {tuple(ref.shape)}")


def _stream_model(shapes: dict, read, config: ModelConfig, source: str, dtype=None,
                  device=None) -> Transformer:
    """A Transformer from Hugging Face tensors read one at a time, so that at no moment is more
    than the model held (in its final dtype and device) plus the tensors in flight.

    shapes: file name -> shape of every tensor in the checkpoint, checked (check_hf_state) before
    anything is read. read({full HF name: file name}) -> (full HF name, tensor) pairs. Each tensor
    is cast to `dtype` and moved to `device` as it is read (a cast commutes with the transposes and
    concatenations of the conversion, so the result is the same bit for bit), converted by
    families.hf_tensors_to_logitlab and assigned into a model built on the meta device."""
    check_hf_state({k: torch.empty(s, device="meta") for k, s in shapes.items()}, config, source)
    # clean_hf_state decides on names alone: run over {name: name}, it maps each full HF name to
    # the name the file stores it under (buffers and a tied head's copy dropped, base-model prefix)
    names = families.clean_hf_state({k: k for k in shapes}, config)

    def cast(items):
        for key, tensor in items:  # rebound, so the uncast tensor is dropped before the next read
            tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            yield key, tensor

    with torch.device("meta"):
        model = Transformer(config)
    # the converted tensors are the model's own (final dtype and device): holding them until one
    # assignment costs nothing extra, and one load_state_dict walks the modules once
    state = dict(families.hf_tensors_to_logitlab(cast(read(names)), config))
    model.load_state_dict(state, strict=False, assign=True)
    del state
    model.tie_weights()
    unread = [name for name, p in model.named_parameters() if p.is_meta]
    if unread:  # check_hf_state makes this unreachable; a conversion bug must not pass silently
        raise ValueError(f"{source}: no tensor was loaded into {_name_first(unread)}")
    model.rebuild_buffers()   # RoPE tables: float32, on the parameters' device
    return model


def load_pretrained(directory: str | os.PathLike, verify: bool = False, dtype=None,
                    device: str | torch.device = "cpu", revision: str | None = None) -> Transformer:
    """Load a Hugging Face directory (families.SUPPORTED_ARCHITECTURES), a logitlab one, or a hub id
    (`load_pretrained("gpt2")`, `"Qwen/Qwen3-0.6B@main"`, or revision=...), which hub.resolve_model
    fetches into the hub cache first.

    dtype None keeps the stored dtype. A Hugging Face checkpoint is streamed: names and shapes are
    checked from the file headers first, then each tensor is read, cast to `dtype`, moved to
    `device`, converted and placed, so the peak is about the loaded model plus the largest tensors
    in flight (never the file and a converted copy together). A floating tensor that holds NaN or
    inf is refused as it is read, naming its file and key. verify=True runs
    `verify_against_transformers` on the directory and raises ValueError when any hidden state or
    the logits differ beyond TOLERANCE."""
    directory = hub.resolve_model(directory, revision).directory
    dtype = parse_dtype(dtype)
    if model_dir.is_logitlab_dir(directory):
        model = model_dir.load_model(directory, device=device, dtype=dtype)
    else:
        config = families.config_from_hf(read_hf_config(directory), source=str(directory / "config.json"))
        weights = _WeightFiles(directory)

        def read(names):  # NaN / inf weights are refused by file and name as they are read
            return weights.tensors(names, finite=True)

        model = _stream_model(weights.shapes, read, config, str(directory), dtype, device)
    model.eval()
    if verify:
        native = model_dir.is_logitlab_dir(directory)   # then compare with its own HF export
        report = verify_against_transformers(model, None if native else directory)
        if not report["ok"]:
            raise ValueError(f"{directory}: logitlab disagrees with transformers: {format_report(report)}")
    return model


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


def save_pretrained(model, directory: str | os.PathLike, tokenizer=None, *, overwrite: bool = False,
                    source: str | os.PathLike | None = None) -> Path:
    """Atomically write config.json + model.safetensors that transformers.AutoModelForCausalLM
    loads as the matching class (families.hf_architecture). A tied head is stored once, as the
    embedding, as Hugging Face expects. A logitlab Tokenizer, when given, goes in as tokenizer.json
    with the two files AutoTokenizer also reads (write_hf_files).

    `directory` must be new or empty, or (overwrite=True) a Hugging Face directory that logitlab
    wrote: then only logitlab's files are replaced and every other file there is kept. It may not
    be `source` (the directory the model came from) or contain it."""
    with files.atomic_directory(directory, HF_KIND, overwrite=overwrite, source=source) as tmp:
        write_hf_files(model, tmp, tokenizer)
    return Path(directory)


def export_hf(run_dir: str | os.PathLike, out_dir: str | os.PathLike, which: str = "latest", *,
              overwrite: bool = False) -> Path:
    """Model + tokenizer.json, tokenizer_config.json, special_tokens_map.json (save_pretrained),
    so transformers' AutoModelForCausalLM and AutoTokenizer load the directory. `out_dir` must be
    new or empty (it may lie inside the run), or with overwrite=True an export logitlab wrote."""
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
