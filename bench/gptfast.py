"""Batch-1 decode against gpt-fast, with its own compile options and with logitlab's, cold and warm.

    python3 -m bench.gptfast --gpt-fast ~/src/gpt-fast --threads 1                # fp32 and bf16
    python3 -m bench.gptfast --gpt-fast ~/src/gpt-fast --compiles 2 --dtypes bf16

gpt-fast is not a package: clone it anywhere outside this repository and name its folder. Its
model.py and generate.py are imported from there (generate.py's tokenizer module is replaced by
an empty stand-in, since no tokenizer is used), nothing of it is copied here.

Every measurement is a fresh Python process with its own, empty inductor cache directory
(TORCHINDUCTOR_CACHE_DIR), so that each compile is a cold one, as on a new machine; after the
cold ones, one more process per compiled side reuses the last one's cache ("warm", as every later
run on the same machine). Sides:
- "logitlab": generate() with `kernels.decode.compiled_decode_step` (what `logitlab generate
  --compile` runs); "logitlab eager": generate() with the eager decode step;
- "gpt-fast": its prefill and decode_n_tokens, its decode_one_token through torch.compile with
  its own options (mode="reduce-overhead", fullgraph=True, the settings its generate.py makes);
  "gpt-fast eager": the same uncompiled;
- "gpt-fast tuned": its decode_one_token compiled with logitlab's CPU inductor options for the
  dtype (decode._compile_options: freezing and the C++ wrapper, and for bf16 max-autotune with
  the C++ GEMM template pinned where it applies, decode.template_pinned), inductor's freezing
  flag set for the process, so that the options are equal.
The same weights (logitlab's seed-0 model; q and k rows permuted into gpt-fast's interleaved
RoPE layout by positions.convert_rope_layout, the gate/up matrix split as it expects), the same random prompt,
greedy decoding (gpt-fast: top_k=1). Decode tok/s = (N - 1) / (time for N new tokens - time for 1),
best of the repeats in that process; first call = wall seconds of the first generation of N
tokens, compile included. Ratios are logitlab / peer tok/s (> 1: logitlab faster).
Each compiled process also records what inductor's max-autotune picked for every product it
timed (autotune_picks), so that a spread between cold compiles can be told apart: a different
kernel picked, or the same kernels at another speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from bench.common import (
    ROOT,
    add_section_option,
    command_line,
    cpu_flags,
    machine_info,
    markdown_table,
    publish,
    results_name,
)

SHAPE = dict(vocab_size=8192, context_length=1024, d_model=384, n_layers=6, n_heads=6, n_kv_heads=2,
             d_ff=1024, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False)
COMPILED = ("logitlab", "gpt-fast", "gpt-fast tuned")
EAGER = ("logitlab eager", "gpt-fast eager")


def _gpt_fast(folder: str, config, dtype):
    """gpt-fast's (model, generate module) holding logitlab's seed-0 weights for `config`."""
    import torch

    from logitlab.model.positions import convert_rope_layout
    from logitlab.model.transformer import Transformer

    sys.modules.setdefault("tokenizer", types.ModuleType("tokenizer")).get_tokenizer = None
    sys.path.insert(0, folder)
    try:
        import generate as gf  # gpt-fast's generate.py (its module-level inductor settings apply)
        from model import ModelArgs
        from model import Transformer as GFTransformer
    finally:
        sys.path.remove(folder)
    torch.manual_seed(0)
    ours, _ = convert_rope_layout(Transformer(config).state_dict(), config, to="interleaved")
    H, Hkv, Dh, D, F = config.n_heads, config.n_kv_heads, config.head_dim, config.d_model, config.d_ff
    model = GFTransformer(ModelArgs(block_size=config.context_length, vocab_size=config.vocab_size,
                                    n_layer=config.n_layers, n_head=H, dim=D, intermediate_size=F,
                                    n_local_heads=Hkv, head_dim=Dh, rope_base=config.rope_theta,
                                    norm_eps=config.norm_eps))

    state = {"tok_embeddings.weight": ours["tok_emb.weight"], "norm.weight": ours["final_norm.weight"],
             "output.weight": ours["lm_head.weight"]}
    for i in range(config.n_layers):
        p = f"blocks.{i}."
        gate, up = ours[p + "mlp.gate_up_proj.weight"].split([F, F])
        state.update({f"layers.{i}.attention.wqkv.weight": ours[p + "attn.qkv_proj.weight"],
                      f"layers.{i}.attention.wo.weight": ours[p + "attn.o_proj.weight"],
                      f"layers.{i}.feed_forward.w1.weight": gate, f"layers.{i}.feed_forward.w3.weight": up,
                      f"layers.{i}.feed_forward.w2.weight": ours[p + "mlp.down_proj.weight"],
                      f"layers.{i}.attention_norm.weight": ours[p + "attn_norm.weight"],
                      f"layers.{i}.ffn_norm.weight": ours[p + "mlp_norm.weight"]})
    model.load_state_dict(state)
    return model.to(dtype).eval(), gf


def autotune_picks() -> list[dict]:
    """A list that fills, for the rest of this process, with one entry per product for which
    inductor's max-autotune selects a kernel: {"op": its name and input shapes, "pick": the
    fastest choice, "ms": each choice's time (timed in this process, or as inductor's cache
    recorded them)}; a choice is named without inductor's running number, so that two compiles'
    picks compare. It stays empty where autotuning is off, or where this torch has no such hook."""
    picks: list[dict] = []
    try:
        from torch._inductor.select_algorithm import add_feedback_saver
    except ImportError:
        return picks

    def kind(choice) -> str:
        name = re.sub(r"_\d+$", "", getattr(choice, "name", type(choice).__name__))
        description = getattr(choice, "description", "")
        return f"{name} ({description})" if description else name

    def saved(timings, name, input_nodes, *rest) -> None:
        shapes = "x".join(str(tuple(node.get_size())) for node in input_nodes)
        ms = {kind(c): round(float(t), 5) for c, t in timings.items()}
        picks.append({"op": f"{name} {shapes}", "pick": min(ms, key=ms.get), "ms": ms})

    add_feedback_saver(saved)
    return picks


def same_picks(runs: list[dict]) -> str:
    """Whether every run that timed its products picked the same kernel for each: "yes (n
    products)", "no: k of n differ" (k of the n products), or "-" (nothing timed)."""
    timed = [[(p["op"], p["pick"]) for p in r.get("autotune_picks", [])] for r in runs]
    timed = [t for t in timed if t]
    if not timed:
        return "-"
    columns = list(itertools.zip_longest(*timed))                  # one per product, a pick per run
    differ = sum(len(set(column)) > 1 for column in columns)
    return f"yes ({len(columns)} products)" if differ == 0 else f"no: {differ} of {len(columns)} differ"


