"""The hybrid stack against transformers' Qwen3_5ForCausalLM (its torch fallbacks, as it runs on
a CPU), the same weights on both sides, and decode cost against context length per layer type.

Parts:
  chunks    the chunked form at chunk sizes 16, 32 and 64 against the default for this device;
  rule      the gated delta rule alone: logitlab's chunked form against transformers'
            torch_chunk_gated_delta_rule, forward and forward + backward;
  model     a small Qwen3.5-shaped model: forward, training step (forward + backward), and
            greedy decode tokens/s;
  context   decode memory (the cache's bytes) and step time at growing context lengths for full
            attention, a sliding window, StreamingLLM sinks and the hybrid; plotted to
            docs/hybrid_decode.png.

Each pair is timed alternately (bench.common.alternate) and reported as ratios (> 1: logitlab
faster).

    python3 -m bench.hybrid [--quick] [--no-doc] [--threads 2] [--cpu-time]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import ROOT, alternate, machine_info, markdown_table, publish, use_cpu_time

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096)
LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _rule_inputs(B, T, H, Dk, Dv):
    from logitlab.model.deltanet import l2_normalise

    g = torch.Generator().manual_seed(0)
    q = l2_normalise(torch.randn(B, T, H, Dk, generator=g))
    k = l2_normalise(torch.randn(B, T, H, Dk, generator=g))
    v = torch.randn(B, T, H, Dv, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    return q, k, v, decay, beta


# (B, T, H, D): the model part's own linear layers (8 value heads of 32), then wider and longer
RULE_SHAPES = [(4, 512, 8, 32), (1, 512, 8, 64), (2, 2048, 8, 64), (1, 4096, 16, 128)]


def bench_chunks(quick: bool) -> list[dict]:
    """The chunked form at each chunk size, forward and forward + backward, as time over the
    default size's (model.deltanet.default_chunk) on this machine: > 1 means slower."""
    from logitlab.model.deltanet import default_chunk, gated_delta_rule_chunked

    default = default_chunk(torch.device("cpu"))
    rows = []
    for B, T, H, D in RULE_SHAPES[:1] if quick else RULE_SHAPES:
        q, k, v, g, beta = _rule_inputs(B, T, H, D, D)
        for train in (False, True):
            def run(chunk):
                qq, kk, vv = (t.clone().requires_grad_(train) for t in (q * D ** -0.5, k, v))
                o = gated_delta_rule_chunked(qq, kk, vv, g, beta, chunk=chunk)[0]
                if train:
                    o.sum().backward()

            for chunk in (16, 32, 64):
                if chunk != default:
                    r = alternate(lambda: run(chunk), lambda: run(default), repeats=2 if quick else 4)
                    rows.append(dict(shape=f"B{B} T{T} H{H} D{D}", pass_="fwd+bwd" if train else "fwd",
                                     chunk=chunk, default=default, slowdown=1 / r["ratio"]))
    return rows


def bench_rule(quick: bool) -> list[dict]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from logitlab.model.deltanet import gated_delta_rule_chunked

    rows = []
    for B, T, H, D in RULE_SHAPES[:1] if quick else RULE_SHAPES:
        q, k, v, g, beta = _rule_inputs(B, T, H, D, D)
        for train in (False, True):
            def run(fn, scale):
                qq, kk, vv = (t.clone().requires_grad_(train) for t in (q * scale, k, v))
                o = fn(qq, kk, vv)
                if train:
                    o.sum().backward()

            ours = lambda: run(lambda a, b, c: gated_delta_rule_chunked(a, b, c, g, beta)[0], D ** -0.5)  # noqa: E731
            peer = lambda: run(lambda a, b, c: torch_chunk_gated_delta_rule(a, b, c, g=g, beta=beta)[0], 1.0)  # noqa: E731
            r = alternate(ours, peer, repeats=2 if quick else 4)
            rows.append(dict(part="rule", shape=f"B{B} T{T} H{H} D{D}", pass_="fwd+bwd" if train else "fwd", **r))
    return rows


def _pair_models():
    """transformers' model with random weights, and logitlab's loaded from its saved directory."""
    import tempfile

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from logitlab.io.hf import load_pretrained

    torch.manual_seed(0)
    peer = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SHAPE, num_hidden_layers=len(LAYERS), layer_types=LAYERS,
                                                tie_word_embeddings=True))
    with tempfile.TemporaryDirectory() as d:
        peer.save_pretrained(d)
        ours = load_pretrained(d)
    return ours, peer


def bench_model(quick: bool) -> list[dict]:
    from logitlab.generate import SampleConfig, generate

    ours, peer = _pair_models()
    rows = []
    B, T = (2, 256) if quick else (4, 512)
    ids = torch.randint(0, SHAPE["vocab_size"], (B, T))
    with torch.no_grad():
        ours.eval(), peer.eval()
        r = alternate(lambda: ours(ids), lambda: peer(ids).logits, repeats=2 if quick else 4)
        rows.append(dict(part="model", shape=f"B{B} T{T}", pass_="forward", **r))

    def step(model, logits_of):
        model.train()
        model.zero_grad(set_to_none=True)
        logits = logits_of(model(ids[:, :-1]))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()

    r = alternate(lambda: step(ours, lambda x: x), lambda: step(peer, lambda x: x.logits), repeats=2 if quick else 4)
    rows.append(dict(part="model", shape=f"B{B} T{T}", pass_="training step", **r))
    ours.eval(), peer.eval()
    n = 32 if quick else 128
    prompt = ids[:1, :64]
    cfg = SampleConfig(max_new_tokens=n, temperature=0)
    with torch.no_grad():
        r = alternate(lambda: generate(ours, prompt[0].tolist(), cfg),
                      lambda: peer.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False),
                      repeats=2 if quick else 3)
    r["tokens_per_s_ours"] = n / min(r["ours"])
    r["tokens_per_s_peer"] = n / min(r["peer"])
    rows.append(dict(part="model", shape=f"prompt 64, {n} new", pass_="greedy decode", **r))
    return rows


