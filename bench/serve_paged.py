"""`python3 -m bench.serve_paged [--quick] [--no-doc]`: the paged engine against the contiguous one and
against transformers' continuous batching.

Both engines (logitlab.serve.paged_engine.PagedEngine and logitlab.serve.engine.Engine) serve the
same random model in one process, driven step by step (no HTTP: what is timed is the engine). The
peer is transformers' own continuous batching (`init_continuous_batching`: its
ContinuousBatchingManager, a paged cache with prefix sharing, run in its background thread) on the
same weights loaded into a transformers LlamaForCausalLM, in the same process. Each load is a
closed loop of C clients (1, 8, 32): every client sends a request as soon as its last one ended,
each request a shared system prompt and a user part of mixed length, greedy, a mixed number of new
tokens. The sides take turns per load (the order rotates). Reported: tokens generated per second of
wall time, p50 / p99 time to first token (sent -> first token) and inter-token latency (gap between
a request's consecutive tokens; transformers' own per-token timestamps), the engines' counters
(rebuilds, tokens recomputed, prefix hits), how many requests' tokens differ from the paged
engine's, and the ratios paged / contiguous and paged / transformers. Then the time to first token
of a request whose 1,000-token prefix is cached against the same request with prefix caching off,
alternating, median of the pairs.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time

import torch

from bench.common import command_line, machine_info, markdown_table, publish
from logitlab.generate import SampleConfig
from logitlab.model import ModelConfig, Transformer
from logitlab.model.hf_config import config_to_hf
from logitlab.model.keymap import state_dict_to_hf
from logitlab.serve.engine import Engine, TokenEvent
from logitlab.serve.paged_engine import PagedEngine

ENGINES = ("contiguous", "paged")
PEER = "transformers"
SYSTEMS = (64, 256)     # ids of the system prompt every request starts with: a short and a long one
CHUNK = 128             # prompt ids a step: the paged engine's default, and the peer's budget beyond its decode rows


def _model(quick: bool) -> Transformer:
    torch.manual_seed(0)
    size = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2) if quick else \
        dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2)
    cfg = ModelConfig(vocab_size=257, context_length=1280, norm="rmsnorm", mlp="swiglu", positions="rope",
                      bias=False, **size)
    return Transformer(cfg).eval()


def _engine(kind: str, model, max_batch: int, prefix_caching: bool = True):
    if kind == "contiguous":
        return Engine(model, max_batch=max_batch)
    return PagedEngine(model, max_batch=max_batch, prefix_caching=prefix_caching)


def transformers_twin(model):
    """The same weights as a transformers model with SDPA attention -> (model, None), or (None, why not)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        return None, f"transformers is not installed ({exc})"
    cfg = AutoConfig.for_model(**{**config_to_hf(model.config), "bos_token_id": None, "eos_token_id": None})
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    hf.load_state_dict(state_dict_to_hf(model.state_dict(), model.config), strict=not cfg.tie_word_embeddings)
    return hf, None


