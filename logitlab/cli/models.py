"""How every command names and loads a model: one positional MODEL, whatever it is.

MODEL is a run directory (its latest checkpoint), a checkpoint directory, a logitlab model
directory, a Hugging Face directory, or a hub id ORG/NAME[@REVISION] (io.hub resolves it into
the hub cache; `--revision` is the same as @REVISION). The kind is found from what is on disk, so
no command asks which kind it is. The old spellings (`--checkpoint DIR`, `--hf DIR`, sft's
`--base DIR`, convert's `--to-hf DIR`) still work for a release: main() rewrites them into MODEL
(rewrite_legacy) and prints a note on stderr.

A model's own generation settings come with it: Hugging Face's generation_config.json gives the
defaults of generate, chat and serve (`generation_defaults`), which a TOML [sample] table and
the flags override, and `--verbose` shows where each setting came from (`sample_sources`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

MODEL_HELP = ("the model: a run directory (its latest checkpoint), a checkpoint or logitlab model directory, a "
              "Hugging Face directory, a hub id ORG/NAME[@REVISION] (fetched into the Hugging Face cache), or a "
              "GGUF file beside its tokenizer")
LEGACY_NOTE = "note: {flag} DIR is now the positional MODEL (the old spelling works for one more release): {example}"


# command (with its subcommand) -> the flags that named its model before MODEL (kept for one release;
# main() rewrites them)
LEGACY_FLAGS = {"generate": ("--checkpoint", "--hf"), "inspect": ("--checkpoint", "--hf"),
                "chat": ("--checkpoint", "--hf"), "convert": ("--hf", "--to-hf"), "sft": ("--base",),
                "tokenizer add-special": ("--model",)}


def add_model_argument(p, *, dtype: bool = True, memory: bool = True) -> None:
    """The positional MODEL (required), --revision, --dtype and --max-memory (common.add_memory_flag;
    memory=False for a command that reads a model's config but not its weights)."""
    from logitlab.cli.common import add_dtype_flag, add_memory_flag

    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--revision", help="with a hub id: the branch, tag or commit to load (default: main); the "
                   "same as MODEL@REVISION")
    if dtype:
        add_dtype_flag(p)
    if memory:
        add_memory_flag(p)
        p.add_argument("--mmap", action=argparse.BooleanOptionalAction, default=True,
                       help="leave the safetensors tensors that need no conversion as private mappings of the "
                       "files (the default: faster loading, pages read on first use and shared with the page "
                       "cache); --no-mmap reads every tensor into memory the model owns, for files that may "
                       "be truncated or rewritten in place while the model runs, or on a network filesystem")


def rewrite_legacy(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv with an old model flag (`generate --checkpoint DIR ...`) turned into the positional MODEL
    right after the command (`generate DIR ...`), and the notes to show. Only the command's own
    legacy flags are touched."""
    words = [a for a in argv if not a.startswith("-")][:2]
    command = next((c for c in (" ".join(words), words[0] if words else None) if c in LEGACY_FLAGS), None)
    flags = LEGACY_FLAGS.get(command, ())
    out, found = list(argv), []
    last = command.split()[-1] if command else None
    i = out.index(last) + 1 if command else len(out)
    while i < len(out):
        name, eq, value = out[i].partition("=")
        if name in flags and (eq or i + 1 < len(out)):
            found.append((name, value if eq else out[i + 1]))
            del out[i:i + (1 if eq else 2)]
            continue
        i += 1
    if len(found) > 1:
        raise ValueError(f"give the model once (got {', '.join(f'{n} {v}' for n, v in found)})")
    if not found:
        return out, []
    (name, value), = found
    out.insert(out.index(last) + 1, value)
    return out, [LEGACY_NOTE.format(flag=name, example=f"logitlab {command} {value} ...")]


def load_model(spec: str, revision: str | None = None, dtype: str | None = None, max_memory: str | None = None,
               mmap: bool = True):
    """Any MODEL with its tokenizer and settings: io.loading.Loaded. max_memory (--max-memory): the
    most its weights may take (default: what the machine has available), checked before loading;
    mmap (--no-mmap: False): tensors kept as stored stay mapped from the files."""
    from logitlab.io.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(spec, revision, dtype, max_memory=max_memory, mmap=mmap)


def load(args):
    """load_model for a parsed command line (MODEL, --revision, --dtype, --max-memory)."""
    return load_model(args.model, getattr(args, "revision", None), getattr(args, "dtype", None),
                      getattr(args, "max_memory", None), getattr(args, "mmap", True))


def generation_defaults(generation: dict) -> dict:
    """SampleConfig defaults from a model's generation_config.json (io.generation_config)."""
    from logitlab.io.generation_config import sample_defaults

    return sample_defaults(generation)


def sample_sources(args, toml_table: dict, defaults: dict) -> dict[str, str]:
    """Where each SampleConfig field came from: the flag, the TOML file, generation_config.json or
    logitlab's default (the precedence, highest first)."""
    from logitlab.generate.config import SampleConfig

    sources = {}
    for f in dataclasses.fields(SampleConfig):
        if hasattr(args, f.name):
            sources[f.name] = "--" + f.name.replace("_", "-")
        elif f.name in toml_table:
            sources[f.name] = f"[sample] of {args.config}"
        elif f.name in defaults:
            sources[f.name] = "the model's generation_config.json"
        else:
            sources[f.name] = "logitlab's default"
    return sources


def describe_settings(cfg, sources: dict[str, str]) -> list[str]:
    """Lines `temperature = 0.6  (the model's generation_config.json)` for --verbose."""
    shown = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop_ids")
    return [f"{name} = {json.dumps(getattr(cfg, name))}  ({sources.get(name, 'logitlab')})" for name in shown]


# -------------------- Quantized weights and speculative decoding (generate, chat, serve)

def add_inference_flags(p, draft: bool = True) -> None:
    """--quantize, --group-size, --quant-kernel, and with `draft` --draft and --draft-k."""
    p.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="quantize the model's linear layers once loaded (weights only: int8 with a scale per output "
                   "row; int4 in groups of --group-size columns with a scale and zero point each); a model saved "
                   "quantized loads quantized without it")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64,
                   help="with --quantize int4: columns per group (default 64; smaller follows the weights more "
                   "closely and stores more scales)")
    p.add_argument("--quant-kernel", choices=["auto", "reference", "packed", "int8dot"], default="auto",
                   help="matrix products of the quantized layers: torch's packed CPU kernels (packed), the int8 or "
                   "int4 weights times activations quantized to int8 per block of 32 (int8dot; changes the numbers "
                   "slightly), the plain dequantize-then-matmul (reference), or whichever measured faster here "
                   "(auto, the default; int8dot only for bf16 models)")
    p.add_argument("--steer", metavar="FILE", help="add a steering direction (inspect --save-direction writes "
                   "one) to the residual stream at every position of every forward")
    p.add_argument("--steer-layer", type=int, metavar="L", help="with --steer: the block after which it is added "
                   "(default: the file's)")
    p.add_argument("--steer-scale", type=float, default=1.0, metavar="S", help="with --steer: how many times the "
                   "direction is added (default 1; negative steers away)")
    if draft:
        p.add_argument("--draft", metavar="MODEL|ngram", default=None,
                       help="speculative decoding: a smaller MODEL sharing the tokenizer proposes tokens, or 'ngram' "
                       "proposes what followed the latest repeat of the last few tokens (no second model); the "
                       "model checks them in one pass. Greedy output is unchanged, sampled output keeps its "
                       "distribution (no repetition/frequency/presence penalties)")
        p.add_argument("--draft-k", type=int, default=4, metavar="K",
                       help="with --draft: tokens proposed per round (default 4)")


