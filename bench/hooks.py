"""Hook points: what they cost when unused, and run_with_cache and a patching sweep against
TransformerLens on the same GPT-2-shaped model (random weights, built offline from a local config).

Parts:
  idle     the forward with no hook set: each hook point is one attribute test. Measured as the
           time of one such unused `tap` call times the number of calls per forward, against the
           forward's own time (an upper bound of the share hooks add when unused);
  peers    logitlab's run_with_cache of every hook point against TransformerLens' bridge
           (transformer_lens.model_bridge.TransformerBridge over the same transformers GPT-2)
           caching all of its hooks, and a resid_pre activation-patching sweep (every layer and
           position) against TransformerLens' patching.get_act_patch_resid_pre; with each side's
           logits against transformers'.

Each pair is timed alternately (bench.common.alternate) and reported as ratios: > 1 means logitlab
is faster. On a shared, loaded machine timings are noisy.

    python3 -m bench.hooks [--quick] [--no-doc] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from bench.common import alternate, machine_info, markdown_table, publish

TITLE = "Hook points, caching and patching against TransformerLens"


def _models(d_model: int, n_layers: int, n_heads: int, vocab: int):
    """(logitlab model, transformers GPT-2, TransformerLens bridge), the same weights."""
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    from logitlab.io.hf import load_pretrained

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=128, n_embd=d_model, n_layer=n_layers,
                                     n_head=n_heads, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(d).eval()
        bridge = TransformerBridge.boot_transformers(d, hf_model=hf)
    return ours, hf, bridge


def bench_idle(ours, x, repeats: int) -> dict:
    """One unused tap call's time, the number of calls per forward, the forward's time."""
    from logitlab.model.hooks import EAGER_ONLY, hook_points, hooks, tap

    calls = [0]

    def count(t, name):
        calls[0] += 1
    names = [p.name for p in hook_points(ours) if p.name.rpartition(".")[2] not in EAGER_ONLY]
    with torch.no_grad(), hooks(ours, dict.fromkeys(names, count)):
        ours(x)                                                    # how many points one forward reaches
    block, probe, n = ours.blocks[0], torch.zeros(1), 200_000
    start = time.perf_counter()
    for _ in range(n):
        tap(block, "resid_pre", probe)
    per_call = (time.perf_counter() - start) / n
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            ours(x)
            times.append(time.perf_counter() - start)
    forward = sorted(times[1:])[len(times[1:]) // 2]
    return {"calls": calls[0], "per_call_s": per_call, "forward_s": forward,
            "share": calls[0] * per_call / forward}


def bench_peers(ours, hf, bridge, x, clean, corrupt, repeats: int) -> dict:
    from transformer_lens import patching as tl_patching

    from logitlab.inspect.patching import activation_patching, logit_difference
    from logitlab.model.hooks import run_with_cache

    with torch.no_grad():
        want = hf(x).logits
        exact = {"logitlab": float((ours(x) - want).abs().max()), "TransformerLens": float((bridge(x) - want).abs().max())}
    cache = alternate(lambda: run_with_cache(ours, x), lambda: bridge.run_with_cache(x), repeats)
    metric = logit_difference(5, 9)
    _, clean_cache = bridge.run_with_cache(clean)

    def theirs():
        with torch.no_grad():
            return tl_patching.get_act_patch_resid_pre(bridge, corrupt, clean_cache, lambda lg: metric(lg).mean())
    sweep = alternate(lambda: activation_patching(ours, clean[0], corrupt[0], metric), theirs, repeats)
    return {"exact": exact, "cache": cache, "sweep": sweep}


def render(result: dict) -> str:
    idle, peers = result["idle"], result.get("peers")
    lines = [f"Machine: {result['machine']['cpu']} ({result['threads']} threads; a shared, loaded machine: "
             "ratios are indicative). Command: `python3 -m bench.hooks`.", "",
             f"**Unused hook points** ({result['shape']}): {idle['calls']} hook points reached per forward, "
             f"an unused one costs {idle['per_call_s'] * 1e9:.0f} ns, so at most {idle['share']:.3%} of the "
             f"forward's {idle['forward_s'] * 1e3:.2f} ms. (Under torch.compile the graph is the same as without "
             "hooks: tests/test_hooks.py.)"]
    if peers:
        rows = [[what, f"{peers[k]['ratio']:.2f}", f"{peers[k]['ratio_min']:.2f}-{peers[k]['ratio_max']:.2f}"]
                for what, k in (("run_with_cache, every hook point", "cache"),
                                ("resid_pre patching sweep (layers x positions)", "sweep"))]
        lines += ["", "Against TransformerLens' bridge (> 1: logitlab faster):", "",
                  markdown_table(["what", "ratio", "range"], rows), "",
                  "Largest logit difference from transformers' GPT-2: logitlab "
                  f"{peers['exact']['logitlab']:.1e}, TransformerLens {peers['exact']['TransformerLens']:.1e} (its 4.x "
                  "bridge runs transformers' own modules, so its logits are transformers')."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-doc", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    D, L, H, V, T = (64, 2, 4, 128, 16) if args.quick else (256, 6, 8, 1024, 64)
    ours, hf, bridge = _models(D, L, H, V)
    x = torch.randint(1, V, (1, T), generator=torch.Generator().manual_seed(0))
    corrupt = x.clone()
    corrupt[0, T // 2] = (corrupt[0, T // 2] + 1) % V
    result = {"machine": machine_info(), "threads": args.threads, "shape": f"GPT-2 shape D {D}, L {L}, H {H}, "
              f"V {V}, T {T}", "idle": bench_idle(ours, x, args.repeats),
              "peers": bench_peers(ours, hf, bridge, x, x, corrupt, args.repeats)}
    print(render(result))
    publish("hooks", TITLE, result, render, quick=args.quick, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
