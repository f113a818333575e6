"""Generation speed: logitlab's prefill/decode loop vs transformers' generate, side by side.

Both sides get the same random weights (logitlab model -> logitlab.hf.save_pretrained ->
transformers.AutoModelForCausalLM.from_pretrained), the same prompts (B x 32 random ids, no
padding) and greedy decoding with a KV cache. logitlab runs twice: eager (no compilation, as
transformers) and with its decode step through torch.compile (`generate(..., step=kernels.decode.compiled_decode_step(model, step=decode_step))`;
the compile time is reported on its own, outside the timings). Each side is measured the same
way from outside: prefill = the time to generate 1 token, decode tokens/s = B x (N - 1) /
(time to generate N tokens - prefill). Runs alternate (eager, compiled, peer, ...) after a
warm-up; ratios are per alternation (> 1: logitlab faster).

Measured in the same run: the machine's memory bandwidth (a large tensor copy), giving each
point's fraction of the memory-bandwidth bound (bytes of weights and KV cache read per decode
step / bandwidth, over the measured step time), and the peak resident memory of each side
generating at the largest batch, each in a fresh process (VmHWM above the imports).

    python3 -m bench.generate            # GPT-2-small shape and a small Llama, B 1 and 8, fp32 and bf16
    python3 -m bench.generate --quick    # fewer points and tokens, a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from bench.common import (
    RESULTS,
    command_line,
    machine_info,
    markdown_table,
    reset_peak_rss,
    rss_kib,
    run_child,
    update_doc_section,
    write_results,
)
from bench.roofline import bandwidths
from logitlab.generate import SampleConfig, decode_step, generate
from logitlab.io.hf import load_pretrained, save_pretrained
from logitlab.kernels.decode import compiled_decode_step
from logitlab.model.families import PRESETS
from logitlab.model.transformer import ModelConfig, Transformer

SHAPES = {
    "gpt2-small": ModelConfig(vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12),
    "llama-small": ModelConfig(vocab_size=8192, context_length=1024, d_model=384, n_layers=6, n_heads=6,
                               n_kv_heads=2, d_ff=1024, norm="rmsnorm", mlp="swiglu", positions="rope",
                               bias=False, tie_embeddings=False),
    "tiny": PRESETS["tiny"],   # the smallest preset: 1.8M parameters, Llama layout
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(shape: str, dtype: torch.dtype, directory: str):
    """(logitlab model, transformers model) holding the same random weights, in eval mode; the
    Hugging Face directory is left in `directory` for the memory runs."""
    import transformers

    torch.manual_seed(0)
    ours = Transformer(SHAPES[shape]).eval()
    save_pretrained(ours, directory)
    peer = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    peer.generation_config.eos_token_id = None
    peer.generation_config.pad_token_id = 0
    return ours.to(dtype), peer


def runners(ours, peer, prompts: torch.Tensor):
    """side -> (n -> a callable generating n tokens per row)."""
    rows = prompts.tolist()
    mask = torch.ones_like(prompts)

    compiled = compiled_decode_step(ours, step=decode_step)   # built once: its cache holds the graph

    def run(compile):
        step = compiled if compile else decode_step
        return lambda n: lambda: generate(ours, rows, SampleConfig(temperature=0, max_new_tokens=n), step=step)

    def run_peer(n):
        return lambda: peer.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                     min_new_tokens=n)

    return {"ours": run(False), "compiled": run(True), "peer": run_peer}


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return time.perf_counter() - t0, out


def bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth (GB/s) with torch's current thread count, measured the way a decode
    step reads its weights: the best of `repeats` float32 matrix-vector products over a `mib`
    MiB matrix (far larger than any cache), counting the matrix bytes (bench.roofline's "matvec")."""
    return bandwidths(mib, repeats)["matvec"]