def _load_transformers(hf, requests: list, clients: int) -> dict:
    """`requests` through transformers' continuous batching by `clients` closed-loop clients, as _load:
    a manager sized like the paged engine (blocks of 16, room for `clients` whole contexts, at most
    `clients` rows and clients + CHUNK tokens a forward, prefix sharing on), no CUDA graphs, no compile."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    context = hf.config.max_position_embeddings
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=clients * (-(-context // 16) + 1),
                                  max_batch_tokens=CHUNK + clients, max_requests_per_batch=clients,
                                  allow_block_sharing=True, use_cuda_graph=False, use_async_batching=False)
    manager = hf.init_continuous_batching(generation_config=GenerationConfig(do_sample=False, eos_token_id=-1,
                                                                             pad_token_id=0),
                                          continuous_batching_config=cb)
    manager.start()
    todo, ids, done = list(enumerate(requests)), {}, {}
    t0 = time.perf_counter()

    def send():
        i, (prompt, n) = todo.pop(0)
        ids[manager.add_request(prompt, max_new_tokens=n, record_timestamps=True, eos_token_id=-1)] = i

    try:
        for _ in range(min(clients, len(todo))):
            send()
        while len(done) < len(requests):
            out = manager.get_result(timeout=600)
            if out is None or out.error is not None:
                raise RuntimeError(f"transformers' continuous batching: {'no result' if out is None else out.error}")
            if out.is_finished():
                done[ids[out.request_id]] = out
                if todo:
                    send()
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    out = [done[i] for i in range(len(requests))]
    return _timings(wall, [(r.created_time, r.timestamps, r.generated_tokens) for r in out], {})


def _timings(wall: float, runs: list, stats: dict) -> dict:
    """wall seconds, [(sent, token times, tokens) per request], an engine's counters -> the reported numbers."""
    ttft = sorted(times[0] - sent for sent, times, _ in runs)
    itl = sorted(b - a for _, times, _ in runs for a, b in zip(times, times[1:]))
    tokens = sum(len(t) for _, _, t in runs)
    q = lambda xs, p: xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]  # noqa: E731
    return dict(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, ttft_p50_ms=1e3 * statistics.median(ttft),
                ttft_p99_ms=1e3 * q(ttft, 0.99), itl_p50_ms=1e3 * statistics.median(itl), itl_p99_ms=1e3 * q(itl, 0.99),
                rebuilds=stats.get("rebuilds", 0), tokens_recomputed=stats.get("tokens_recomputed", 0),
                prefix_hit_tokens=stats.get("prefix_hit_tokens", 0), outputs=[list(t) for _, _, t in runs])


def _workload(n: int, system: int, seed: int) -> list[tuple[list[int], int]]:
    """n requests: (system prompt + a user part of 4..96 ids, 8..40 new tokens)."""
    rng = random.Random(seed)
    head = [rng.randrange(1, 256) for _ in range(system)]
    return [(head + [rng.randrange(1, 256) for _ in range(rng.randint(4, 96))], rng.randint(8, 40))
            for _ in range(n)]


def _load(engine, requests: list, clients: int) -> dict:
    """Run `requests` through `engine` by `clients` closed-loop clients -> timings and tokens."""
    todo, out, t0 = list(enumerate(requests)), {}, time.perf_counter()

    def send():
        i, (prompt, n) = todo.pop(0)
        rec = out[i] = dict(sent=time.perf_counter(), times=[], tokens=[])

        def emit(event):
            if isinstance(event, TokenEvent):
                rec["times"].append(time.perf_counter())
                rec["tokens"].append(event.token)
            elif todo:
                send()
        engine.submit(prompt, SampleConfig(max_new_tokens=n, temperature=0), emit)

    for _ in range(min(clients, len(todo))):
        send()
    with torch.inference_mode():
        while engine.step() or engine.running or engine.waiting:
            pass
    wall = time.perf_counter() - t0
    runs = [(out[i]["sent"], out[i]["times"], out[i]["tokens"]) for i in range(len(requests))]
    return _timings(wall, runs, dict(engine.stats))


def _loads(model, quick: bool, hf=None) -> list[dict]:
    """Each load on each side (the peer's too when hf is a transformers twin), the order rotating."""
    rows, sides = [], ENGINES + ((PEER,) if hf is not None else ())
    for system in SYSTEMS:
        for turn, clients in enumerate((1, 8, 32)):
            requests = _workload(clients * (4 if clients == 1 else 3) * (1 if quick else 2), system, seed=clients)
            order = sides[turn % len(sides):] + sides[:turn % len(sides)]
            res = {kind: _load_transformers(hf, requests, clients) if kind == PEER else
                   _load(_engine(kind, model, clients), requests, clients) for kind in order}
            outputs = {kind: r.pop("outputs") for kind, r in res.items()}
            differ = {kind: sum(a != b for a, b in zip(outputs["paged"], outputs[kind])) for kind in res if kind != "paged"}
            rows.append(dict(system=system, clients=clients, requests=len(requests), differ=differ, **res))
    return rows


