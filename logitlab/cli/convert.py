"""Subcommand `convert` (registered with `params` by cli/model.py): a Hugging Face directory or hub
id <-> a logitlab model directory, optionally verified against transformers layer by layer.
The direction comes from what MODEL is (io.loading.is_hf_dir)."""

from __future__ import annotations

import json
from pathlib import Path


def register(subparsers) -> None:
    """Add `convert` to `subparsers`."""
    from logitlab.cli.common import add_examples
    from logitlab.cli.models import add_model_argument

    c = subparsers.add_parser("convert", help="Hugging Face <-> logitlab model directories",
                              description="Convert MODEL to the other format, into --out: a Hugging Face "
                              "directory or hub id (an architecture logitlab.families.SUPPORTED_ARCHITECTURES "
                              "lists) becomes a logitlab directory; a logitlab run, checkpoint or model directory "
                              "becomes a Hugging Face directory. --verify compares every hidden state and the "
                              "logits with transformers.")
    add_examples(c, "convert runs/a --out hf/a --verify          # logitlab -> Hugging Face",
                 "convert hf/a --out back/a                    # Hugging Face -> logitlab",
                 "convert Qwen/Qwen3-0.6B --verify             # a hub id, checked against transformers",
                 "convert runs/a --out runs/a-int4 --quantize int4   # a quantized logitlab directory",
                 "convert runs/a --out runs/a.gguf --gguf Q8_0       # a GGUF file for llama.cpp")
    add_model_argument(c)
    c.add_argument("--out", metavar="DIR", help="directory to write (required from a logitlab model; from a "
                   "Hugging Face one, leave it out to only --verify)")
    c.add_argument("--overwrite", action="store_true", help="replace an --out directory that logitlab "
                   "wrote before (only its own files; anything else there is kept). Without it --out must "
                   "be new or empty")
    c.add_argument("--verify", action="store_true", help="compare against transformers and print the "
                   "largest difference per layer and of the logits; exit 1 above tolerance")
    c.add_argument("--quantize", choices=["int8", "int4"], default=None,
                   help="write --out as a logitlab directory with int8 (a scale per output row) or int4 (groups "
                   "of --group-size columns) linear layers, from any MODEL; it loads quantized in every command")
    c.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64,
                   help="with --quantize int4: columns per group (default 64)")
    c.add_argument("--gguf", choices=["F32", "F16", "BF16", "Q8_0", "Q4_0"], default=None, metavar="TYPE",
                   help="write --out as a GGUF file (llama.cpp's format) with its matrices in TYPE: F32, F16, BF16, "
                   "Q8_0 or Q4_0 (the [quant] extra); the tokenizer is written beside it when none is there")
    c.set_defaults(func=_convert)


def _print_report(report: dict) -> None:
    from rich.table import Table

    from logitlab.cli.common import console

    t = Table(title=f"logitlab vs transformers ({report['dtype']}, ids {report['ids_shape']})")
    t.add_column("output")
    t.add_column("max |diff|", justify="right")
    L = len(report["hidden"]) - 1
    for i, d in enumerate(report["hidden"]):
        label = "embeddings" if i == 0 else (f"block {i - 1}" if i < L else f"block {i - 1} + final norm")
        t.add_row(label, f"{d:.2e}")
    t.add_row("logits", f"{report['logits']:.2e}")
    out = console()
    out.print(t)
    ok = "[green]OK[/green]" if report["ok"] else "[red]MISMATCH[/red]"
    out.print(f"{ok} (tolerance {report['tolerance']:.0e} relative to max(1, |reference|))")


def _hf_tokenizer(directory: Path):
    """The directory's tokenizer (hf.load_tokenizer) or None: absent, or not byte-level BPE (a
    note says why; the model is converted without it)."""
    from logitlab.cli.common import error_console
    from logitlab.io import hf

    try:
        return hf.load_tokenizer(directory)
    except ValueError as exc:
        error_console().print(f"note: tokenizer not converted: {exc}")
        return None


def _convert(args) -> int:
    from logitlab.cli.common import console
    from logitlab.io import hub
    from logitlab.io.loading import is_hf_dir

    if args.quantize and args.gguf:
        raise ValueError("--quantize and --gguf write different formats: give one of them")
    if (args.quantize or args.gguf) and not args.out:
        raise ValueError(f"--{'quantize' if args.quantize else 'gguf'} needs --out, the "
                         f"{'directory' if args.quantize else 'file'} to write")
    if args.verify and (args.quantize or args.gguf):
        raise ValueError("--verify compares dense weights with transformers: convert without --quantize or --gguf")
    resolved = hub.resolve_model(args.model, args.revision)
    source, out = resolved.directory, console()
    if args.quantize:
        return _to_quantized(args, resolved, out)
    if args.gguf:
        return _to_gguf(args, out)
    if is_hf_dir(source):
        model, reference = _hf_to_logitlab(args, resolved, out), source
    else:
        model, reference = _logitlab_to_hf(args, source, out), args.out
    if args.verify:
        from logitlab.io import hf

        report = hf.verify_against_transformers(model, reference)
        _print_report(report)
        return 0 if report["ok"] else 1
    return 0


