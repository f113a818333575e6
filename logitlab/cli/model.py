"""Subcommands for model size and checkpoints: `logitlab params` and `logitlab convert`.

params: parameter/FLOP/memory accounting of a preset, a config JSON or a model directory
(accounting.py does the arithmetic; this module only formats it). convert: Hugging Face
directory <-> logitlab directory (hf.py), optionally verified against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from logitlab.cli.common import ExamplesFormatter


def register(subparsers) -> None:
    """Add `params` and `convert` to `subparsers`."""
    import argparse


    p = subparsers.add_parser("params", help="parameter counts, FLOPs, memory and a training planner",
                              description="Exact parameter counts (model built on the meta device) beside "
                              "the back-of-envelope formula, FLOPs per token, weight and KV-cache memory, "
                              "and a training memory/time planner: when a step does not fit --memory-gb, the "
                              "largest batch and context that do, and how many fully sharded ranks it needs.",
                              epilog="examples:\n  logitlab params gpt2 --batch-size 64 --seq-len 1024 --dtype bf16 "
                              "--memory-gb 24 --tflops 989\n  logitlab params runs/a             # the model a run "
                              "trained\n  logitlab params Qwen/Qwen3-0.6B    # a hub id (its config.json only)",
                              formatter_class=ExamplesFormatter)
    p.add_argument("target", metavar="PRESET|CONFIG.json|MODEL",
                   help="a preset name, a config JSON (Hugging Face or logitlab), or a MODEL: a run, checkpoint or "
                   "model directory, or a hub id ORG/NAME[@REVISION]")
    p.add_argument("--revision", help="with a hub id: the branch, tag or commit (default: main)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--batch-size", type=int, default=1, help="planner: sequences per step (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="planner and FLOPs: tokens per sequence "
                   "(default: the model's context_length)")
    p.add_argument("--batch", dest="batch_size", type=int, help=argparse.SUPPRESS)   # old spelling
    p.add_argument("--context", dest="seq_len", type=int, help=argparse.SUPPRESS)    # old spelling
    p.add_argument("--dtype", default="bf16", help="planner compute dtype and KV-cache dtype (default bf16)")
    p.add_argument("--memory-gb", type=float, default=None, help="planner: memory available, GiB")
    p.add_argument("--tflops", type=float, default=None,
                   help="planner: matmul rate in TFLOP/s of the device you plan for, e.g. 989 for an H100's dense "
                   "bf16 (default: measured on this machine with a 1024^3 matmul)")
    p.add_argument("--world-size", type=int, default=None, help="planner: ranks to spread training over; prints "
                   "each rank's memory under DDP and the ZeRO stages (ZeRO paper arithmetic, parallel.planner)")
    p.add_argument("--tp", type=int, default=1, help="with --world-size: tensor-parallel degree (default 1)")
    p.add_argument("--pp", type=int, default=1, help="with --world-size: pipeline stages (default 1)")
    p.add_argument("--activation-checkpointing", choices=["none", "selective", "full"], default="none",
                   help="with --world-size: what the backward recomputes (default none)")
    p.set_defaults(func=_params)

    from logitlab.cli import convert

    convert.register(subparsers)


# --------------------------------------------------------------------------------------------
# params
# --------------------------------------------------------------------------------------------

def resolve_config(target: str, revision: str | None = None):
    """A ModelConfig from a preset name, a config JSON file, a model / checkpoint / run directory, or
    a hub id (only its config.json is fetched). A near-miss of a preset name is answered with the
    closest ones, not looked up on the hub."""
    import difflib

    from logitlab.io import checkpoint, hub
    from logitlab.model import families
    from logitlab.model.config import ModelConfig

    if target in families.PRESETS:
        return families.PRESETS[target]
    path = Path(target)
    if not path.exists() and "/" not in target and difflib.get_close_matches(target, families.PRESETS, cutoff=0.8):
        raise ValueError(families.unknown_preset(target))
    if not path.exists() and hub.looks_like_hub_id(target):
        try:
            path = hub.resolve_model(target, revision, files=["config.json"]).directory
        except ValueError as exc:
            if "/" in target:                                   # ORG/NAME: a hub id, not a preset's name
                raise
            raise ValueError(f"{target!r} is neither a preset (logitlab.model.PRESETS), a config file or model "
                             f"directory, nor a hub model: {exc}") from None
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
    from logitlab.model import planner
    from logitlab.model.accounting_mla import cache_comparison
    from logitlab.model.accounting_moe import moe_summary
    from logitlab.quant import apply as quant

    exact = acc.count_parameters(config)
    formula = acc.formula_count(config)
    rate = tflops * 1e12 if tflops else acc.measure_matmul_flops(dtype, seconds=0.3)
    plan = acc.plan_training(config, batch, context, dtype, memory_gb, rate, n_params=exact.total)
    advice = planner.fit_advice(config, plan)
    return {"config": config.to_dict(), "exact": exact.as_dict(), "formula": formula.as_dict(),
            "difference": acc.explain_difference(config, exact), "classic_note": acc.explain_classic(config),
            "classic_table": planner.classic_table(config),
            "flops_per_token": acc.flops_per_token(config, plan.context),
            "weight_bytes": acc.weight_bytes(exact.total),
            "quantized_weight_bytes": quant.quantized_sizes(config),
            "kv_cache": acc.kv_cache_bytes(config, dtype), "plan": plan.as_dict(),
            "kv_cache_mla": cache_comparison(config, acc.dtype_bytes(dtype)),
            "moe": moe_summary(config, exact, acc.matmul_params(config)),
            "fits_instead": advice.as_dict() if advice is not None else None,
            "weights_in_training": planner.weights_note(dtype, exact.total),
            "matmul_rate_source": "given" if tflops else "measured",
            "rate_note": planner.rate_note(plan, measured_on_cpu=not tflops),
            "typical_mfu": planner.TYPICAL_MFU}


_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(x: float, unit: str) -> str:
    """Engineering units, three significant digits: si(1.72e10, "FLOP") -> '17.2 GFLOP'."""
    scale, prefix = next(((scale, prefix) for scale, prefix in _PREFIXES if abs(x) >= scale), (1, ""))
    v = x / scale
    digits = 0 if abs(v) >= 100 or v == 0 else 1 if abs(v) >= 10 else 2
    return f"{v:.{digits}f} {prefix}{unit}"


def duration(seconds: float) -> str:
    """'0.42 s', '9.4 min', '2.3 h', '4.1 days'."""
    for limit, scale, unit in ((60, 1, "s"), (3600, 60, "min"), (86400 * 2, 3600, "h")):
        if seconds < limit:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 86400:.3g} days"


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

    config = resolve_config(args.target, args.revision)
    r = params_report(config, args.batch_size, args.seq_len, args.dtype, args.memory_gb, args.tflops)
    out = console()
    if args.json:
        out.print_json(json.dumps(r))
        return 0
    e, f, c = r["exact"], r["formula"], config
    heads = f"MLA R {c.kv_lora_rank} Dr {c.qk_rope_head_dim}" if c.is_mla else f"Hkv {c.n_kv_heads}"
    title = (f"{args.target}: D {c.d_model}, L {c.n_layers}, H {c.n_heads}, {heads}, "
             f"Dh {c.head_dim}, F {c.d_ff}, V {c.vocab_size}, {'tied' if c.tie_embeddings else 'untied'}"
             + (f", {c.n_experts} experts of F {c.moe_d_ff}, {c.n_experts_per_token} per token" if c.is_moe else ""))
    L = c.n_layers
    rows = [["embeddings", "", _n(e["embeddings"]), "", _n(c.vocab_size * c.d_model)]]
    if e["positions"]:
        rows.append(["positions", "", _n(e["positions"]), "", ""])
    if e["value_embeddings"]:   # tables and gates (formula: in its embeddings)
        rows.append(["value embeddings", "", _n(e["value_embeddings"]), "", ""])
    n_attn = L - e["n_linear_layers"]
    rows += [[f"attention ({n_attn} layers)" if e["n_linear_layers"] else "attention", _n(e["attention_per_layer"]),
              _n(e["attention"]), _n(f["attention_per_layer"]), _n(f["attention_per_layer"] * n_attn)]]
    if e["n_linear_layers"]:
        rows.append([f"Gated DeltaNet ({e['n_linear_layers']} layers)", _n(e["linear_attention_per_layer"]),
                     _n(e["linear_attention"]), _n(f["linear_per_layer"]),
                     _n(f["linear_per_layer"] * e["n_linear_layers"])])
        rows += [[f"  {name}", _n(n), _n(n * e["n_linear_layers"]), "", ""] for name, n in e["linear_items"].items()]
    rows += _mlp_rows(e, f, c, r["moe"])
    rows += [["norms", _n(e["norms_per_layer"]), _n(e["norms"]), "", ""],
             ["LM head", "", _n(e["lm_head"]) + (" (tied)" if e["tied"] else ""), "",
              _n(0 if c.tie_embeddings else c.vocab_size * c.d_model)],
             ["total", _n(e["per_layer"]), _n(e["total"]), _n(f["per_layer"]), _n(f["total"])]]
    print_table(out, title, ["component", "exact / layer", "exact total", "formula / layer", "formula total"],
                rows, right=(1, 2, 3, 4))
    diff = ", ".join(f"{k} {_n(v)}" for k, v in r["difference"].items()) or "nothing"
    out.print(f"exact - formula = {_n(e['total'] - f['total'])}: {diff}")
    if r["moe"]:
        _print_moe(out, r["moe"])
    print_table(out, "the classic estimate 12·D²·L beside this model's formula",
                ["part", "classic", "rule", "this model", "why they differ"],
                [[row["part"], _n(row["classic"]), row["classic_rule"], _n(row["formula"]), row["why"]]
                 for row in r["classic_table"]], right=(1, 3))
    fl = r["flops_per_token"]
    state = f" + Gated DeltaNet state {si(fl['linear_state'], 'FLOP')}" if "linear_state" in fl else ""
    per_key = "2·H·(Dh + Dv)" if c.is_mla else "4·H·Dh"
    out.print(f"FLOPs per token at context {fl['context']:,}: forward {si(fl['forward'], 'FLOP')} (2·N_matmul "
              f"{si(fl['dense'], 'FLOP')} + attention {per_key} per key read {si(fl['attention'], 'FLOP')}{state}), "
              f"training {si(fl['training'], 'FLOP')} (3x: forward + backward)")
    w = r["weight_bytes"]
    out.print(f"weights: fp32 {_bytes(w['fp32'])}, bf16 {_bytes(w['bf16'])}, int8 {_bytes(w['int8'])} "
              "(1 byte a parameter)")
    quantized = ", ".join(f"{name} {_bytes(n)}" for name, n in r["quantized_weight_bytes"].items())
    out.print(f"quantized (--quantize: linear layers int8 per row or int4 in groups of G, with their scales and "
              f"zero points; the rest bf16): {quantized}", soft_wrap=True)
    _print_kv(out, r, args.dtype)
    _print_plan(out, r, args.dtype)
    if args.world_size:
        _print_ranks(out, config, args)
    return 0


def _print_kv(out, r: dict, dtype: str) -> None:
    """The KV cache: per token and at the context; a fixed part; multi-head latent attention's
    cache against multi-head and grouped-query attention of the same heads (accounting_mla)."""
    kv, mla = r["kv_cache"], r["kv_cache_mla"]
    out.print(f"KV cache ({dtype}): {_bytes(kv['per_token'])} per token, {_bytes(kv['total'])} "
              f"at {kv['tokens']:,} tokens")
    if kv["fixed"]:
        out.print(f"  of which {_bytes(kv['fixed'])} is fixed whatever the length (Gated DeltaNet state, sliding "
                  f"windows); with every layer full attention: {_bytes(kv['full_attention_equivalent'])} "
                  f"({kv['full_attention_equivalent'] / kv['total']:.1f}x)")
    if mla:
        c = r["config"]
        out.print(f"  latent attention keeps {mla['mla_values_per_layer']:,} values per token and layer (latent "
                  f"R {c['kv_lora_rank']} + RoPE key Dr {c['qk_rope_head_dim']}); with the same "
                  f"{c['n_heads']} heads (keys Dh {c['head_dim']}, values Dv {c['v_head_dim']}):", markup=False,
                  highlight=False)
        out.print(f"    MHA ({c['n_heads']} key/value heads) {_bytes(mla['mha_per_token'])} per token "
                  f"({mla['mha_over_mla']:.1f}x), GQA ({mla['gqa_kv_heads']} key/value heads) "
                  f"{_bytes(mla['gqa_per_token'])} ({mla['gqa_over_mla']:.1f}x), MLA {_bytes(mla['mla_per_token'])}: "
                  f"as much as GQA with {mla['gqa_equivalent_kv_heads']:.2g} key/value heads", markup=False,
                  highlight=False)


def _mlp_rows(e: dict, f: dict, c, moe: dict | None) -> list[list[str]]:
    """The MLP rows of params' table: one for a dense model; for an MoE, the dense and MoE layers'
    formulas, the exact count of all of them, and the routed experts within it."""
    L = c.n_layers
    if moe is None:
        return [["MLP", _n(e["mlp_per_layer"]), _n(e["mlp"]), _n(f["mlp_per_layer"]), _n(f["mlp_per_layer"] * L)]]
    n_moe, rows = moe["n_moe_layers"], []
    if n_moe < L:
        rows.append([f"MLP ({L - n_moe} dense layers)", "", "", _n(f["mlp_per_layer"]),
                     _n(f["mlp_per_layer"] * (L - n_moe))])
    rows += [[f"MoE ({n_moe} layers)", "", "", _n(moe["layer_formula"]), _n(moe["layer_formula"] * n_moe)],
             ["MLP, all layers", _n(e["mlp_per_layer"]), _n(e["mlp"]), "", ""],
             ["  experts", "", _n(moe["routed_experts"]), "", ""]]
    return rows


def _print_moe(out, moe: dict) -> None:
    """Total against active parameters (accounting_moe.moe_summary)."""
    K, E = moe["experts_per_token"], moe["n_experts"]
    shared = " and a shared expert" if moe["shared_expert_d_ff"] else ""
    out.print(f"mixture of experts: each MoE layer is a router{shared} and {E} experts of "
              f"{_n(moe['per_expert'])} parameters; a token uses {K} of the {E} experts in each of "
              f"{moe['n_moe_layers']} MoE layers, so {_n(moe['inactive'])} parameters are idle for it",
              markup=False, highlight=False)
    out.print(f"total {_n(moe['total'])} ({_short(moe['total'])}), active per token {_n(moe['active'])} "
              f"({_short(moe['active'])}, {moe['active_share']:.1%}); weights multiplied per token "
              f"{_n(moe['active_matmul'])} ({_short(moe['active_matmul'])}: blocks and LM head, not the embedding "
              "lookup; FLOPs count these, memory counts the total)", markup=False, highlight=False)


def _short(n: int) -> str:
    """A parameter count as people write it: 46.7B, 3.61B, 12.5M."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _print_ranks(out, config, args) -> None:
    """Per-rank memory of each ZeRO stage on --world-size ranks (parallel.planner)."""
    from logitlab.cli.common import print_table
    from logitlab.parallel.planner import plan_all_stages

    ranks = plan_all_stages(config, args.world_size, micro_batch=args.batch_size, context=args.seq_len,
                            mixed_precision=args.dtype != "fp32", tp=args.tp, pp=args.pp,
                            activation_checkpointing=args.activation_checkpointing)
    rows = [[r.parallel, _bytes(r.weights), _bytes(r.gradients), _bytes(r.optimizer), _bytes(r.activations),
             _bytes(r.logits), _bytes(r.total)] for r in ranks]
    print_table(out, f"per rank on {args.world_size} ranks (tp {args.tp}, pp {args.pp}, activation checkpointing "
                f"{args.activation_checkpointing})", ["stage", "weights", "gradients", "optimizer", "activations",
                                                       "logits", "total"], rows, right=(1, 2, 3, 4, 5, 6))
    out.print("ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, fsdp (ZeRO-3) also the weights "
              "over the data-parallel ranks (mixed precision: 2 + 2 + 12 bytes per parameter before sharding)",
              markup=False, highlight=False)


