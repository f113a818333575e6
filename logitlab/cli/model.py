"""Subcommands for model size and checkpoints: `logitlab params` and `logitlab convert`.

params: parameter/FLOP/memory accounting of a preset, a config JSON or a model directory
(accounting.py does the arithmetic; this module only formats it). convert: Hugging Face
directory <-> logitlab directory (hf.py), optionally verified against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path


def register(subparsers) -> None:
    """Add `params` and `convert` to `subparsers`."""
    from logitlab.cli.common import add_dtype_flag

    p = subparsers.add_parser("params", help="parameter counts, FLOPs, memory and a training planner",
                              description="Exact parameter counts (model built on the meta device) beside "
                              "the back-of-envelope formula, FLOPs per token, weight and KV-cache memory, "
                              "and a training memory/time planner.")
    p.add_argument("target", metavar="PRESET|CONFIG.json|MODEL_DIR",
                   help="a preset name, a config JSON (Hugging Face or logitlab) or a model directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--batch", type=int, default=1, help="planner: sequences per step (default 1)")
    p.add_argument("--context", type=int, default=None, help="planner and FLOPs: tokens per sequence "
                   "(default: the model's context_length)")
    p.add_argument("--dtype", default="bf16", help="planner compute dtype and KV-cache dtype (default bf16)")
    p.add_argument("--memory-gb", type=float, default=None, help="planner: memory available, GiB")
    p.add_argument("--tflops", type=float, default=None,
                   help="planner: matmul rate in TFLOP/s (default: measured here with a 1024^3 matmul)")
    p.set_defaults(func=_params)

    c = subparsers.add_parser("convert", help="Hugging Face <-> logitlab model directories",
                              description="--hf DIR: read a Hugging Face directory (an architecture "
                              "logitlab.families.SUPPORTED_ARCHITECTURES lists), write a logitlab directory "
                              "to --out. --to-hf DIR: read a "
                              "logitlab directory, write a Hugging Face directory to --out. --verify "
                              "compares every hidden state and the logits with transformers.")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="Hugging Face directory to import")
    src.add_argument("--to-hf", metavar="DIR", help="logitlab directory to export")
    c.add_argument("--out", metavar="DIR", help="directory to write (required with --to-hf)")
    c.add_argument("--overwrite", action="store_true", help="replace an --out directory that logitlab "
                   "wrote before (only its own files; anything else there is kept). Without it --out must "
                   "be new or empty")
    c.add_argument("--verify", action="store_true", help="compare against transformers and print the "
                   "largest difference per layer and of the logits; exit 1 above tolerance")
    add_dtype_flag(c)
    c.set_defaults(func=_convert)


# --------------------------------------------------------------------------------------------
# params
# --------------------------------------------------------------------------------------------

def resolve_config(target: str):
    """A ModelConfig from a preset name, a config JSON file, or a model / checkpoint / run directory."""
    from logitlab.io import checkpoint
    from logitlab.model import families
    from logitlab.model.transformer import ModelConfig

    if target in families.PRESETS:
        return families.PRESETS[target]
    path = Path(target)
    if path.is_dir() and not (path / "config.json").is_file():
        path = checkpoint.resolve_model_dir(path)   # a run directory: its latest checkpoint
    if path.is_dir():
        if checkpoint.is_logitlab_dir(path):
            return checkpoint.read_model_config(path)
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{target!r} is neither a preset ({', '.join(families.PRESETS)}) "
                                "nor a config file or model directory")
    data = checkpoint.read_json_object(path, "config file")
    try:
        if data.get("format") == checkpoint.MODEL_FORMAT:
            return checkpoint.read_model_config(path.parent) if path.name == "config.json" else \
                ModelConfig.from_dict(data.get("model"))
        if "architectures" in data or "model_type" in data:
            return families.config_from_hf(data, source=str(path))
        return ModelConfig.from_dict(data)
    except ValueError as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"{path}: {exc}") from exc


def params_report(config, batch: int = 1, context: int | None = None, dtype: str = "bf16",
                  memory_gb: float | None = None, tflops: float | None = None) -> dict:
    """Everything `logitlab params` shows, as one JSON-ready dict."""
    from logitlab.model import accounting as acc

    exact = acc.count_parameters(config)
    formula = acc.formula_count(config)
    rate = tflops * 1e12 if tflops else acc.measure_matmul_flops(dtype, seconds=0.3)
    plan = acc.plan_training(config, batch, context, dtype, memory_gb, rate, n_params=exact.total)
    return {"config": config.to_dict(), "exact": exact.as_dict(), "formula": formula.as_dict(),
            "difference": acc.explain_difference(config, exact), "classic_note": acc.explain_classic(config),
            "flops_per_token": acc.flops_per_token(config, plan.context),
            "weight_bytes": acc.weight_bytes(exact.total),
            "kv_cache": acc.kv_cache_bytes(config, dtype), "plan": plan.as_dict(),
            "matmul_rate_source": "given" if tflops else "measured"}


def _n(x) -> str:
    return f"{x:,}"


def _bytes(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:,.1f} {unit}" if unit != "B" else f"{int(x)} B"
        x /= 1024
    return str(x)


def _params(args) -> int:
    from logitlab.cli.common import console, print_table

    config = resolve_config(args.target)
    r = params_report(config, args.batch, args.context, args.dtype, args.memory_gb, args.tflops)
    out = console()
    if args.json:
        out.print_json(json.dumps(r))
        return 0
    e, f, c = r["exact"], r["formula"], config
    title = (f"{args.target}: D {c.d_model}, L {c.n_layers}, H {c.n_heads}, Hkv {c.n_kv_heads}, "
             f"Dh {c.head_dim}, F {c.d_ff}, V {c.vocab_size}, {'tied' if c.tie_embeddings else 'untied'}")
    L = c.n_layers
    rows = [["embeddings", "", _n(e["embeddings"]), "", _n(c.vocab_size * c.d_model)]]
    if e["positions"]:
        rows.append(["positions", "", _n(e["positions"]), "", ""])
    rows += [["attention", _n(e["attention_per_layer"]), _n(e["attention"]),
              _n(f["attention_per_layer"]), _n(f["attention_per_layer"] * L)],
             ["MLP", _n(e["mlp_per_layer"]), _n(e["mlp"]), _n(f["mlp_per_layer"]), _n(f["mlp_per_layer"] * L)],
             ["norms", _n(e["norms_per_layer"]), _n(e["norms"]), "", ""],
             ["LM head", "", _n(e["lm_head"]) + (" (tied)" if e["tied"] else ""), "",
              _n(0 if c.tie_embeddings else c.vocab_size * c.d_model)],
             ["total", _n(e["per_layer"]), _n(e["total"]), _n(f["per_layer"]), _n(f["total"])]]
    print_table(out, title, ["component", "exact / layer", "exact total", "formula / layer", "formula total"],
                rows, right=(1, 2, 3, 4))
    diff = ", ".join(f"{k} {_n(v)}" for k, v in r["difference"].items()) or "nothing"
    out.print(f"exact - formula = {_n(e['total'] - f['total'])}: {diff}")
    out.print(f"classic 12·D²·L = {_n(f['classic_12_D2_L'])} vs formula layers {_n(f['layers'])} "
              f"({r['classic_note']})")
    fl = r["flops_per_token"]
    out.print(f"FLOPs/token at context {fl['context']:,}: forward {fl['forward']:.3e} (2·N_matmul "
              f"{fl['dense']:.3e} + attention 2·L·T·H·Dh {fl['attention']:.3e}), "
              f"training {fl['training']:.3e} (3x)")
    w = r["weight_bytes"]
    out.print(f"weights: fp32 {_bytes(w['fp32'])}, bf16 {_bytes(w['bf16'])}, int8 {_bytes(w['int8'])}")
    kv = r["kv_cache"]
    out.print(f"KV cache ({args.dtype}): {_bytes(kv['per_token'])} per token, {_bytes(kv['total'])} "
              f"at {kv['tokens']:,} tokens")
    p = r["plan"]
    labels = (("weights", "weights (fp32)"), ("gradients", "gradients (fp32)"),
              ("optimizer", "AdamW moments (2 x fp32)"), ("activations", "activations (estimate)"),
              ("logits", "logits + grad (fp32)"), ("total", "total"))
    print_table(out, f"training step: batch {p['batch_size']} x context {p['context']}, activations "
                f"{p['dtype']}, AdamW", ["item", "memory"], [[label, _bytes(p[key])] for key, label in labels],
                right=(1,))
    if p["memory_limit"] is not None:
        verdict = "[green]fits[/green]" if p["fits"] else "[red]does not fit[/red]"
        out.print(f"{verdict} in {_bytes(p['memory_limit'])}")
    out.print(f"step: {p['flops_per_step']:.3e} FLOPs; at the {r['matmul_rate_source']} matmul rate "
              f"{p['matmul_flops_per_s'] / 1e12:.3f} TFLOP/s that is {p['seconds_per_step']:.3g} s "
              "at 100% MFU")
    return 0


# --------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------

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
    from logitlab.io import checkpoint, files, hf

    out = console()
    if args.to_hf:
        if not args.out:
            raise ValueError("--to-hf needs --out DIR (the Hugging Face directory to write)")
        files.check_output_dir(args.out, hf.HF_KIND, overwrite=args.overwrite, source=args.to_hf)
        model, tokenizer = checkpoint.load_for_inference(args.to_hf,    # model dir, checkpoint or run
                                                         dtype=hf.parse_dtype(args.dtype))
        hf.save_pretrained(model, args.out, tokenizer=tokenizer, overwrite=args.overwrite, source=args.to_hf)
        arch = json.loads((Path(args.out) / "config.json").read_text())["architectures"][0]
        out.print(f"wrote Hugging Face directory {args.out} ({arch}"
                  f"{', tokenizer.json' if tokenizer is not None else ''})")
        reference = args.out
    else:
        legacy = checkpoint.model_dir_entries(args.out) if args.out else None
        if args.out:  # refused before the (possibly large) model is read
            files.check_output_dir(args.out, checkpoint.MODEL_KIND, overwrite=args.overwrite, source=args.hf,
                                   legacy=legacy)
        model = hf.load_pretrained(args.hf, dtype=args.dtype)
        if args.out:
            tokenizer = _hf_tokenizer(Path(args.hf))
            with files.atomic_directory(args.out, checkpoint.MODEL_KIND, overwrite=args.overwrite,
                                        source=args.hf, legacy=legacy) as tmp:
                checkpoint.write_model_files(model, tmp)
                if tokenizer is not None:
                    tokenizer.save(tmp / checkpoint.TOKENIZER_FILE)
            out.print(f"wrote logitlab directory {args.out}"
                      f"{' with its tokenizer' if tokenizer is not None else ''}")
        reference = args.hf
    if args.verify:
        report = hf.verify_against_transformers(model, reference)
        _print_report(report)
        return 0 if report["ok"] else 1
    return 0
