"""Batch-1 decode of quantized weights against gpt-fast's quantization and llama.cpp, one process.

    python3 -m bench.quant_decode --gpt-fast ~/src/gpt-fast             # the small shape, ~250M
    python3 -m bench.quant_decode --gpt-fast ~/src/gpt-fast --shape 0.5b --new-tokens 64

One Llama-shaped model with random weights (logitlab's seed-0 init, in bf16) is decoded greedily
at batch 1 in three precisions by three engines, all in this process, taking turns (every side
once per round, rounds repeated), so that the load of a shared machine falls on all alike:
- bf16: logitlab's model; gpt-fast's model.py holding the same weights; llama.cpp (through
  llama-cpp-python) reading them from a BF16 GGUF file written by logitlab's writer.
- int8: logitlab's quantize_model (one scale per output row) with its CPU kernels chosen by
  measurement (quant.routes "auto", as `generate --quantize` does); gpt-fast's own
  WeightOnlyInt8QuantHandler on its bf16 model; llama.cpp on the Q8_0 file (blocks of 32).
- int4: logitlab's int4 (groups of --group-size with zero points); gpt-fast's
  WeightOnlyInt4QuantHandler math (group_quantize_tensor, same group size) packed with the CPU
  form of its kernel, since its own packing op has no CPU kernel in this torch
  (_convert_weight_to_int4pack -> _convert_weight_to_int4pack_for_cpu, _weight_int4pack_mm ->
  _weight_int4pack_mm_for_cpu: the same math, the CPU layout); llama.cpp on the Q4_0 file.
Every linear layer of the blocks and the LM head is quantized on every side; the embedding table
is read one row per token. gpt-fast runs eager by default (its int8 layer then converts the whole
int8 weight to bf16 at every call) and compiled as it ships (torch.compile of decode_one_token)
with --compile, which also compiles logitlab's step (kernels.decode.compiled_decode_step).

Decode tok/s: decoded tokens / the seconds of the decode steps, the prompt pass and the first
token excluded, per generation. Ratios: logitlab / peer per round, median (min-max).
Bandwidth: bytes of weights read per token (every matrix multiplied, the norms, one embedding
row; the KV cache, a few hundred KiB at these lengths, is left out) x tok/s, against the machine's
read bandwidth measured here (the best of a few sums over a 1 GiB tensor, --bandwidth-gib) and
its copy bandwidth (bytes read + written by a 1 GiB copy).
gpt-fast and llama-cpp-python are peers, not dependencies: a missing one is skipped with a line
that says how to get it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.common import (
    add_section_option,
    command_line,
    cpu_flags,
    machine_info,
    markdown_table,
    publish,
    results_name,
)

TITLE = "Quantized decode against gpt-fast and llama.cpp"
BASE = dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False, context_length=2048)
SHAPES = {
    "tiny": dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256),   # tests, smoke
    "small": dict(vocab_size=32000, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4, d_ff=2816),  # ~250M
    "0.5b": dict(vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=4, d_ff=4096),  # ~430M
    "1b": dict(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632),    # ~1.1B
}
PRECISIONS = ("bf16", "int8", "int4")
GGUF_TYPES = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}


def model_config(shape: str):
    from logitlab.model.config import ModelConfig

    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    return ModelConfig(**BASE, **SHAPES[shape])


# --------------------------------------------------------------------------------------------
# Bandwidth arithmetic and measurement
# --------------------------------------------------------------------------------------------

def bandwidth(bytes_per_token: int, tok_s: float) -> float:
    """Bytes per second a decode reading `bytes_per_token` reaches at `tok_s` tokens per second."""
    if bytes_per_token < 0 or not tok_s >= 0:
        raise ValueError(f"bytes per token ({bytes_per_token}) and tok/s ({tok_s}) must be >= 0")
    return bytes_per_token * tok_s


SKIP = ("tok_emb", "tok_embeddings", "rope.", "freqs_cis", "causal_mask", "k_cache", "v_cache")


def module_bytes(module, skip=SKIP) -> int:
    """Bytes of every parameter and buffer of `module` whose name holds none of `skip` (an
    embedding table, a RoPE table, a KV cache: read one row at a time, or not weights)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return sum(t.numel() * t.element_size() for name, t in tensors.items()
               if not any(part in name for part in skip))


