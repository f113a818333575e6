"""`python3 -m bench.serve_load [--quick] [--no-doc] [--clients N]`: a bounded load test of the server.

A random model behind `logitlab.serve` on a loopback port (uvicorn, the real ASGI stack). N clients
stream greedy completions at once; then the same requests run one at a time. Every completion must
equal `generate` on its prompt alone (the batch changes nothing a client sees); the report gives the
throughput (generated tokens per second of wall time), the latency p50 / p99 (request sent -> last
token) and the time to first token, for both, and the engine's batch sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import threading
import time

import torch

from bench.common import command_line, machine_info, markdown_table, publish
from logitlab.generate import SampleConfig, generate
from logitlab.model import ModelConfig, Transformer
from logitlab.serve.app import create_app
from logitlab.tokenizer.core import Tokenizer

WORDS = "the of and to in is that for it as with was on be by this are from at or an".split()


def _setup(quick: bool):
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens={"<|endoftext|>": 256})
    torch.manual_seed(0)
    size = dict(d_model=64, n_layers=2, n_heads=4) if quick else dict(d_model=256, n_layers=4, n_heads=8)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=256, norm="rmsnorm", mlp="swiglu",
                      positions="rope", bias=False, **size)
    return Transformer(cfg).eval(), tok


def _prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def _serve(app):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


async def _one(http, url: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion -> text, latency, time to first token."""
    body = dict(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    start, first, text = time.perf_counter(), None, []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
    end = time.perf_counter()
    return dict(text="".join(text), latency=end - start, ttft=(first or end) - start)


async def _run(url: str, prompts: list[str], max_tokens: int, concurrent: bool) -> tuple[list[dict], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        if concurrent:
            out = await asyncio.gather(*(_one(http, url, p, max_tokens) for p in prompts))
        else:
            out = [await _one(http, url, p, max_tokens) for p in prompts]
        return list(out), time.perf_counter() - start


def _summary(results: list[dict], wall: float, tokens: int) -> dict:
    lat = sorted(r["latency"] for r in results)
    p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
    return dict(wall_s=wall, tokens_per_s=tokens / wall, p50_latency_s=statistics.median(lat), p99_latency_s=p99,
                p50_ttft_s=statistics.median(r["ttft"] for r in results))


def run(clients: int, max_tokens: int, quick: bool) -> dict:
    model, tok = _setup(quick)
    prompts = _prompts(clients)
    want = []
    for p in prompts:
        ids = generate(model, tok.encode(p), SampleConfig(max_new_tokens=max_tokens, temperature=0),
                       eot_id=tok.eot_id).tokens[0]
        want.append(tok.decode([i for i in ids if i != tok.eot_id]))
    app = create_app(model, tok, name="bench", max_batch=clients)
    server, thread, url = _serve(app)
    engine = app.state.served.engine
    try:
        asyncio.run(_run(url, prompts[:2], 4, concurrent=False))  # warm-up
        together, wall_together = asyncio.run(_run(url, prompts, max_tokens, concurrent=True))
        stats = dict(engine.stats)
        alone, wall_alone = asyncio.run(_run(url, prompts, max_tokens, concurrent=False))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    mismatched = [i for i, r in enumerate(together) if r["text"] != want[i]]
    mismatched += [i for i, r in enumerate(alone) if r["text"] != want[i]]
    tokens = sum(len(tok.encode(w)) for w in want)  # byte tokenizer: the generated tokens, re-encoded
    return dict(machine=machine_info(), command=command_line(), clients=clients, max_tokens=max_tokens,
                model=dict(d_model=model.config.d_model, n_layers=model.config.n_layers), tokens=tokens,
                concurrent=_summary(together, wall_together, tokens), sequential=_summary(alone, wall_alone, tokens),
                engine=stats, mismatched=sorted(set(mismatched)))


def render(r: dict) -> str:
    rows = [[name, f"{s['tokens_per_s']:.0f}", f"{s['p50_latency_s'] * 1000:.0f}", f"{s['p99_latency_s'] * 1000:.0f}",
             f"{s['p50_ttft_s'] * 1000:.0f}", f"{s['wall_s']:.2f}"]
            for name, s in (("one at a time", r["sequential"]), (f"{r['clients']} at once", r["concurrent"]))]
    speed = r["concurrent"]["tokens_per_s"] / r["sequential"]["tokens_per_s"]
    m = r["model"]
    return (f"`{r['command']}`: {r['clients']} streaming clients, greedy, {r['max_tokens']} tokens each, a random "
            f"model (d_model {m['d_model']}, {m['n_layers']} layers) on {r['machine']['nproc']} cores. Every "
            f"completion equals `generate` on its prompt alone ({len(r['mismatched'])} differ).\n\n"
            + markdown_table(["requests", "tokens/s", "p50 latency ms", "p99 latency ms", "p50 first token ms",
                              "wall s"], rows)
            + f"\n\nBatched throughput is {speed:.1f}x one-at-a-time; the engine decoded up to "
              f"{r['engine']['max_rows']} requests per step, with {r['engine']['rebuilds']} rebuilds and "
              f"{r['engine']['inserts']} joins into a free slot.")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.serve_load")
    p.add_argument("--quick", action="store_true", help="a smaller model and 8 clients")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite the section of docs/benchmarks.md")
    p.add_argument("--clients", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    clients = args.clients or (8 if args.quick else 32)
    result = run(clients, args.max_tokens, args.quick)
    print(render(result))
    publish("serve_load", "Serving", result, render, quick=args.quick, doc=not args.no_doc)
    return 1 if result["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