def bytes_per_step(model, B: int, S: float) -> int:
    """Bytes a decode step must read at least: every weight once (the embedding table only as
    the LM head, which reads all of it; an untied embedding contributes B rows) plus the keys
    and values of S cached positions for every row."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if name == "tok_emb.weight" and not cfg.tie_embeddings:
            total += B * p.shape[1] * p.element_size()
        elif name != "pos_emb.weight":
            total += p.numel() * p.element_size()
    item = next(model.parameters()).element_size()
    return int(total + 2 * cfg.n_layers * B * cfg.n_kv_heads * S * cfg.head_dim * item)


def matmul_floor_s(model, B: int, repeats: int = 5, steps: int = 4) -> float:
    """Seconds per decode step spent in its matrix products alone: every Linear of the model
    (q/k/v, o, MLP) and the LM head's V rows, applied in model order to B rows of random
    activations, with the model's own weights (so what fits in cache fits here too). The best of
    `repeats` timings of `steps` steps. No implementation that calls these matmul kernels can
    decode faster than this; transformers' step time over it is the largest ratio reachable."""
    import torch.nn.functional as F

    V = model.config.vocab_size
    weights = [(m.weight, m.bias) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    weights.append((model.lm_head.weight[:V], None))
    dtype = weights[0][0].dtype
    inputs = {w.shape[1]: torch.randn(B, w.shape[1], dtype=dtype) for w, _ in weights}

    def step():
        for w, b in weights:
            F.linear(inputs[w.shape[1]], w, b)

    with torch.no_grad():
        step()
        best = float("inf")
        for _ in range(repeats):
            seconds, _ = timed(lambda: [step() for _ in range(steps)])
            best = min(best, seconds / steps)
    return best


def measure(shape: str, dtype_name: str, batches: list[int], prompt_len: int, new: int, repeats: int,
            sides: tuple[str, ...], bandwidth: float, directory: str) -> list[dict]:
    ours, peer = build(shape, DTYPES[dtype_name], directory)
    results = []
    for B in batches:
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, SHAPES[shape].vocab_size, (B, prompt_len), generator=g)
        run = runners(ours, peer, prompts)
        warm = {side: timed(run[side](4))[0] for side in sides}   # warm-up (compiled: compiles)
        got = {side: {"prefill": [], "total": []} for side in sides}
        last = {}
        for _ in range(repeats):  # A B C A B C
            for side in sides:
                got[side]["prefill"].append(timed(run[side](1))[0])
                seconds, last[side] = timed(run[side](new))
                got[side]["total"].append(seconds)
        out = dict(shape=shape, dtype=dtype_name, batch=B, prompt=prompt_len, new_tokens=new,
                   bandwidth_gbs=bandwidth, bytes_per_step=bytes_per_step(ours, B, prompt_len + new / 2))
        # greedy with the same weights: both sides should choose the same tokens
        out["same_tokens"] = last["ours"].tokens == last["peer"][:, prompt_len:].tolist()
        if "compiled" in sides:
            out["compiled_same_tokens"] = last["compiled"].tokens == last["ours"].tokens
            out["compile_s"] = warm["compiled"] - warm["ours"]
        for side in sides:
            pre, tot = got[side]["prefill"], got[side]["total"]
            tps = [B * (new - 1) / max(t - p, 1e-9) for p, t in zip(pre, tot)]
            out[side] = dict(prefill_ms=1e3 * statistics.median(pre), decode_tok_s=statistics.median(tps),
                             decode_tok_s_all=tps, prefill_s_all=pre, total_s_all=tot)
            # the bound: one step can take no less than bytes_per_step / bandwidth seconds
            step_s = B / out[side]["decode_tok_s"]
            out[side]["bandwidth_fraction"] = out["bytes_per_step"] / (bandwidth * 1e9) / step_s
        for side in sides:
            if side == "peer":
                continue
            key = "decode_ratio" if side == "ours" else "compiled_ratio"
            ratios = [a / b for a, b in zip(out[side]["decode_tok_s_all"], out["peer"]["decode_tok_s_all"])]
            out[key] = statistics.median(ratios)
            out[key + "_min"], out[key + "_max"] = min(ratios), max(ratios)
        out["matmul_floor_ms"] = 1e3 * matmul_floor_s(ours, B)
        # the largest decode ratio any side built on the same matmul kernels could reach
        out["ceiling"] = (B / out["peer"]["decode_tok_s"]) / (out["matmul_floor_ms"] / 1e3)
        pre_ratios = [p / o for o, p in zip(out["ours"]["prefill_s_all"], out["peer"]["prefill_s_all"])]
        out["prefill_ratio"] = statistics.median(pre_ratios)
        results.append(out)
        line = (f"{shape:12s} {dtype_name} B={B}: decode eager {out['ours']['decode_tok_s']:8.1f}")
        if "compiled" in sides:
            line += f" compiled {out['compiled']['decode_tok_s']:8.1f}"
        line += f" vs {out['peer']['decode_tok_s']:8.1f} tok/s  eager x{out['decode_ratio']:.2f}"
        if "compiled" in sides:
            line += (f" compiled x{out['compiled_ratio']:.2f} (bound {out['compiled']['bandwidth_fraction']:.0%},"
                     f" compile {out['compile_s']:.0f} s)")
        line += f"; matmul floor {out['matmul_floor_ms']:.2f} ms/step (ceiling x{out['ceiling']:.2f})"
        print(line + f"; prefill {out['ours']['prefill_ms']:.1f} vs {out['peer']['prefill_ms']:.1f} ms; "
              f"same tokens: {out['same_tokens']}", flush=True)
    return results