def read_bytes_per_token(module, embedding) -> int:
    """Weights a batch-1 decode step reads: module_bytes(module) plus one row of the embedding."""
    return module_bytes(module) + embedding.shape[1] * embedding.element_size()


def gguf_bytes_per_token(path: str | Path) -> int:
    """The same for a GGUF file: every tensor but the token embedding, plus one of its rows."""
    import gguf

    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            total += int(t.n_bytes) // int(t.shape[-1])      # GGUF shapes list the row length first
        else:
            total += int(t.n_bytes)
    return total


def measure_memory(gib: float = 1.0, repeats: int = 5) -> dict:
    """This machine's memory bandwidth with torch's current threads, bytes/s: "read", the best
    of `repeats` sums over a float32 tensor of `gib` GiB (n bytes read), and "copy", the best
    of as many copies between two such tensors (2n bytes: read and written); timed by clock()."""
    import torch

    n = int(gib * 2**30) // 4
    src, dst = torch.ones(n), torch.empty(n)
    read = copy_ = float("inf")
    for _ in range(repeats):
        start = clock()
        src.sum()
        read = min(read, clock() - start)
        start = clock()
        dst.copy_(src)
        copy_ = min(copy_, clock() - start)
    return {"gib": gib, "read": 4 * n / read, "copy": 2 * 4 * n / copy_}


# --------------------------------------------------------------------------------------------
# The sides: a name -> a function running one greedy generation, -> (tokens, decode tok/s)
# --------------------------------------------------------------------------------------------

def clock() -> float:
    """The clock every side's decode is timed with: CLOCKS[--clock] (process CPU time by default:
    on a machine shared with other jobs, their time slices are not counted; with one thread it is
    the decode's own time)."""
    return _CLOCK[0]()


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
_CLOCK: list[Callable[[], float]] = [time.process_time]

def logitlab_sides(config, group_size: int, compile_: bool) -> dict:
    import torch

    from logitlab.generate import SampleConfig, Stream, decode_step
    from logitlab.model.transformer import Transformer
    from logitlab.quant import routes
    from logitlab.quant.apply import quantize_model
    from logitlab.quant.linear import QuantConfig

    torch.manual_seed(0)
    bf16 = Transformer(config).to(torch.bfloat16).eval()
    sides = {}
    for precision in PRECISIONS:
        model = bf16 if precision == "bf16" else copy.deepcopy(bf16)
        route = "-"
        if precision != "bf16":
            quantize_model(model, QuantConfig(precision, group_size))
            route = routes.install(model, "auto").route
        step = decode_step
        if compile_:
            from logitlab.kernels.decode import compiled_decode_step

            step = compiled_decode_step(model, step=decode_step)

        def run(prompt, n, model=model, step=step):
            ids = iter(Stream(model, prompt, SampleConfig(temperature=0, max_new_tokens=n), step, eot_id=None,
                              token_bytes=None, generator=None, trust_guards=True))
            tokens = [next(ids)]                                 # the prompt pass and the first token
            start = clock()
            tokens += list(ids)
            return tokens, (n - 1) / (clock() - start)
        sides[precision] = dict(run=run, model=model, route=route,
                                bytes=read_bytes_per_token(model, model.tok_emb.weight))
    return sides


def _gptfast_int4(model, group_size: int):
    """gpt-fast's int4 handler on `model`, packed for the CPU (see the module docstring)."""
    import quantize as gq  # gpt-fast's quantize.py, on sys.path while _gpt_fast imports
    import torch

    weights = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            q, scales_and_zeros = gq.group_quantize_tensor(mod.weight.data.to(torch.bfloat16), 4, group_size)
            weights[name] = (torch._convert_weight_to_int4pack_for_cpu(q, 8), scales_and_zeros)
    gq.WeightOnlyInt4QuantHandler(model, group_size, inner_k_tiles=8, padding=False).convert_for_runtime()
    for name, (packed, scales_and_zeros) in weights.items():
        mod = model.get_submodule(name)
        mod.weight, mod.scales_and_zeros = packed, scales_and_zeros

    def forward_for_cpu(x, weight, scales_and_zeros, out_features, groupsize):
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), weight, groupsize, scales_and_zeros)
        return y.reshape(*x.shape[:-1], out_features)
    gq.linear_forward_int4 = forward_for_cpu
    return model