def _logitlab_to_hf(args, source: Path, out):
    from logitlab.io import checkpoint, files, hf

    if not args.out:
        raise ValueError(f"{source} is a logitlab model: convert needs --out DIR, the Hugging Face directory to write")
    files.check_output_dir(args.out, hf.HF_KIND, overwrite=args.overwrite, source=source)
    model, tokenizer = checkpoint.load_for_inference(source, dtype=hf.parse_dtype(args.dtype),
                                                     max_memory=args.max_memory)
    hf.save_pretrained(model, args.out, tokenizer=tokenizer, overwrite=args.overwrite, source=source)
    arch = json.loads((Path(args.out) / "config.json").read_text())["architectures"][0]
    out.print(f"wrote Hugging Face directory {args.out} ({arch}{', tokenizer.json' if tokenizer is not None else ''})")
    return model


def _hf_to_logitlab(args, resolved, out):
    """A Hugging Face directory or hub id -> a logitlab directory whose config.json records where
    it came from (hub.Resolved.provenance(): the id, the revision asked for and its commit)."""
    from logitlab.io import checkpoint, files, hf

    source = resolved.directory
    legacy = checkpoint.model_dir_entries(args.out) if args.out else None
    if args.out:  # refused before the (possibly large) model is read
        files.check_output_dir(args.out, checkpoint.MODEL_KIND, overwrite=args.overwrite, source=source,
                               legacy=legacy)
    model = hf.load_pretrained(source, dtype=args.dtype, max_memory=args.max_memory)
    if args.out:
        tokenizer = _hf_tokenizer(source)
        with files.atomic_directory(args.out, checkpoint.MODEL_KIND, overwrite=args.overwrite,
                                    source=source, legacy=legacy) as tmp:
            checkpoint.write_model_files(model, tmp, source=resolved.provenance())
            if tokenizer is not None:
                tokenizer.save(tmp / checkpoint.TOKENIZER_FILE)
        origin = f" from {resolved.pinned()}" if resolved.repo_id else ""
        out.print(f"wrote logitlab directory {args.out}{' with its tokenizer' if tokenizer is not None else ''}"
                  f"{origin}", soft_wrap=True)
    return model


def _to_quantized(args, resolved, out) -> int:
    """Any MODEL -> a logitlab directory whose linear layers are int8 or int4 (quant.quantize_model),
    with its tokenizer and where it came from."""
    from logitlab.cli.models import load_model
    from logitlab.io import checkpoint, files
    from logitlab.quant.apply import quantize_model
    from logitlab.quant.linear import QuantConfig

    config = QuantConfig(args.quantize, args.group_size)          # a bad combination is refused first
    files.check_output_dir(args.out, checkpoint.MODEL_KIND, overwrite=args.overwrite, source=resolved.directory)
    m = load_model(args.model, args.revision, args.dtype, args.max_memory, getattr(args, "mmap", True))
    report = quantize_model(m.model, config)
    with files.atomic_directory(args.out, checkpoint.MODEL_KIND, overwrite=args.overwrite,
                                source=resolved.directory) as tmp:
        checkpoint.write_model_files(m.model, tmp, source=m.provenance or None)
        m.tokenizer.save(tmp / checkpoint.TOKENIZER_FILE)
    out.print(f"wrote logitlab directory {args.out}: {len(report.layers)} linear layers {config.label}, weights "
              f"{report.bytes_before / 2**20:,.1f} MiB -> {report.bytes_after / 2**20:,.1f} MiB", soft_wrap=True)
    return 0


def _to_gguf(args, out) -> int:
    """Any MODEL -> a GGUF file (quant.gguf.save_gguf), and its tokenizer beside it when the
    folder has none (a GGUF file's own vocabulary is not read back)."""
    from logitlab.cli.models import load_model
    from logitlab.io import checkpoint, hf
    from logitlab.quant.gguf import save_gguf

    path = Path(args.out)
    if path.suffix != ".gguf":
        raise ValueError(f"--gguf writes a file named *.gguf, got --out {path}")
    if path.exists() and not args.overwrite:
        raise FileExistsError(f"{path} exists (--overwrite replaces it)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no directory {path.parent} to write {path.name} into")
    m = load_model(args.model, args.revision, args.dtype, args.max_memory, getattr(args, "mmap", True))
    save_gguf(m.model, path, args.gguf, overwrite=args.overwrite)
    note = ""
    if hf.load_tokenizer(path.parent) is None:
        m.tokenizer.save(path.parent / checkpoint.TOKENIZER_FILE)
        note = f", its tokenizer beside it ({checkpoint.TOKENIZER_FILE})"
    out.print(f"wrote GGUF file {path} ({args.gguf}, {path.stat().st_size / 2**20:,.1f} MiB){note}", soft_wrap=True)
    return 0