def peak_rss_mib(side: str, directory: str, dtype_name: str, B: int, prompt_len: int, new: int,
                 threads: int | None) -> tuple[float, float]:
    """(load + generate, generate alone): peak resident memory (MiB) of a fresh process that
    loads `directory` as `side` (ours or peer) and generates `new` tokens for B prompts, above
    its RSS after the imports and above its RSS once the model is loaded."""
    gen, total = run_child("bench.generate", "--peak-rss", dict(
        side=side, directory=directory, dtype=dtype_name, B=B, prompt=prompt_len, new=new, threads=threads))[-2:]
    return float(total), float(gen)


def measure_memory(shape: str, dtype_name: str, directory: str, B: int, new: int, threads,
                   compiled: bool = True) -> dict:
    """Peak RSS of loading + generating and of generating alone for logitlab (eager, and
    compiled unless compiled=False: the compiler's own memory and the compiled step's packed
    weights included) and transformers, each in a fresh process."""
    sides = ("ours", "compiled", "peer") if compiled else ("ours", "peer")
    mib = {side: peak_rss_mib(side, directory, dtype_name, B, 32, new, threads) for side in sides}
    out = dict(shape=shape, dtype=dtype_name, batch=B)
    for side in sides:
        out[f"{side}_mib"], out[f"{side}_gen_mib"] = mib[side]
    line = (f"{shape:12s} {dtype_name} B={B}: peak RSS load+generate {out['ours_mib']:.0f} vs "
            f"{out['peer_mib']:.0f} MiB, generate alone {out['ours_gen_mib']:.0f} vs {out['peer_gen_mib']:.0f} MiB")
    if compiled:
        line += f"; compiled {out['compiled_mib']:.0f} / {out['compiled_gen_mib']:.0f} MiB"
    print(line, flush=True)
    return out


def memory_only(args, batches: list[int], new: int) -> int:
    """Re-measure the memory table alone and re-render the section from the saved timings."""
    path = RESULTS / "generate.json"
    payload = json.loads(path.read_text())
    memory = []
    for shape in args.shapes:
        for dtype_name in args.dtypes:
            with tempfile.TemporaryDirectory() as d:
                torch.manual_seed(0)
                save_pretrained(Transformer(SHAPES[shape]).eval(), d)
                memory.append(measure_memory(shape, dtype_name, d, max(batches), new, args.threads,
                                             compiled=not args.no_compile))
    payload["memory"] = memory
    payload["memory_command"] = command_line()
    write_results("generate", payload)
    if not args.no_doc:
        update_doc_section("Generation", render(payload))
    return 0


def _peak_rss_child(spec: dict) -> int:
    """Prints the peak RSS (MiB) of generating above the RSS after loading, then the peak of
    loading and generating above the RSS after the imports."""
    import transformers  # both sides pay the same imports, which the measure leaves out

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    dtype = DTYPES[spec["dtype"]]
    g = torch.Generator().manual_seed(1)
    base = reset_peak_rss()
    with torch.no_grad():
        if spec["side"] in ("ours", "compiled"):
            model = load_pretrained(spec["directory"], dtype=dtype).eval()
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(spec["directory"], dtype=dtype).eval()
        load_peak = rss_kib("VmHWM")
        loaded = reset_peak_rss()
        prompts = torch.randint(0, model.config.vocab_size, (spec["B"], spec["prompt"]), generator=g)
        if spec["side"] in ("ours", "compiled"):
            step = compiled_decode_step(model, step=decode_step) if spec["side"] == "compiled" else decode_step
            generate(model, prompts.tolist(), SampleConfig(temperature=0, max_new_tokens=spec["new"]), step=step)
        else:
            model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                           max_new_tokens=spec["new"], min_new_tokens=spec["new"], pad_token_id=0,
                           eos_token_id=None)
    gen_peak = rss_kib("VmHWM")
    print((gen_peak - loaded) / 1024)
    print((max(load_peak, gen_peak) - base) / 1024)
    return 0