def _gathers(model, rows: int, steps: int) -> dict:
    """Decode steps of `rows` rows with the index gather against the reference loop, alternating."""
    engines = {g: PagedEngine(model, max_batch=rows, gather=g) for g in ("index", "reference")}
    for e in engines.values():
        for i, (prompt, _) in enumerate(_workload(rows, SYSTEMS[0], seed=5)):
            e.submit(prompt, SampleConfig(max_new_tokens=10 * steps, temperature=0), lambda ev: None)
        with torch.inference_mode():
            while e.waiting or any(row.reading for row in e._rows):
                e.step()
    times = {g: [] for g in engines}
    with torch.inference_mode():
        for _ in range(steps):
            for g, e in engines.items():
                t = time.perf_counter()
                e.step()
                times[g].append(time.perf_counter() - t)
    ratios = sorted(r / i for i, r in zip(times["index"], times["reference"]))
    return dict(rows=rows, index_ms=1e3 * statistics.median(times["index"]),
                reference_ms=1e3 * statistics.median(times["reference"]), ratio=statistics.median(ratios))


def _growth(model, rows: int, steps: int) -> dict:
    """Decode steps of `rows` rows generating long outputs (every step's gather larger than any before):
    the index gather reading into the cache's reused buffer against a fresh tensor per layer (as before
    the buffer), alternating -> CPU ms and page faults (minor, process-wide) per step."""
    engines = {"reused": PagedEngine(model, max_batch=rows), "fresh": PagedEngine(model, max_batch=rows)}
    engines["fresh"].cache.read_slots = lambda j, pool, slots: pool.index_select(0, slots)
    for e in engines.values():
        for prompt, _ in _workload(rows, SYSTEMS[0], seed=5):
            e.submit(prompt, SampleConfig(max_new_tokens=10 * steps, temperature=0), lambda ev: None)
        with torch.inference_mode():
            while e.waiting or any(row.reading for row in e._rows):
                e.step()
    cpu, faults = {k: [] for k in engines}, {k: 0 for k in engines}
    with torch.inference_mode():
        for i in range(steps):
            for k in (("reused", "fresh") if i % 2 == 0 else ("fresh", "reused")):
                f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
                engines[k].step()
                cpu[k].append(time.process_time() - t)
                faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return dict(rows=rows, steps=steps, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in cpu.items()},
                **{f"{k}_faults": faults[k] / steps for k in engines},
                ratio=statistics.median(f / r for r, f in zip(cpu["reused"], cpu["fresh"])))


def _profile(model, system: int, clients: int) -> dict:
    """Where a paged engine's wall time goes over one load (timers around its parts) -> seconds per part."""
    from logitlab.model import attention, paged
    from logitlab.serve import paged_engine

    parts = {"forward": (paged_engine, "run"), "attention (SDPA)": (attention.F, "scaled_dot_product_attention"),
             "linear layers": (attention.F, "linear"), "K/V write + gather": (paged.PagedView, "_write_read"),
             "index tensors (PagedView)": (paged.PagedView, "__init__"),
             "choosing tokens (sampling, events, stops)": (PagedEngine, "_choose_rows"),
             "admission (prefix lookup, blocks)": (PagedEngine, "_admit")}
    spent = dict.fromkeys(parts, 0.0)

    def timer(name, fn):
        def timed_fn(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        return timed_fn

    saved = {name: getattr(owner, attr) for name, (owner, attr) in parts.items()}
    for name, (owner, attr) in parts.items():
        setattr(owner, attr, timer(name, saved[name]))
    try:
        requests = _workload(clients * 6, system, seed=clients)
        _load(_engine("paged", model, clients), requests, clients)            # warm: sizes seen, pages mapped
        spent.update(dict.fromkeys(parts, 0.0))
        res = _load(_engine("paged", model, clients), requests, clients)
    finally:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, saved[name])
    return dict(system=system, clients=clients, wall_s=res["wall_s"], parts=spent)


def _ttft(engine, prompt: list[int]) -> float:
    first = []
    engine.submit(prompt, SampleConfig(max_new_tokens=1, temperature=0),
                  lambda e: first.append(time.perf_counter()) if isinstance(e, TokenEvent) else None)
    start = time.perf_counter()
    with torch.inference_mode():
        while engine.step() or engine.running:
            pass
    return first[0] - start


