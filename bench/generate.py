"""Generation speed: logitlab's prefill/decode loop vs transformers' generate, side by side.

Both sides get the same random weights (logitlab model -> logitlab.hf.save_pretrained ->
transformers.AutoModelForCausalLM.from_pretrained), the same prompts (B x 32 random ids, no
padding) and greedy decoding with a KV cache; neither is compiled. Each side is measured the
same way from outside: prefill = the time to generate 1 token, decode tokens/s =
B x (N - 1) / (time to generate N tokens - prefill). Runs alternate (ours, peer, ours, peer)
after a warm-up; ratios are peer time / our time per pair (> 1: logitlab faster).

    python3 -m bench.generate            # GPT-2-small shape and a small Llama, B 1 and 8, fp32 and bf16
    python3 -m bench.generate --quick    # fewer points and tokens, a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench.common import command_line, machine_info, markdown_table, update_doc_section, write_results
from logitlab.generate import SampleConfig, generate
from logitlab.hf import save_pretrained
from logitlab.model import ModelConfig, Transformer

SHAPES = {
    "gpt2-small": ModelConfig(vocab_size=50257, context_length=1024, d_model=768, n_layers=12, n_heads=12),
    "llama-small": ModelConfig(vocab_size=8192, context_length=1024, d_model=384, n_layers=6, n_heads=6,
                               n_kv_heads=2, d_ff=1024, norm="rmsnorm", mlp="swiglu", positions="rope",
                               bias=False, tie_embeddings=False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(shape: str, dtype: torch.dtype):
    """(logitlab model, transformers model) holding the same random weights, in eval mode."""
    import transformers

    torch.manual_seed(0)
    ours = Transformer(SHAPES[shape]).eval()
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(ours, d)
        peer = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval()
    peer.generation_config.eos_token_id = None
    peer.generation_config.pad_token_id = 0
    return ours.to(dtype), peer


def runners(ours, peer, prompts: torch.Tensor, compile: bool = False):
    """n -> a callable generating n tokens per row, for each side."""
    rows = prompts.tolist()
    mask = torch.ones_like(prompts)

    def run_ours(n):
        return lambda: generate(ours, rows, SampleConfig(temperature=0, max_new_tokens=n), compile=compile)

    def run_peer(n):
        return lambda: peer.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                     min_new_tokens=n)

    return run_ours, run_peer


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return time.perf_counter() - t0, out


def measure(shape: str, dtype_name: str, B: int, prompt_len: int, new: int, repeats: int,
            compile: bool = False) -> dict:
    ours, peer = build(shape, DTYPES[dtype_name])
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, SHAPES[shape].vocab_size, (B, prompt_len), generator=g)
    run_ours, run_peer = runners(ours, peer, prompts, compile)
    run_ours(4)(), run_peer(4)()  # warm-up
    got = {"ours": {"prefill": [], "total": []}, "peer": {"prefill": [], "total": []}}
    last = {}
    for _ in range(repeats):  # A B A B
        for side, run in (("ours", run_ours), ("peer", run_peer)):
            got[side]["prefill"].append(timed(run(1))[0])
            seconds, last[side] = timed(run(new))
            got[side]["total"].append(seconds)
    # greedy with the same weights: both sides should choose the same tokens
    same = last["ours"].tokens == last["peer"][:, prompt_len:].tolist()
    out = dict(shape=shape, dtype=dtype_name, batch=B, prompt=prompt_len, new_tokens=new, same_tokens=same)
    for side in ("ours", "peer"):
        pre, tot = got[side]["prefill"], got[side]["total"]
        tps = [B * (new - 1) / max(t - p, 1e-9) for p, t in zip(pre, tot)]
        out[side] = dict(prefill_ms=1e3 * statistics.median(pre), decode_tok_s=statistics.median(tps),
                         decode_tok_s_all=tps, prefill_s_all=pre, total_s_all=tot)
    ratios = [a / b for a, b in zip(out["ours"]["decode_tok_s_all"], out["peer"]["decode_tok_s_all"])]
    out["decode_ratio"] = statistics.median(ratios)
    out["decode_ratio_min"], out["decode_ratio_max"] = min(ratios), max(ratios)
    pre_ratios = [p / o for o, p in zip(out["ours"]["prefill_s_all"], out["peer"]["prefill_s_all"])]
    out["prefill_ratio"] = statistics.median(pre_ratios)
    return out


def render(payload: dict) -> str:
    """The docs/benchmarks.md section for one run's results."""
    info, results = payload["machine"], payload["results"]
    rows = [[r["shape"], r["dtype"], r["batch"], f"{r['ours']['decode_tok_s']:.1f}",
             f"{r['peer']['decode_tok_s']:.1f}",
             f"**{r['decode_ratio']:.2f}x** ({r['decode_ratio_min']:.2f}-{r['decode_ratio_max']:.2f})",
             f"{r['ours']['prefill_ms']:.1f}", f"{r['peer']['prefill_ms']:.1f}",
             "yes" if r["same_tokens"] else "no"] for r in results]
    table = markdown_table(["shape", "dtype", "B", "logitlab decode tok/s", "transformers decode tok/s",
                            "decode ratio (min-max)", "logitlab prefill ms", "transformers prefill ms",
                            "same tokens"], rows)
    return (f"Greedy generation with a KV cache, prompt 32 tokens, {payload['new_tokens']} new tokens per "
            f"row, no compilation, transformers `generate` as the peer (same weights via `save_pretrained`). "
            f"Median of {payload['repeats']} alternating pair(s) after a warm-up; ratio = logitlab decode "
            f"tok/s / transformers decode tok/s (> 1: logitlab faster).\n\n"
            f"Command: `{payload['command']}`  \nMachine: {info['nproc']} CPUs ({info['cpu']}), torch "
            f"{info['torch']} with {info['torch_threads']} thread(s), transformers {info['transformers']}, "
            f"commit {info['commit']}. The machine was shared with other work while this ran, so absolute "
            f"numbers move between runs; the ratios come from alternating runs.\n\n{table}\n\n"
            "Reading it: at batch 1 a decode step reads every weight once for one token, so both sides spend "
            "most of the step in the same matrix-vector products; what differs is the Python work around "
            "them (logitlab's loop adds about 0.1-0.3 ms per step over a bare cached forward). The prefill "
            "column includes the first token; logitlab's forward returns logits for every prompt position, "
            "transformers computes the LM head for the last one only (`logits_to_keep`). In bf16 the two "
            "sides round differently (transformers' GPT-2 fuses q/k/v into one projection), so after some "
            "steps a near-tie between two tokens of the random model can go the other way (\"same tokens: "
            "no\"); in fp32 they agree token for token.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the small Llama in fp32 at batch 1, 32 new tokens, one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="timed pairs per point (default 2; --quick 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per row (default 128; --quick 32)")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--batches", nargs="*", type=int, default=None,
                    help="batch sizes (default 1 8; --quick 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--compile", action="store_true", help="logitlab's decode step through torch.compile "
                    "(not part of the default comparison, which is eager against eager)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 2)
    new = args.new_tokens or (32 if args.quick else 128)
    batches = args.batches or ([1] if args.quick else [1, 8])
    if args.quick:
        args.shapes = args.shapes if args.shapes != list(SHAPES) else ["llama-small"]
        args.dtypes = args.dtypes if args.dtypes != list(DTYPES) else ["fp32"]
    info = machine_info()
    results = []
    for shape in args.shapes:
        for dtype_name in args.dtypes:
            for B in batches:
                r = measure(shape, dtype_name, B, 32, new, repeats, args.compile)
                results.append(r)
                print(f"{shape:12s} {dtype_name} B={B}: decode {r['ours']['decode_tok_s']:8.1f} vs "
                      f"{r['peer']['decode_tok_s']:8.1f} tok/s  x{r['decode_ratio']:.2f} "
                      f"({r['decode_ratio_min']:.2f}-{r['decode_ratio_max']:.2f}); prefill "
                      f"{r['ours']['prefill_ms']:.1f} vs {r['peer']['prefill_ms']:.1f} ms; "
                      f"same tokens: {r['same_tokens']}", flush=True)
    payload = dict(machine=info, command=command_line(), repeats=repeats, new_tokens=new, results=results)
    write_results("generate", payload)
    if not args.no_doc and not args.compile:
        update_doc_section("Generation", render(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