def _ratio(r: dict, key: str) -> str:
    if key not in r:
        return "-"
    return f"**{r[key]:.2f}x** ({r[key + '_min']:.2f}-{r[key + '_max']:.2f})"


def _memory_cells(m: dict, suffix: str) -> list[str]:
    """eager, compiled, transformers MiB and the two ratios for one memory row ("-" where a
    side was not measured)."""
    peer = m.get("peer" + suffix)
    cells, ratios = [], []
    for side in ("ours", "compiled"):
        mib = m.get(side + suffix)
        cells.append("-" if mib is None else f"{mib:.0f}")
        ratios.append("-" if mib is None or peer is None else f"{mib / max(peer, 1e-9):.2f}")
    return [*cells, "-" if peer is None else f"{peer:.0f}", " / ".join(ratios)]


def render(payload: dict) -> str:
    """The docs/benchmarks.md section for one run's results."""
    info, results = payload["machine"], payload["results"]
    compiled = any("compiled" in r for r in results)
    rows = []
    for r in results:
        c = r.get("compiled")
        rows.append([r["shape"], r["dtype"], r["batch"], f"{r['ours']['decode_tok_s']:.1f}",
                     f"{c['decode_tok_s']:.1f}" if c else "-", f"{r['peer']['decode_tok_s']:.1f}",
                     _ratio(r, "decode_ratio"), _ratio(r, "compiled_ratio"),
                     f"{(c or r['ours'])['bandwidth_fraction']:.0%} / {r['peer']['bandwidth_fraction']:.0%}",
                     f"{r['matmul_floor_ms']:.2f}" if "matmul_floor_ms" in r else "-",
                     f"{r['ceiling']:.2f}x" if "ceiling" in r else "-",
                     f"{r['ours']['prefill_ms']:.1f}", f"{r['peer']['prefill_ms']:.1f}",
                     ("yes" if r["same_tokens"] else "no")
                     + ("" if not c else " / " + ("yes" if r["compiled_same_tokens"] else "no"))])
    table = markdown_table(["shape", "dtype", "B", "logitlab eager tok/s", "logitlab compiled tok/s",
                            "transformers tok/s", "eager ratio (min-max)", "compiled ratio (min-max)",
                            "bandwidth bound: logitlab / transformers", "matmul floor ms/step",
                            "ceiling (transformers step / floor)", "logitlab prefill ms",
                            "transformers prefill ms", "same tokens (eager / compiled)"], rows)
    compile_line = ""
    if compiled:
        times = ", ".join(f"{r['shape']} {r['dtype']} B={r['batch']} {r['compile_s']:.0f} s" for r in results)
        compile_line = (f"Compile time of the decode step (first compiled call minus an eager one, not in "
                        f"the timings): {times}.\n\n")
    mem = payload.get("memory") or []
    mem_table = ""
    if mem:
        mem_table = ("Peak resident memory, each side alone in a fresh process (same imports) loading the "
                     "saved weights and generating the same tokens: generating alone (peak above the RSS "
                     "once the model is loaded: KV cache, activations, logits, and for logitlab compiled "
                     "the compiler's own memory and the compiled step's packed copy of the weights) and "
                     "loading plus generating (peak above the RSS after the imports; loading is "
                     "logitlab.hf's and transformers' loaders); ratios = logitlab eager / transformers "
                     "and logitlab compiled / transformers:\n\n") + markdown_table(
            ["shape", "dtype", "B", "generate: logitlab eager MiB", "compiled MiB", "transformers MiB",
             "ratios", "load + generate: logitlab eager MiB", "compiled MiB", "transformers MiB", "ratios"],
            [[m["shape"], m["dtype"], m["batch"], *_memory_cells(m, "_gen_mib"), *_memory_cells(m, "_mib")]
             for m in mem]) + "\n\n"
    return (f"Greedy generation with a KV cache, prompt 32 tokens, {payload['new_tokens']} new tokens per "
            f"row, transformers `generate` (eager) as the peer, same weights via `save_pretrained`. logitlab "
            f"runs eager and with `compile=True` (its decode step through torch.compile, one graph). Median "
            f"of {payload['repeats']} alternating round(s) after a warm-up; ratio = logitlab decode tok/s / "
            f"transformers decode tok/s (> 1: logitlab faster). Bandwidth bound: the bytes a decode step "
            f"must read (every weight once, the KV cache at its mean length) / the memory bandwidth "
            f"measured in the same run ({payload['bandwidth_gbs']:.1f} GB/s, a float32 matrix-vector product over a 512 MiB matrix), "
            f"over the measured step time (logitlab's compiled step where it ran). Matmul floor: one step's "
            f"matrix products alone (every Linear and the LM head, the model's own weights, B rows), best "
            f"of 5; ceiling = transformers' step time / that floor, the largest ratio any implementation "
            f"calling the same matmul kernels could reach.\n\n"
            f"Command: `{payload['command']}`  \nMachine: {info['nproc']} CPUs ({info['cpu']}), torch "
            f"{info['torch']} with {info['torch_threads']} thread(s), transformers {info['transformers']}, "
            f"commit {info['commit']}, load average {info.get('load_avg_1m', '?')} when it started. The "
            f"machine was shared with other work while this ran, so absolute numbers move between runs; "
            f"the ratios come from alternating runs.\n\n{table}\n\n{compile_line}{mem_table}"
            "Reading it: at batch 1 a decode step reads every weight once for one token, so the time goes to "
            "the matrix products (the matmul floor column) plus the per-operation overhead around them "
            "(Python and dispatch: about 30 operations per layer in eager mode). The ceiling column bounds "
            "every ratio reachable with aten's products (the floor's kernels, which transformers and eager "
            "logitlab call): where transformers' step is only a little slower than the floor (GPT-2 small "
            "in fp32: large matrices, memory-bound), no implementation on those kernels can be much faster. "
            "Eager logitlab saves operations (one q/k/v and one gate/up product, q and k rotated together, "
            "one-call RMSNorm, the loop under torch.inference_mode); the compiled step removes most of "
            "the rest (one graph, its kernels called from C++, the greedy argmax inside it), and it freezes "
            "the weights into the graph and prepacks them for the product inductor times fastest per "
            "shape (its C++ GEMM template, oneDNN's or MKL's packed GEMM, or aten's), which is how a "
            "compiled step can pass the aten ceiling (the frozen graph holds a packed copy of each "
            "weight: the compiled memory columns). A model whose weights fit in the last-level cache "
            "(the small Llama, the tiny preset) can pass 100% of the DRAM bound. At batch 8 aten's "
            "products over unpacked weights run far below the bandwidth on this CPU (compare the floor "
            "at batch 8 and at batch 1), for both sides; prepacked, GPT-2 small's take about half the "
            "time. The prefill column includes the first token; both "
            "sides compute the LM head for the last prompt position only. In bf16 the sides round "
            "differently (the compiled step fuses elementwise work), so after some steps a near-tie "
            "between two tokens of the random "
            "model can go the other way (\"same tokens: no\"); in fp32 they agree token for token.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the small Llama in fp32 at batch 1, 32 new tokens, one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per point (default 2; --quick 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per row (default 128; --quick 32)")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--batches", nargs="*", type=int, default=None,
                    help="batch sizes (default 1 8; --quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--no-compile", action="store_true", help="skip logitlab's compiled decode step")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--memory-only", action="store_true",
                    help="re-measure only the peak-memory table, keeping the saved timings")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    ap.add_argument("--peak-rss", metavar="JSON", help=argparse.SUPPRESS)   # the memory child process
    args = ap.parse_args(argv)
    if args.peak_rss:
        return _peak_rss_child(json.loads(args.peak_rss))
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 2)
    new = args.new_tokens or (32 if args.quick else 128)
    batches = args.batches or ([1] if args.quick else [1, 8])
    if args.quick:
        args.shapes = args.shapes if args.shapes != list(SHAPES) else ["llama-small"]
        args.dtypes = args.dtypes if args.dtypes != list(DTYPES) else ["fp32"]
    if args.memory_only:
        return memory_only(args, batches, new)
    sides = ("ours", "peer") if args.no_compile else ("ours", "compiled", "peer")
    info = machine_info()
    bandwidth = bandwidth_gbs()
    print(f"memory bandwidth {bandwidth:.1f} GB/s", flush=True)
    results, memory = [], []
    for shape in args.shapes:
        for dtype_name in args.dtypes:
            with tempfile.TemporaryDirectory() as d:
                results += measure(shape, dtype_name, batches, 32, new, repeats, sides, bandwidth, d)
                if not args.no_memory:
                    B = max(batches)
                    memory.append(measure_memory(shape, dtype_name, d, B, new, args.threads,
                                                 compiled=not args.no_compile))
    payload = dict(machine=info, command=command_line(), repeats=repeats, new_tokens=new,
                   bandwidth_gbs=bandwidth, results=results, memory=memory)
    write_results("generate", payload)
    if not args.no_doc:
        update_doc_section("Generation", render(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
