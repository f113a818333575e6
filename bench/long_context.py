"""Cost at long context: forward and training tokens/s and peak memory against context length,
SDPA against eager attention, beside the FLOP model's prediction (logitlab.model.accounting).

Per token, a forward pass costs 2 * (matrix parameters) FLOPs whatever T is, plus attention's
QK^T and attention.V, 2 * T * H * Dh FLOPs per attention layer for a causal query (it reads T/2
keys on average). The attention term grows with T; the FLOP model puts the context where it
equals the MLP's 6 * D * F per layer at T = 3 D F / (H Dh), and where it equals every dense
matrix product at T = matmul_params / (H Dh L). The measured side fits the forward time per
token to a + b * T and reports a / b, the context where the T-proportional part overtakes the rest.

Peak memory is the rise of the peak resident set (VmHWM) over one training step, each in a fresh
interpreter (so memory an earlier step left to the allocator does not hide it); CPU-only (Linux
/proc). Eager attention materialises the (B, H, T, T) weights of every layer for backward, SDPA
does not.

    python3 -m bench.long_context [--quick] [--lengths 256,512,1024,2048] [--threads 2]

Results: bench/results/long_context.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import machine_info, markdown_table, publish, reset_peak_rss, rss_kib, run_child
from logitlab.model import ModelConfig, Transformer
from logitlab.model.accounting import flops_per_token, matmul_params

SHAPE = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=4, norm="rmsnorm", mlp="swiglu", positions="rope",
             bias=False, d_ff=768)


def _median_seconds(fn, repeats: int) -> float:
    fn()                                                           # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: Transformer, T: int, impl: str, repeats: int) -> dict:
    """Forward and training tokens/s at context T (batch 1), and the training step's peak memory rise."""
    model.attn_impl = impl
    ids = torch.randint(0, SHAPE["vocab_size"], (1, T + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]

    def forward():
        with torch.no_grad():
            model(x)

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    fwd, train = _median_seconds(forward, repeats), _median_seconds(step, repeats)
    return {"T": T, "impl": impl, "forward_tok_s": round(T / fwd, 1), "train_tok_s": round(T / train, 1),
            "forward_s_per_token": fwd / T}


def peak_rise_mib(T: int, impl: str) -> float:
    """In this (fresh) process: the rise of the peak resident set over one training step at T."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SHAPE, context_length=T))
    model.attn_impl = impl
    ids = torch.randint(0, SHAPE["vocab_size"], (1, T + 1), generator=torch.Generator().manual_seed(0))
    base = reset_peak_rss()
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    # the kernel counts resident pages lazily: a rise of a few pages can read as a small negative one
    return max(0.0, round((rss_kib("VmHWM") - base) / 1024, 1))


def predicted(config: ModelConfig) -> dict:
    """The FLOP model's crossovers: attention = MLP, and attention = every dense product."""
    c = config
    per_key = c.n_heads * c.head_dim * c.n_layers                  # attention FLOPs = 2 * T * per_key
    mlp = 6 * c.d_model * c.d_ff * c.n_layers
    return {"attention_equals_mlp": round(mlp / (2 * per_key)),
            "attention_equals_dense": round(2 * matmul_params(c) / (2 * per_key))}


def fitted_crossover(rows: list[dict], impl: str) -> float | None:
    """a / b of the least-squares fit forward_s_per_token = a + b * T over this impl's rows."""
    pts = [(r["T"], r["forward_s_per_token"]) for r in rows if r["impl"] == impl]
    if len(pts) < 2:
        return None
    mt, ms = statistics.fmean(t for t, _ in pts), statistics.fmean(s for _, s in pts)
    b = sum((t - mt) * (s - ms) for t, s in pts) / sum((t - mt) ** 2 for t, _ in pts)
    a = ms - b * mt
    return round(a / b) if b > 0 and a > 0 else None


def run(lengths: list[int], repeats: int = 3, threads: int = 1, memory: bool = True) -> dict:
    torch.manual_seed(0)
    config = ModelConfig(**SHAPE, context_length=max(lengths))
    model = Transformer(config)
    rows = [measure(model, T, impl, repeats) for T in lengths for impl in ("sdpa", "eager")]
    for r in rows:                                                 # memory: a fresh interpreter each
        r["train_peak_mib"] = None if not memory else float(run_child("bench.long_context", "--peak", {"T": r["T"], "impl": r["impl"],
                                                                              "threads": threads})[-1])
        f = flops_per_token(config, r["T"])
        r["attention_flop_share"] = round(f["attention"] / f["forward"], 3)
    return {"shape": SHAPE, "lengths": lengths, "rows": rows, "predicted": predicted(config),
            "fitted": {impl: fitted_crossover(rows, impl) for impl in ("sdpa", "eager")},
            "machine": machine_info()}


def render(result: dict) -> str:
    heads = ["T", "impl", "forward tok/s", "train tok/s", "train peak MiB", "attention FLOP share"]
    body = [[r["T"], r["impl"], f"{r['forward_tok_s']:.0f}", f"{r['train_tok_s']:.0f}", "-" if r["train_peak_mib"] is None else f"{r['train_peak_mib']:.1f}",
             f"{r['attention_flop_share']:.2f}"] for r in result["rows"]]
    p, fit = result["predicted"], result["fitted"]
    return (markdown_table(heads, body) + f"\n\nFLOP model: attention overtakes the MLP at T = {p['attention_equals_mlp']}"
            f" and every dense product at T = {p['attention_equals_dense']}; measured (forward time per token "
            f"= a + b T, a / b): sdpa {fit['sdpa']}, eager {fit['eager']}.")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="lengths 128, 256, 512, one repeat")
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak", default=None, help=argparse.SUPPRESS)        # the child of peak_rise_mib
    parser.add_argument("--no-doc", action="store_true", help="accepted for `python3 -m bench`; nothing to update")
    args = parser.parse_args(argv)
    if args.peak:
        spec = json.loads(args.peak)
        torch.set_num_threads(spec["threads"])
        print(peak_rise_mib(spec["T"], spec["impl"]))
        return
    torch.set_num_threads(args.threads)
    lengths = [128, 256, 512] if args.quick else [int(x) for x in args.lengths.split(",")]
    result = run(lengths, repeats=1 if args.quick else 3, threads=args.threads)
    print(render(result))
    publish("long_context", "Cost at long context", result, render, quick=args.quick, doc=False)


if __name__ == "__main__":
    main()
