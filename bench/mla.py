"""Multi-head latent attention: one decode step in the absorbed form (what MLA.form = "auto" runs
when a call reads cached positions) against the expanded form (decompress every cached latent into
H keys and H values, then attention), on the same layer and the same cache.

One MLA layer of DeepSeek-V3's head shapes (R 512, Dr 64, Dn 128, Dv 128) with fewer heads and a
narrower model, one new token against S cached positions. Both forms give the same output (checked
before timing). The pair is timed alternately (bench.common.alternate) and reported as the expanded
form's time over the absorbed form's: > 1 means the absorbed form is faster. On a shared, loaded
machine timings are noisy; --cpu-time with --threads 1 counts only this process's CPU time.

    python3 -m bench.mla [--quick] [--no-doc] [--threads 2] [--cpu-time] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from bench.common import alternate, machine_info, markdown_table, publish, use_cpu_time

TITLE = "Multi-head latent attention: the decode forms"
# (name, D, H, cached positions S)
SHAPES = [("D 1024, 16 heads", 1024, 16, 256), ("D 1024, 16 heads", 1024, 16, 1024),
          ("D 1024, 16 heads", 1024, 16, 4096), ("D 2048, 32 heads", 2048, 32, 1024)]


def _layer(D: int, H: int, S: int, R: int = 512, Dr: int = 64, Dn: int = 128, Dv: int = 128):
    """An MLA layer with DeepSeek-V3's head shapes, its rope tables and a cache of S random latents."""
    from logitlab.model import ModelConfig
    from logitlab.model.cache import KVCache
    from logitlab.model.mla import MLA
    from logitlab.model.rope import RotaryEmbedding

    c = ModelConfig(vocab_size=8, context_length=S + 1, d_model=D, n_layers=1, n_heads=H, positions="rope",
                    norm="rmsnorm", mlp="swiglu", bias=False, kv_lora_rank=R, q_lora_rank=min(1536, D),
                    qk_rope_head_dim=Dr, qk_nope_head_dim=Dn, v_head_dim=Dv)
    torch.manual_seed(0)
    layer = MLA(c).eval()
    cache = KVCache.for_model(c, batch_size=1, max_len=S + 1)
    cache.layers[0].latent[:, :, :S] = torch.randn(1, 1, S, R + Dr)
    cache.length = S
    rope = RotaryEmbedding(Dr, S + 1, c.rope_theta)(torch.tensor([[S]]))          # (cos, sin) of slot S
    return layer, cache, rope


def _step(layer, cache, rope, x, form: str):
    def run():
        layer.form = form
        with torch.no_grad():
            return layer(x, rope, cache=cache)[0]                 # writes slot S; length stays S
    return run


def bench_decode(quick: bool = False, repeats: int = 5) -> list[dict]:
    rows = []
    for name, D, H, S in SHAPES[:2] if quick else SHAPES:
        layer, cache, rope = _layer(D, H, S)
        x = torch.randn(1, 1, D)
        absorbed, expanded = _step(layer, cache, rope, x, "absorbed"), _step(layer, cache, rope, x, "expanded")
        torch.testing.assert_close(absorbed(), expanded(), atol=1e-4, rtol=1e-4)
        r = alternate(absorbed, expanded, repeats=repeats, warmup=2)
        rows.append(dict(shape=f"{name}, S {S}", cached_values=S * (512 + 64), expanded_values=S * H * 256, **r))
    return rows


def render(result: dict) -> str:
    m = result["machine"]
    rows = [[r["shape"], f"{r['cached_values']:,}", f"{r['expanded_values']:,}",
             f"{1e3 * min(r['ours']):.2f}", f"{1e3 * min(r['peer']):.2f}", f"{r['ratio']:.2f}x",
             f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"] for r in result["rows"]]
    return "\n".join([
        f"`{result['command']}` on {m['cpu']} ({m['nproc']} cores, {m['torch_threads']} threads, load "
        f"{m.get('load_avg_1m')} when it started: a shared machine), torch {m['torch']}, {result['clock']}. One "
        "decode step of one MLA layer (R 512, Dr 64, Dn 128, Dv 128) against S cached positions; the ratio is the "
        "expanded form's time over the absorbed form's (> 1: the absorbed form, the decode default, is faster), "
        "median of alternating pairs, with min-max:", "",
        markdown_table(["layer, cached positions", "values read (absorbed)", "values decompressed (expanded)",
                        "absorbed ms", "expanded ms", "ratio", "range"], rows)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true", help="time with process CPU time instead of wall time")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = use_cpu_time(args.cpu_time)
    rows = bench_decode(args.quick, args.repeats)
    for r in rows:
        print(f"{r['shape']:32} expanded / absorbed {r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
    result = dict(command=" ".join(["python3 -m bench.mla", *sys.argv[1:]]), machine=machine_info(), clock=clock,
                  rows=copy.deepcopy(rows))
    publish("mla", TITLE, result, render, quick=args.quick, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