def _child(spec: dict) -> None:
    """One side in this fresh process: -> prints JSON {first_s, tok_s: [per repeat], tokens,
    autotune_picks}."""
    import torch

    from logitlab.generate import SampleConfig, decode_step, generate
    from logitlab.kernels import decode
    from logitlab.model.transformer import ModelConfig, Transformer

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    config = ModelConfig(**SHAPE)
    prompt = torch.randint(0, config.vocab_size, (spec["prompt"],), generator=torch.Generator().manual_seed(0))
    side, N = spec["side"], spec["new_tokens"]
    picks = autotune_picks() if side in COMPILED else []
    if side.startswith("logitlab"):
        torch.manual_seed(0)
        model = Transformer(config).to(dtype).eval()
        step = decode.compiled_decode_step(model, step=decode_step) if side == "logitlab" else decode_step

        def run(n):
            return generate(model, prompt.tolist(), SampleConfig(temperature=0, max_new_tokens=n), step=step).tokens[0]
    else:
        model, gf = _gpt_fast(spec["gpt_fast"], config, dtype)
        if side == "gpt-fast":
            gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
        elif side == "gpt-fast tuned":
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True   # as decode.CompiledStep sets it around its calls
            options = {k: v for k, v in decode._compile_options(model).items() if k != "guard_filter_fn"}
            compiled = torch.compile(gf.decode_one_token, fullgraph=True, options=options)
            pin = decode._autotune_mode(model, None, options["freezing"]) == "template"

            def tuned(*args, **kwargs):   # the template pinned around its calls, as CompiledStep does
                with decode.template_pinned(pin):
                    return compiled(*args, **kwargs)
            gf.decode_one_token = tuned
        model.setup_caches(max_batch_size=1, max_seq_length=spec["prompt"] + N)

        @torch.no_grad()
        def run(n):
            T = spec["prompt"]
            first = gf.prefill(model, prompt.view(1, -1), torch.arange(T), top_k=1)
            if n == 1:
                return [int(first)]
            rest, _ = gf.decode_n_tokens(model, first.view(1, -1), torch.tensor([T]), n - 1, top_k=1)
            return [int(first)] + [int(t) for t in rest]

    import warnings

    warnings.filterwarnings("ignore")   # gpt-fast's loop enters a deprecated SDPA context each step
    start = time.perf_counter()
    tokens = run(N)
    first_s = time.perf_counter() - start
    tok_s = []
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        run(1)
        one = time.perf_counter() - t
        t = time.perf_counter()
        run(N)
        tok_s.append((N - 1) / max(time.perf_counter() - t - one, 1e-9))
    print(json.dumps({"first_s": first_s, "tok_s": tok_s, "tokens": tokens, "autotune_picks": picks}))