def gptfast_sides(folder: str, config, group_size: int, compile_: bool) -> dict:
    import torch

    from bench.gptfast import _gpt_fast

    base, gf = _gpt_fast(folder, config, torch.bfloat16)
    sys.path.insert(0, folder)
    try:
        import quantize as gq
    finally:
        sys.path.remove(folder)
    if compile_:
        gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
    sides = {}
    for precision in PRECISIONS:
        model = base if precision == "bf16" else copy.deepcopy(base)
        if precision == "int8":
            handler = gq.WeightOnlyInt8QuantHandler(model)
            state = handler.create_quantized_state_dict()
            handler.convert_for_runtime().load_state_dict(state, assign=True)
        elif precision == "int4":
            _gptfast_int4(model, group_size)
        model.setup_caches(max_batch_size=1, max_seq_length=512)

        @torch.no_grad()
        def run(prompt, n, model=model):
            T = len(prompt)
            first = gf.prefill(model, torch.tensor(prompt).view(1, -1), torch.arange(T), top_k=1)
            start = clock()
            rest, _ = gf.decode_n_tokens(model, first.view(1, -1), torch.tensor([T]), n - 1, top_k=1)
            seconds = clock() - start
            return [int(first)] + [int(t) for t in rest], (n - 1) / seconds
        sides[precision] = dict(run=run, model=model, bytes=read_bytes_per_token(model, model.tok_embeddings.weight))
    return sides


