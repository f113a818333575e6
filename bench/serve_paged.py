"""`python3 -m bench.serve_paged [--quick] [--no-doc]`: the paged engine against the contiguous one.

Both engines (logitlab.serve.paged_engine.PagedEngine and logitlab.serve.engine.Engine) serve the
same random model in one process, driven step by step (no HTTP: what is timed is the engine). Each
load is a closed loop of C clients (1, 8, 32): every client sends a request as soon as its last one
ended, each request a shared system prompt and a user part of mixed length, greedy, a mixed number
of new tokens. The two engines take turns per load (old, new, then new, old, ...). Reported: tokens
generated per second of wall time, p50 / p99 time to first token (sent -> first token) and
inter-token latency (gap between a request's consecutive tokens), the engines' counters (rebuilds,
tokens recomputed, prefix hits), how many requests' tokens differ between the two engines, and the
ratios new / old. Then the time to first token of a request whose 1,000-token prefix is cached
against the same request with prefix caching off, alternating, median of the pairs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from bench.common import command_line, machine_info, markdown_table, publish
from logitlab.generate import SampleConfig
from logitlab.model import ModelConfig, Transformer
from logitlab.serve.engine import Engine, TokenEvent
from logitlab.serve.paged_engine import PagedEngine

ENGINES = ("contiguous", "paged")
SYSTEMS = (64, 256)     # ids of the system prompt every request starts with: a short and a long one


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
    ttft = sorted(r["times"][0] - r["sent"] for r in out.values())
    itl = sorted(b - a for r in out.values() for a, b in zip(r["times"], r["times"][1:]))
    tokens = sum(len(r["tokens"]) for r in out.values())
    q = lambda xs, p: xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]  # noqa: E731
    stats = dict(engine.stats)
    return dict(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, ttft_p50_ms=1e3 * statistics.median(ttft),
                ttft_p99_ms=1e3 * q(ttft, 0.99), itl_p50_ms=1e3 * statistics.median(itl), itl_p99_ms=1e3 * q(itl, 0.99),
                rebuilds=stats.get("rebuilds", 0), tokens_recomputed=stats.get("tokens_recomputed", 0),
                prefix_hit_tokens=stats.get("prefix_hit_tokens", 0),
                outputs=[out[i]["tokens"] for i in range(len(requests))])


def _loads(model, quick: bool) -> list[dict]:
    rows = []
    for system in SYSTEMS:
        for turn, clients in enumerate((1, 8, 32)):
            requests = _workload(clients * (4 if clients == 1 else 3) * (1 if quick else 2), system, seed=clients)
            order = ENGINES if turn % 2 == 0 else ENGINES[::-1]
            res = {kind: _load(_engine(kind, model, clients), requests, clients) for kind in order}
            differ = sum(a != b for a, b in zip(res["paged"].pop("outputs"), res["contiguous"].pop("outputs")))
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


def run(quick: bool) -> dict:
    model = _model(quick)
    return dict(machine=machine_info(), command=command_line(),
                model=dict(d_model=model.config.d_model, n_layers=model.config.n_layers), loads=_loads(model, quick),
                prefix=_prefix(model, 3 if quick else 5), gathers=_gathers(model, 16, 10 if quick else 30))


def render(r: dict) -> str:
    rows = []
    for load in r["loads"]:
        old, new = load["contiguous"], load["paged"]
        head = [str(load["system"]), str(load["clients"])]
        for name, s in (("contiguous", old), ("paged", new)):
            rows.append(head + [name, f"{s['tokens_per_s']:.0f}", f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}",
                                f"{s['itl_p50_ms']:.1f}", f"{s['itl_p99_ms']:.1f}", str(s["rebuilds"]),
                                str(s["tokens_recomputed"]), str(s["prefix_hit_tokens"])])
        ratio = lambda key: f"{new[key] / old[key]:.2f}x"  # noqa: E731
        rows.append(head + ["**paged / contiguous**", f"**{ratio('tokens_per_s')}**", ratio("ttft_p50_ms"),
                            ratio("ttft_p99_ms"), ratio("itl_p50_ms"), ratio("itl_p99_ms"), "", "", ""])
    p, m, g = r["prefix"], r["model"], r["gathers"]
    differ = sum(load["differ"] for load in r["loads"])
    return (f"`{r['command']}`: a random model (d_model {m['d_model']}, {m['n_layers']} layers, context 1280) on "
            f"{r['machine']['nproc']} cores ({r['machine']['torch_threads']} torch thread) of a shared, loaded machine (other jobs running: absolute times swing, "
            "the ratios within one run are the result). Closed-loop clients (each sends its next request when its "
            "last one ends), each request a shared system prompt (64 or 256 ids) and a 4..96-id user part, greedy, "
            "8..40 new tokens; the engines take turns per load, both with max_batch = clients, the paged one with "
            f"its defaults (blocks of 16, 128 prompt ids a step). {differ} request(s) got other tokens from the two "
            "engines.\n\n"
            + markdown_table(["system ids", "clients", "engine", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                              "ITL p50 ms", "ITL p99 ms", "rebuilds", "tokens recomputed", "prefix hit tokens"], rows)
            + f"\n\nTime to first token of a request whose 1,000-id prefix is cached: {p['cached_ms']:.0f} ms, against "
              f"{p['uncached_ms']:.0f} ms with prefix caching off ({p['ratio']:.1f}x, min {p['ratio_min']:.1f}x, max "
              f"{p['ratio_max']:.1f}x over {p['repeats']} pairs) and {p['contiguous_ms']:.0f} ms for the contiguous "
              f"engine.\n\nA decode step of {g['rows']} rows: {g['index_ms']:.1f} ms with the index gather, "
              f"{g['reference_ms']:.1f} ms with the reference loop ({g['ratio']:.1f}x, median of alternating pairs); "
              "the index gather is the default.")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.serve_paged")
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer requests")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite the section of docs/benchmarks.md")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.quick)
    print(render(result))
    publish("serve_paged", "Serving: paged against contiguous", result, render, quick=args.quick,
            doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