def measure(spec: dict, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir.replace(" ", "-"))   # no spaces: the C++ build
    out = subprocess.run([sys.executable, "-m", "bench.gptfast", "--child", json.dumps(spec)], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"side {spec['side']!r} ({spec['dtype']}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(folder: str, dtypes: list[str], compiles: int, repeats: int, threads: int | None, new_tokens: int) -> dict:
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            base = dict(gpt_fast=str(Path(folder).resolve()), dtype=dtype, threads=threads, prompt=16,
                        new_tokens=new_tokens, repeats=repeats)
            got: dict[str, list[dict]] = {s: [] for s in COMPILED + EAGER}
            for side in EAGER:
                got[side].append(measure(dict(base, side=side), f"{tmp}/{dtype}-{side}"))
            for k in range(compiles):     # cold: a new cache directory each time, sides in turn
                for side in COMPILED:
                    got[side].append(dict(measure(dict(base, side=side), f"{tmp}/{dtype}-{side}-{k}"), cache="cold"))
            for side in COMPILED:         # warm: the last cold compile's cache
                got[side].append(dict(measure(dict(base, side=side), f"{tmp}/{dtype}-{side}-{compiles - 1}"),
                                      cache="warm"))
            point = {"dtype": dtype, "runs": got,
                     "same_tokens": {s: got[s][0]["tokens"] == got["logitlab eager"][0]["tokens"] for s in got}}
            points.append(point)
            print(_line(point), flush=True)
    return {"command": command_line(), "machine": machine_info(), "cpu_flags": cpu_flags(), "shape": SHAPE,
            "compiles": compiles, "repeats": repeats, "new_tokens": new_tokens, "points": points}


def _best(run_: dict) -> float:
    return max(run_["tok_s"])


def _line(point: dict) -> str:
    parts = []
    for side, runs in point["runs"].items():
        firsts = "/".join(f"{r['first_s']:.0f}" for r in runs)
        parts.append(f"{side} " + "/".join(f"{_best(r):.0f}" for r in runs)
                     + (f" (first {firsts} s)" if side in COMPILED else ""))
    return f"{point['dtype']}: " + "; ".join(parts) + " tok/s"


def render(result: dict) -> str:
    headers = ["dtype", "side", "decode tok/s, cold compiles", "warm", "spread (max/min, cold)",
               "first call s, cold", "warm", "same tokens as logitlab eager", "same autotune picks, cold"]
    rows = []
    for p in result["points"]:
        for side, runs in p["runs"].items():
            cold = [r for r in runs if r.get("cache") != "warm"]
            warm = [r for r in runs if r.get("cache") == "warm"]
            rates = [_best(r) for r in cold]
            rows.append([p["dtype"], side, " / ".join(f"{x:,.0f}" for x in rates),
                         " / ".join(f"{_best(r):,.0f}" for r in warm) or "-",
                         f"{max(rates) / min(rates):.2f}" if len(rates) > 1 else "-",
                         " / ".join(f"{r['first_s']:.1f}" for r in cold) if side in COMPILED else "-",
                         " / ".join(f"{r['first_s']:.1f}" for r in warm) or "-",
                         "yes" if p["same_tokens"][side] else "no",
                         same_picks(cold) if side in COMPILED else "-"])
    ratio_rows = []
    for p in result["points"]:
        med = {s: statistics.median(_best(r) for r in runs if r.get("cache") != "warm") for s, runs in p["runs"].items()}
        ratio_rows.append([p["dtype"], f"{med['logitlab'] / med['gpt-fast']:.2f}", f"{med['logitlab'] / med['gpt-fast tuned']:.2f}",
                           f"{med['logitlab eager'] / med['gpt-fast eager']:.2f}",
                           f"{statistics.median(r['first_s'] for r in p['runs']['logitlab'] if r.get('cache') == 'cold') / statistics.median(r['first_s'] for r in p['runs']['gpt-fast'] if r.get('cache') == 'cold'):.2f}"])
    m = result["machine"]
    return f"""Batch-1 greedy decode of a small Llama ({result['shape']['n_layers']} layers, d {result['shape']['d_model']},
{result['shape']['n_heads']} heads / {result['shape']['n_kv_heads']} KV heads, vocabulary {result['shape']['vocab_size']}), {result['new_tokens']}
new tokens after a 16-token prompt, against gpt-fast's decode loop: compiled with its own options,
compiled with logitlab's CPU options for the dtype ("tuned": kernels.decode._compile_options,
freezing and the C++ wrapper, and for bf16 max-autotune with the C++ GEMM template pinned
wherever it applies, nothing timed), and eager. "same tokens": bf16's
rounding inside fused kernels can flip a near-tie, so compiled bf16 tokens may part from eager ones.
"same autotune picks": whether every cold compile of the side picked the same kernel for each
product max-autotune timed ("-": nothing timed).
Every figure is a fresh process with an empty inductor cache (cold: as on a new machine;
{result['compiles']} per compiled side, in turn), then one more reusing the last cache (warm).
Decode tok/s: best of {result['repeats']} generations in that process; first call: the wall time of
the first generation, compile included. Ratios from the medians of the cold runs (> 1: logitlab
faster; first-call ratio < 1: logitlab compiles sooner).

Command: `{result['command'].replace(' --no-doc', '')}` — machine: {m['nproc']} CPUs ({m['cpu']};
{", ".join(result['cpu_flags']) or "no listed features"}), torch {m['torch']} ({m['torch_threads']} threads),
commit {m['commit']}, load average {m.get('load_avg_1m', '-')} at the end.

{markdown_table(["dtype", "vs gpt-fast (its options)", "vs gpt-fast tuned (equal options)", "eager vs eager", "first call time ratio"], ratio_rows)}

{markdown_table(headers, rows)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt-fast", metavar="FOLDER", help="a clone of gpt-fast outside this repository")
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--compiles", type=int, default=3, help="cold compiles per compiled side (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per process (default 3)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    add_section_option(parser, "Decode against gpt-fast")
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    import torch

    if not args.gpt_fast or not (Path(args.gpt_fast) / "generate.py").is_file():
        parser.error(f"--gpt-fast {args.gpt_fast}: no generate.py there (give the folder of a gpt-fast clone)")
    if args.threads:
        torch.set_num_threads(args.threads)   # as every child does (machine_info reports it)
    result = run(args.gpt_fast, args.dtypes, args.compiles, args.repeats, args.threads, args.new_tokens)
    name = results_name("gptfast", args.section, "Decode against gpt-fast")
    publish(name, args.section, result, render, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
