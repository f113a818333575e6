"""Subcommand `doctor` (registered by main.py): which optional features work on this install.

Each optional feature is an extra of the package (pyproject.toml); FEATURES names, for each,
the modules it imports and what it enables. `doctor` checks each module without importing it
(importlib.util.find_spec), so it answers in a fraction of a second, and `missing_extra_line`
is the one line every command prints when a feature's module is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys

from logitlab.cli.common import ExamplesFormatter

# extra -> (modules it brings, with their distribution names; what needs it)
FEATURES: dict[str, tuple[dict[str, str], str]] = {
    "serve": ({"starlette": "starlette", "uvicorn": "uvicorn"},
              "logitlab serve: the OpenAI-compatible server and the explorer page"),
    "hf": ({"huggingface_hub": "huggingface_hub", "transformers": "transformers"},
           "hub ids (Qwen/Qwen3-0.6B) and verification against transformers (convert --verify)"),
    "eval": ({"lm_eval": "lm-eval"}, "logitlab eval harness (lm-evaluation-harness tasks)"),
    "data": ({"datasketch": "datasketch", "zstandard": "zstandard", "pyarrow": "pyarrow"},
             "prepare --dedup minhash, .jsonl.zst and parquet sources"),
    "kernels": ({"triton": "triton"}, "the Triton kernels (train --attention-kernel triton on a GPU)"),
    "post": ({"jinja2": "jinja2", "peft": "peft"},
             "chat templates (chat, sft, serve's chat route) and LoRA adapters in PEFT's format"),
    "quant": ({"gguf": "gguf"}, "GGUF files, llama.cpp's format (a MODEL.gguf; quant.gguf)"),
}

# the optional C extensions (setup.py): module -> what it speeds up; each has a Python path beside it
NATIVE = {
    "logitlab.tokenizer._bpe_fast": "the tokenizer trainer's merge loop and GPT-2 pre-tokenizing",
    "logitlab.data._text_fast": "prepare's quality-rule counts and exact-dedup text",
    "logitlab.quant._int8dot": "int8 x int8 products of quantized layers (--quant-kernel int8dot)",
}


def extra_for(module: str | None) -> str | None:
    """The extra that brings top-level module `module` (e.g. "uvicorn" -> "serve"), or None."""
    top = (module or "").split(".")[0]
    return next((extra for extra, (mods, _) in FEATURES.items() if top in mods), None)


def missing_extra_line(command: str, exc: ImportError) -> str | None:
    """`logitlab serve needs uvicorn: pip install 'logitlab[serve]'` for a missing optional module,
    or None when the module is not one of an extra's (a broken install, shown as it is)."""
    extra = extra_for(exc.name)
    if extra is None:
        return None
    top = exc.name.split(".")[0]
    return f"logitlab {command} needs {top}: pip install 'logitlab[{extra}]'"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def report() -> list[dict]:
    """One row per extra: {extra, ok, modules: {module: version or None}, enables}."""
    rows = []
    for extra, (mods, enables) in FEATURES.items():
        found = {m: (_version(dist) or "?") if importlib.util.find_spec(m) else None for m, dist in mods.items()}
        rows.append({"extra": extra, "ok": all(v is not None for v in found.values()), "modules": found,
                     "enables": enables})
    return rows


def cmd_doctor(args) -> int:
    from logitlab import __version__
    from logitlab.cli.common import console, print_table

    out = console()
    torch_version = _version("torch")
    out.print(f"logitlab {__version__}, Python {platform.python_version()} ({sys.executable}), "
              f"torch {torch_version or 'MISSING'}", soft_wrap=True, markup=False)
    if args.torch and torch_version:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        out.print(f"torch threads {torch.get_num_threads()}, CUDA device: {gpu}", soft_wrap=True, markup=False)
    rows = report()
    table = [[r["extra"], "yes" if r["ok"] else "no",
              ", ".join(f"{m} {v}" if v else f"{m} missing" for m, v in r["modules"].items()), r["enables"]]
             for r in rows]
    print_table(out, "Optional features (pip install 'logitlab[EXTRA]'; [all] brings every one)",
                ["extra", "works", "modules", "what it enables"], table)
    built = [f"{what}: {'built' if importlib.util.find_spec(module) else 'not built (the Python path runs)'}"
             for module, what in NATIVE.items()]
    out.print("Compiled parts (built by pip install when a C compiler is present): " + "; ".join(built),
              soft_wrap=True, markup=False)
    missing = [r["extra"] for r in rows if not r["ok"]]
    if missing:
        out.print(f"to add the missing ones: pip install 'logitlab[{','.join(missing)}]'", soft_wrap=True,
                  markup=False)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="which optional features work on this install, and how to add the others",
        description="List logitlab's optional features (the package's extras), whether each works on this "
                    "install, the versions found, and the pip command that adds the missing ones.",
        epilog="example:\n  logitlab doctor\n  logitlab doctor --torch      # also torch's threads and GPU",
        formatter_class=ExamplesFormatter)
    p.add_argument("--torch", action="store_true", help="also import torch and show its threads and GPU "
                   "(slower: a second or more)")
    p.set_defaults(func=cmd_doctor)