def _decode_cost(model, context: int, stream=None) -> tuple[int, float]:
    """(cache bytes, seconds per decode step) after a prompt of `context` tokens."""
    from logitlab.model.cache import KVCache

    cache = KVCache.for_model(model, 1, max_len=min(context + 9, model.config.context_length), stream=stream)
    ids = torch.randint(0, model.config.vocab_size, (1, context))
    with torch.no_grad():
        model(ids, cache=cache)
        token = ids[:, -1:]
        model(token, cache=cache)
        t0 = time.perf_counter()
        for _ in range(8):
            model(token, cache=cache)
        return cache.nbytes, (time.perf_counter() - t0) / 8


def bench_context(quick: bool) -> list[dict]:
    from logitlab.model.config import ModelConfig
    from logitlab.model.transformer import Transformer

    base = dict(vocab_size=4096, context_length=8192, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                head_dim=64, d_ff=768, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    kinds = {
        "full attention": (ModelConfig(**base), None),
        "sliding window 512": (ModelConfig(**base, layer_types=("sliding_attention",) * 4, sliding_window=512), None),
        "StreamingLLM 4 + 508": (ModelConfig(**base), (4, 508)),
        "hybrid 3 linear : 1 full": (ModelConfig(**base, layer_types=tuple(LAYERS), linear_n_k_heads=4,
                                                 linear_n_v_heads=8, linear_k_head_dim=32, linear_v_head_dim=32),
                                     None),
    }
    rows = []
    for name, (config, stream) in kinds.items():
        torch.manual_seed(0)
        model = Transformer(config).eval()
        for context in ([256, 1024] if quick else [256, 1024, 2048, 4096, 8000]):
            nbytes, seconds = _decode_cost(model, context, stream)
            rows.append(dict(part="context", kind=name, context=context, cache_mib=nbytes / 2**20,
                             ms_per_token=seconds * 1e3))
    return rows


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        a.plot([r["context"] for r in mine], [r["cache_mib"] for r in mine], marker="o", label=kind)
        b.plot([r["context"] for r in mine], [r["ms_per_token"] for r in mine], marker="o", label=kind)
    a.set(xlabel="context (tokens)", ylabel="decode cache (MiB)", title="memory")
    b.set(xlabel="context (tokens)", ylabel="ms per decoded token", title="speed")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "hybrid_decode.png", dpi=110)


READING = (
    "Reading it: both sides compute the same chunked form (transformers' torch fallback also inverts (I + A) "
    "per chunk with a triangular solve, in chunks of 64). logitlab's chunks of 16 keep the C x C work small, "
    "pad and transpose each input in one copy, and build no whole-sequence (B, H, N, C, D) intermediate that "
    "the products do not need: on a CPU each such tensor is a pass over memory, and those passes bound the "
    "rule. The model rows share everything else with transformers (the projections, the MLPs, full "
    "attention), so the rule's lead is diluted there. On a shared machine, time by CPU time on one thread "
    "(--threads 1 --cpu-time): with other jobs running, wall time swung the same pairs between 0.4x and 4x.")


def render(result: dict) -> str:
    rows = [[r["part"], r["shape"], r["pass_"], f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"]
            for r in result["pairs"]]
    table = markdown_table(["part", "shape", "pass", "logitlab vs transformers"], rows)
    ctx = markdown_table(["kind", "context", "cache MiB", "ms / token"],
                         [[r["kind"], r["context"], f"{r['cache_mib']:.2f}", f"{r['ms_per_token']:.2f}"]
                          for r in result["context"]])
    chunks = markdown_table(["shape", "pass", "chunk", f"time vs chunk {result['chunks'][0]['default']}"],
                            [[r["shape"], r["pass_"], r["chunk"], f"{r['slowdown']:.2f}x"] for r in result["chunks"]])
    m = result["machine"]
    return (f"`{result['command']}` on {m['cpu']} ({m['torch_threads']} thread(s), load {m.get('load_avg_1m')}), "
            f"torch {m['torch']}, transformers {m['transformers']}, timed by {result.get('clock', 'wall time')}. "
            "Ratios are transformers' time over "
            "logitlab's, the median of alternating pairs (min-max); > 1 means logitlab is faster.\n\n"
            f"{table}\n\nThe chunked form's chunk size on this machine (the default is fixed per device "
            "type, model.deltanet.CHUNK; > 1 means the other size is slower):\n\n"
            f"{chunks}\n\n{READING}\n\nDecode cost against context length (one sequence, fp32):\n\n{ctx}\n\n"
            "![decode memory and speed against context](hybrid_decode.png)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with process CPU time instead of wall time (for --threads 1 on a loaded machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = use_cpu_time(args.cpu_time)
    pairs = bench_rule(args.quick) + bench_model(args.quick)
    chunks = bench_chunks(args.quick)
    context = bench_context(args.quick)
    if not args.no_doc:
        plot(context)
    import sys

    result = dict(command=" ".join(["python3 -m bench.hybrid", *sys.argv[1:]]), machine=machine_info(),
                  clock=clock, pairs=pairs, chunks=chunks,
                  context=context)
    for r in pairs:
        print(f"{r['part']:6} {r['shape']:22} {r['pass_']:14} {r['ratio']:.2f}x")
    publish("hybrid", "Hybrid stack (Gated DeltaNet) against transformers", result, render,
            quick=args.quick, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