def prepare_model(args, model, target: bool = True) -> list[str]:
    """--quantize applied to a loaded model, and the quantized layers' kernels chosen
    (--quant-kernel), and on the `target` model (not a draft) --steer -> lines for stderr saying what
    was done and what the weights weigh."""
    from logitlab.quant import routes
    from logitlab.quant.apply import model_bytes, quantization_of, quantize_model
    from logitlab.quant.linear import QuantConfig

    lines, method = [], getattr(args, "quantize", None)
    if method:
        report = quantize_model(model, QuantConfig(method, getattr(args, "group_size", 64)))
        reasons = ", ".join(sorted(set(report.skipped.values())))
        kept = f" ({len(report.skipped)} kept: {reasons})" if report.skipped else ""
        lines.append(f"quantized {len(report.layers)} linear layers to {report.config.label}{kept}: weights "
                     f"{report.bytes_before / 2**20:,.1f} MiB -> {report.bytes_after / 2**20:,.1f} MiB")
    quantization = quantization_of(model)
    if quantization is not None:
        handle = routes.install(model, getattr(args, "quant_kernel", "auto"))
        if not method:
            lines.append(f"weights quantized ({quantization.label}): {model_bytes(model) / 2**20:,.1f} MiB")
        lines.append(f"quantized matmuls: {handle.route} ({handle.layers} layers on a fast kernel)")
    return lines + (steer_model(args, model) if target else [])


def steer_model(args, model) -> list[str]:
    """--steer: the direction's hook set on `model` for as long as the model is used (the command,
    or the server it builds)."""
    path = getattr(args, "steer", None)
    if path is None:
        return []
    from logitlab.inspect.steering import add_steering, load_steering

    if getattr(args, "compile", False):
        raise ValueError("--steer adds a hook to every forward, which --compile's traced decode step would not "
                         "see: give one of them")
    s = load_steering(path, args.steer_scale, args.steer_layer)
    add_steering(model, s)
    return [f"steering: {path} added after block {s.layer}, scale {s.scale:g} (norm "
            f"{float(s.direction.norm()) * abs(s.scale):.3f})"]


def load_draft(args, target):
    """The --draft drafter: "ngram", or the draft MODEL loaded as the target was (--dtype,
    --quantize), which must share the target's vocabulary. None without --draft."""
    spec = getattr(args, "draft", None)
    if spec is None:
        return None
    if getattr(args, "draft_k", 4) < 1:
        raise ValueError(f"--draft-k must be >= 1, got {args.draft_k}")
    if spec == "ngram":
        return "ngram"
    draft = load_model(spec, None, getattr(args, "dtype", None), getattr(args, "max_memory", None)).model
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"--draft {spec}: its vocabulary has {draft.config.vocab_size} tokens, the model's "
                         f"{target.config.vocab_size}: a draft model must share the tokenizer")
    prepare_model(args, draft, target=False)
    return draft