def _prefix(model, repeats: int) -> dict:
    """TTFT of prefix (1,000 ids) + a new 16-id suffix: cached prefix against prefix caching off."""
    rng = random.Random(1)
    prefix = [rng.randrange(1, 256) for _ in range(1000)]
    suffix = lambda: [rng.randrange(1, 256) for _ in range(16)]  # noqa: E731
    warm, cold = _engine("paged", model, 4), _engine("paged", model, 4, prefix_caching=False)
    old = _engine("contiguous", model, 4)
    _ttft(warm, prefix + suffix())                                 # fills the cache with the prefix
    pairs = []
    for _ in range(repeats):
        p = prefix + suffix()
        pairs.append((_ttft(warm, p), _ttft(cold, p), _ttft(old, p)))
    ratios = sorted(c / w for w, c, _ in pairs)
    return dict(cached_ms=1e3 * statistics.median(w for w, _, _ in pairs),
                uncached_ms=1e3 * statistics.median(c for _, c, _ in pairs),
                contiguous_ms=1e3 * statistics.median(o for _, _, o in pairs),
                ratio=statistics.median(ratios), ratio_min=ratios[0], ratio_max=ratios[-1], repeats=repeats)


def run(quick: bool, runs: int = 1) -> dict:
    model = _model(quick)
    growth = _growth(model, 32, 20 if quick else 60)   # first: no larger gather freed before it in this process
    hf, peer_error = transformers_twin(model)
    if hf is not None:                                  # does it run here? (its error, word for word, if not)
        try:
            _load_transformers(hf, _workload(2, 16, seed=0), 2)
        except Exception as exc:  # noqa: BLE001  reported, not raised: the peer's failure is a result
            hf, peer_error = None, f"{type(exc).__name__}: {exc}"
    result = dict(machine=machine_info(), command=command_line(), peer_error=peer_error,
                  model=dict(d_model=model.config.d_model, n_layers=model.config.n_layers),
                  runs=[_loads(model, quick, hf) for _ in range(runs)], prefix=_prefix(model, 3 if quick else 5),
                  gathers=_gathers(model, 16, 10 if quick else 30), growth=growth,
                  profile=_profile(model, SYSTEMS[0], 8 if quick else 32))
    result["load_avg_end"] = round(os.getloadavg()[0], 2)
    return result


def _side_row(head: list[str], name: str, s: dict) -> list[str]:
    return head + [name, f"{s['tokens_per_s']:.0f}", f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}",
                   f"{s['itl_p50_ms']:.1f}", f"{s['itl_p99_ms']:.1f}", str(s["rebuilds"]),
                   str(s["tokens_recomputed"]), str(s["prefix_hit_tokens"])]


def _ratio_row(head: list[str], new: dict, old: dict, name: str) -> list[str]:
    ratio = lambda key: f"{new[key] / old[key]:.2f}x"  # noqa: E731
    return head + [f"**paged / {name}**", f"**{ratio('tokens_per_s')}**", ratio("ttft_p50_ms"), ratio("ttft_p99_ms"),
                   ratio("itl_p50_ms"), ratio("itl_p99_ms"), "", "", ""]


HEADERS = ["system ids", "clients", "engine", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
           "rebuilds", "tokens recomputed", "prefix hit tokens"]


def _tables(runs: list) -> str:
    """The first run in full (each side, then paged / each other side); every run's throughput ratios."""
    rows = []
    for load in runs[0]:
        head = [str(load["system"]), str(load["clients"])]
        others = [k for k in (*ENGINES, PEER) if k in load and k != "paged"]
        rows += [_side_row(head, k, load[k]) for k in ("paged", *others)]
        rows += [_ratio_row(head, load["paged"], load[k], k) for k in others]
    summary = []
    for i, loads in enumerate(runs, 1):
        for load in loads:
            tps = {k: load[k]["tokens_per_s"] for k in (*ENGINES, PEER) if k in load}
            summary.append([str(i), str(load["system"]), str(load["clients"]),
                            f"{tps['paged'] / tps['contiguous']:.2f}x",
                            f"{tps['paged'] / tps[PEER]:.2f}x" if PEER in tps else "-"])
    return (markdown_table(HEADERS, rows) + "\n\nTokens/s ratios of every run (> 1: the paged engine faster):\n\n"
            + markdown_table(["run", "system ids", "clients", "paged / contiguous", "paged / transformers"], summary))