def _print_plan(out, r: dict, dtype: str) -> None:
    """The training step's memory, what fits instead when it does not, and its time."""
    from logitlab.cli.common import print_table

    p, wt = r["plan"], r["weights_in_training"]
    master = "weights (fp32 master copy)" if wt else "weights (fp32)"
    labels = (("weights", master), ("gradients", "gradients (fp32)"),
              ("optimizer", "AdamW moments (2 x fp32)"), ("activations", f"activations ({p['dtype']}, estimate)"),
              ("logits", "logits + grad (fp32)"), ("total", "total"))
    print_table(out, f"training step: batch {p['batch_size']} x context {p['context']}, AdamW",
                ["item", "memory"], [[label, _bytes(p[key])] for key, label in labels], right=(1,))
    if wt:
        out.print(f"with {dtype} compute the optimizer updates fp32 master weights ({_bytes(wt['master_bytes'])}); "
                  f"autocast casts each to {dtype} as a matmul uses it (transient copies, "
                  f"{_bytes(wt['compute_bytes'])} for all of them)")
    if p["memory_limit"] is not None:
        verdict = "[green]fits[/green]" if p["fits"] else "[red]does not fit[/red]"
        out.print(f"{verdict} in {_bytes(p['memory_limit'])}")
    if r["fits_instead"] is not None:
        _print_fits_instead(out, r["fits_instead"], p)
    mfu = r["typical_mfu"]
    out.print(f"step: {si(p['flops_per_step'], 'FLOP')}; at the {r['matmul_rate_source']} matmul rate "
              f"{si(p['matmul_flops_per_s'], 'FLOP/s')} that is {duration(p['seconds_per_step'])} at 100% MFU, "
              f"about {duration(p['seconds_per_step'] / mfu)} at {mfu:.0%}")
    out.print("(MFU, model FLOPs utilisation: the model's FLOPs per second over the hardware's matmul rate; "
              "a well-tuned training step reaches about 30-50%)")
    if r["rate_note"]:
        out.print("[yellow]note:[/yellow] this step is timed at this CPU's measured matmul rate; for the GPU "
                  "you plan for, give its rate with --tflops (e.g. --tflops 989 for an H100's dense bf16, "
                  "--tflops 312 for an A100's)")


def _print_fits_instead(out, advice: dict, p: dict) -> None:
    limit = _bytes(advice["memory_limit"])
    if advice["largest_batch"] is not None:
        accum = -(-p["batch_size"] // advice["largest_batch"])
        micro = -(-p["batch_size"] // accum)
        out.print(f"fits in {limit}: batch {advice['largest_batch']} at context {p['context']} (--batch-size "
                  f"{micro} --grad-accum {accum} keeps {micro * accum} sequences per optimizer step)")
    if advice["largest_context"] is not None:
        out.print(f"fits in {limit}: context {advice['largest_context']:,} at batch {p['batch_size']}")
    if advice["largest_batch"] is None and advice["largest_context"] is None:
        out.print(f"nothing fits on one device: the fp32 weights, gradients and AdamW moments alone take "
                  f"{_bytes(advice['state_bytes'])} (16 bytes per parameter)")
    if advice["sharded_world_size"] is not None:
        out.print(f"fully sharded (--parallel fsdp, ZeRO-3): {advice['sharded_world_size']} ranks of {limit} "
                  f"each, {advice['sharded_micro_batch']} sequence(s) per rank")
    else:
        out.print("fully sharded training does not fit either at up to 4096 ranks: lower the batch or context")