def llama_cpp_sides(model, folder: Path, threads: int) -> dict:
    """llama.cpp (llama-cpp-python) on `model` written by logitlab's GGUF writer at BF16, Q8_0, Q4_0."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    from logitlab.quant.gguf import save_gguf

    sides = {}
    for precision, qtype in GGUF_TYPES.items():
        path = save_gguf(model, folder / f"model-{qtype}.gguf", qtype)
        llm = Llama(model_path=str(path), n_ctx=512, n_batch=64, n_threads=threads, n_threads_batch=threads,
                    logits_all=False, verbose=False)

        def last(llm=llm):        # the last position's logits (llm.scores holds them only with logits_all)
            return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))))

        def run(prompt, n, llm=llm, last=last):
            llm.reset()
            llm.eval(prompt)
            tokens = [last()]
            start = clock()
            for _ in range(n - 1):
                llm.eval(tokens[-1:])
                tokens.append(last())
            return tokens, (n - 1) / (clock() - start)
        sides[precision] = dict(run=run, qtype=qtype, bytes=gguf_bytes_per_token(path))
    return sides


# --------------------------------------------------------------------------------------------
# The run: every side once per round, rounds repeated
# --------------------------------------------------------------------------------------------

def build_sides(args, config, folder: Path) -> tuple[dict, dict]:
    """-> ({engine: {precision: side}}, {engine: why it is missing})."""
    engines, missing = {}, {}
    engines["logitlab"] = logitlab_sides(config, args.group_size, args.compile)
    if args.gpt_fast and (Path(args.gpt_fast) / "model.py").is_file():
        engines["gpt-fast"] = gptfast_sides(str(Path(args.gpt_fast).resolve()), config, args.group_size, args.compile)
    else:
        missing["gpt-fast"] = (f"no gpt-fast clone at --gpt-fast {args.gpt_fast!r}: clone "
                               "https://github.com/pytorch-labs/gpt-fast outside this repository and name its folder")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        missing["llama.cpp"] = "llama-cpp-python is not installed: pip install llama-cpp-python (it builds llama.cpp)"
    else:
        engines["llama.cpp"] = llama_cpp_sides(engines["logitlab"]["bf16"]["model"], folder, args.threads)
    return engines, missing


def run_rounds(engines: dict, prompt: list[int], new_tokens: int, repeats: int, report=print) -> dict:
    """{precision: {engine: {"tok_s": [per round], "tokens": first round's ids}}} after one
    untimed warm-up round; in each round every engine decodes every precision once, in turn."""
    got = {p: {e: {"tok_s": [], "tokens": None} for e in engines if p in engines[e]} for p in PRECISIONS}
    for r in range(repeats + 1):
        for precision in PRECISIONS:
            for engine in got[precision]:
                tokens, tok_s = engines[engine][precision]["run"](prompt, new_tokens)
                if r == 0:
                    got[precision][engine]["tokens"] = tokens
                else:
                    got[precision][engine]["tok_s"].append(tok_s)
        if r:
            report(f"round {r}: " + "; ".join(f"{p} " + " / ".join(f"{e} {v['tok_s'][-1]:.1f}" for e, v in got[p].items())
                                               for p in PRECISIONS) + " tok/s")
    return got


def ratios(ours: list[float], peer: list[float]) -> dict:
    """Per-round ratios ours / peer (> 1: ours faster): median, min, max."""
    r = [a / b for a, b in zip(ours, peer)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading ids two greedy generations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def profile(side: dict, prompt: list[int], new_tokens: int, rows: int = 12) -> str:
    """torch.profiler's table of one generation by `side` (a logitlab side): the operators by their
    own CPU time, the `rows` costliest, and the share of the time spent outside any operator."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        side["run"](prompt, new_tokens)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    table = events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48)
    return f"{table}\nwall {wall:.3f} s for {new_tokens} tokens, of which {in_ops:.3f} s inside operators (profiled)"


def summarize(engines: dict, got: dict, memory: dict) -> list[dict]:
    rows = []
    for precision in PRECISIONS:
        ours = got[precision]["logitlab"]
        for engine, v in got[precision].items():
            side = engines[engine][precision]
            tok_s = statistics.median(v["tok_s"])
            row = dict(precision=precision, engine=engine, format=_format(engine, precision, side),
                       tok_s=v["tok_s"], median_tok_s=tok_s, bytes_per_token=side["bytes"],
                       bandwidth=bandwidth(side["bytes"], tok_s), agree=agreement(v["tokens"], ours["tokens"]))
            row["read_share"] = row["bandwidth"] / memory["read"]
            if engine != "logitlab":
                row["logitlab_ratio"] = ratios(ours["tok_s"], v["tok_s"])
            rows.append(row)
    return rows


def _format(engine: str, precision: str, side: dict) -> str:
    if engine == "llama.cpp":
        return side["qtype"]
    if engine == "logitlab" and precision != "bf16":
        return f"{precision} ({side['route']} kernels)"
    return precision


def render(result: dict) -> str:
    def ratio(row):
        r = row.get("logitlab_ratio")
        return f"**{r['median']:.2f}** ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
    by = {(r["precision"], r["engine"]): r for r in result["rows"]}
    ratio_rows = [[p, *(ratio(by[(p, e)]) if (p, e) in by else "-" for e in ("gpt-fast", "llama.cpp"))]
                  for p in PRECISIONS]
    rows = [[r["precision"], r["engine"], r["format"], f"{r['median_tok_s']:.1f} ({min(r['tok_s']):.1f}-{max(r['tok_s']):.1f})",
             f"{r['bytes_per_token'] / 1e6:,.0f}", f"{r['bandwidth'] / 1e9:.1f}", f"{r['read_share']:.0%}",
             f"{r['agree']} of {result['new_tokens']}"] for r in result["rows"]]
    m, mem, c = result["machine"], result["memory"], result["config"]
    missing = "".join(f"\n- {engine} skipped: {why}" for engine, why in result["missing"].items())
    return f"""Batch-1 greedy decode of a Llama-shaped model with random weights (`--shape {result['shape']}`:
{result['params'] / 1e6:,.0f}M parameters, {c['n_layers']} layers, d {c['d_model']}, {c['n_heads']} heads / {c['n_kv_heads']} KV heads,
d_ff {c['d_ff']}, vocabulary {c['vocab_size']}, untied head), {result['new_tokens']} new tokens after a {result['prompt']}-token prompt,
in bf16 and quantized (int4: groups of {result['group_size']} for logitlab and gpt-fast; llama.cpp's Q4_0 and Q8_0
use blocks of 32), {'compiled' if result['compile'] else 'eager'} torch sides. All engines in one process, taking turns, {result['repeats']} rounds after a
warm-up; tok/s: median over rounds (min-max), decode steps only, timed by {'process CPU time' if result['clock'] == 'cpu' else 'wall time'}. Ratios: logitlab / peer per round
(> 1: logitlab faster). Bandwidth: weights read per token x tok/s, against this machine's read
bandwidth measured in the same run ({mem['read'] / 1e9:.1f} GB/s, sum over {mem['gib']:g} GiB; copy {mem['copy'] / 1e9:.1f} GB/s
counting bytes read and written). "Same tokens": leading greedy ids equal to logitlab's at that
precision (random weights give near-flat logits, so rounding differences flip near-ties early;
the quantized sides also quantize differently). The machine was shared with other jobs.{missing}

Command: `{result['command'].replace(' --no-doc', '')}` — machine: {m['nproc']} CPUs ({m['cpu']};
{", ".join(result['cpu_flags']) or "no listed features"}), torch {m['torch']} ({result['threads']} threads), llama-cpp-python
{result.get('llama_cpp') or '-'}, commit {m['commit']}, load average {m.get('load_avg_1m', '-')} at the end.

{markdown_table(["precision", "logitlab vs gpt-fast", "logitlab vs llama.cpp"], ratio_rows)}

{markdown_table(["precision", "engine", "format", "decode tok/s", "MB read / token", "GB/s", "of read bandwidth",
                 "same tokens"], rows)}
""" + "".join(f"\nlogitlab at {p}, one generation under torch.profiler (operators by their own CPU time):\n\n```text\n"
              f"{text}\n```\n" for p, text in result.get("profiles", {}).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt-fast", metavar="FOLDER", help="a clone of gpt-fast outside this repository (skipped without)")
    parser.add_argument("--shape", default="small", choices=list(SHAPES),
                        help="model size: small (~250M, default), 0.5b (~430M), 1b (~1.1B), tiny (a smoke run)")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="int4 group size (default 128)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length (random ids)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="threads for torch and llama.cpp (default 1)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu",
                        help="time decode steps by this process's CPU time (cpu, default: holds on a shared machine "
                             "with one thread) or wall time")
    parser.add_argument("--compile", action="store_true", help="compile logitlab's and gpt-fast's decode steps")
    parser.add_argument("--profile", nargs="*", default=[], choices=PRECISIONS,
                        help="after the rounds, profile one logitlab generation at these precisions (torch.profiler)")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0)
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    add_section_option(parser, TITLE)
    args = parser.parse_args(argv)
    if not 2 <= args.new_tokens <= 400:
        parser.error(f"--new-tokens must be in 2..400, got {args.new_tokens}")
    import torch

    torch.set_num_threads(args.threads)
    _CLOCK[0] = CLOCKS[args.clock]
    config = model_config(args.shape)
    memory = measure_memory(args.bandwidth_gib)
    print(f"memory: read {memory['read'] / 1e9:.1f} GB/s, copy {memory['copy'] / 1e9:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        engines, missing = build_sides(args, config, Path(tmp))
        for engine, why in missing.items():
            print(f"{engine} skipped: {why}", flush=True)
        prompt = torch.randint(0, config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        got = run_rounds(engines, prompt, args.new_tokens, args.repeats, report=lambda s: print(s, flush=True))
        rows = summarize(engines, got, memory)
        profiles = {p: profile(engines["logitlab"][p], prompt, args.new_tokens) for p in args.profile}
    for p, text in profiles.items():
        print(f"profile of logitlab at {p}:\n{text}", flush=True)
    result = {"command": command_line(), "machine": machine_info(), "cpu_flags": cpu_flags(), "shape": args.shape,
              "config": SHAPES[args.shape], "params": _params(config), "group_size": args.group_size,
              "new_tokens": args.new_tokens, "prompt": args.prompt, "repeats": args.repeats, "threads": args.threads,
              "compile": args.compile, "clock": args.clock, "memory": memory, "missing": missing, "llama_cpp": _version("llama_cpp"),
              "rows": rows, "profiles": profiles}
    publish(results_name("quant_decode", args.section, TITLE), args.section, result, render, doc=not args.no_doc)
    return 0


def _params(config) -> int:
    from logitlab.model.accounting import count_parameters

    return count_parameters(config).total


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