def render(r: dict) -> str:
    p, m, g, mach = r["prefix"], r["model"], r["gathers"], r["machine"]
    loads = [load for run in r["runs"] for load in run]
    differ = {k: sum(load["differ"][k] for load in loads) for k in loads[0]["differ"]}
    peer = (f"transformers {mach.get('transformers')}'s continuous batching (init_continuous_batching: its "
            "ContinuousBatchingManager and paged cache, in its background thread; SDPA attention, float32, blocks "
            "of 16, prefix sharing on, at most clients + 128 tokens a forward, no CUDA graphs or compile) on the "
            "same weights as a LlamaForCausalLM" if r["peer_error"] is None else
            f"transformers' continuous batching did not run here: `{r['peer_error']}`")
    return (f"`{r['command']}` at commit {mach.get('commit')}: a random model (d_model {m['d_model']}, "
            f"{m['n_layers']} layers, context 1280) on {mach['nproc']} cores ({mach['torch_threads']} torch thread) "
            f"of a shared machine loaded by other jobs (load average {mach.get('load_avg_1m')} at the start, "
            f"{r.get('load_avg_end')} at the end: absolute times swing, the ratios within one run are the result). "
            "Closed-loop clients (each sends its next request when its last one ends), each request a shared "
            "system prompt (64 or 256 ids) and a 4..96-id user part, greedy, 8..40 new tokens; the sides take "
            "turns per load, all with at most `clients` rows, the paged engine with its defaults (blocks of 16, "
            f"128 prompt ids a step). The peer: {peer}. Requests whose tokens differ from the paged engine's, over "
            f"{len(r['runs'])} run(s): " + ", ".join(f"{k} {n}" for k, n in differ.items()) + ".\n\n"
            + _tables(r["runs"])
            + f"\n\nTime to first token of a request whose 1,000-id prefix is cached: {p['cached_ms']:.0f} ms, against "
              f"{p['uncached_ms']:.0f} ms with prefix caching off ({p['ratio']:.1f}x, min {p['ratio_min']:.1f}x, max "
              f"{p['ratio_max']:.1f}x over {p['repeats']} pairs) and {p['contiguous_ms']:.0f} ms for the contiguous "
              f"engine.\n\nA decode step of {g['rows']} rows: {g['index_ms']:.1f} ms with the index gather, "
              f"{g['reference_ms']:.1f} ms with the reference loop ({g['ratio']:.1f}x, median of alternating pairs); "
              "the index gather is the default.\n\n" + _more(r))


def _more(r: dict) -> str:
    """The growth measurement and the profile, in words and a table."""
    w, f = r["growth"], r["profile"]
    rows = [[name, f"{seconds:.2f}", f"{100 * seconds / f['wall_s']:.0f}%"] for name, seconds in f["parts"].items()]
    return (f"{w['rows']} rows generating long outputs (each step's gather larger than any before): a decode step "
            f"takes {w['reused_ms']:.1f} ms of CPU and {w['reused_faults']:.0f} page faults with the gather reading "
            f"into the cache's reused buffer, against {w['fresh_ms']:.1f} ms and {w['fresh_faults']:.0f} page faults "
            f"with a fresh tensor per layer ({w['ratio']:.2f}x, median of {w['steps']} alternating pairs).\n\n"
            f"Where the paged engine's time goes ({f['clients']} clients, system prompt of {f['system']} ids, one "
            f"load of {f['wall_s']:.1f} s after a warm-up load; timers around its parts, the forward's parts "
            "inside it):\n\n" + markdown_table(["part", "seconds", "share of the load"], rows))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.serve_paged")
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer requests")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite the section of docs/benchmarks.md")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    p.add_argument("--runs", type=int, default=1, help="run every load this many times (the table shows the first)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.quick, args.runs)
    print(render(result))
    publish("serve_paged", "Serving: paged against contiguous", result, render, quick=args.quick,
            doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
