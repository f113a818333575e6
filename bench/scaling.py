"""Scaling: logitlab tokens/s against context length and model size, each as a fraction of its roofline.

    python3 -m bench.scaling            # presets tiny, gpt2-tiny, small, gpt2 x T 128..2048 (~6 min)
    python3 -m bench.scaling --quick    # three small presets x T 128..512 (~1 min)

Three modes per (model, context T) point, fp32, torch's own thread count:
- forward: logits for B x T tokens (no grad), B = max(1, tokens // T);
- train: forward + fp32 cross-entropy + backward + AdamW step, same B x T;
- decode: batch 1, `logitlab.generate` (greedy, KV cache, eager) continuing a prompt of T - n
  tokens by n tokens; tokens/s from the decode phase alone (prefill excluded).

Roofline, measured at the start of the same run (bench.roofline): MFU = accounting.flops_per_token
(forward, or 3x for training, at context T) x tokens/s / the best fp32 matmul rate at the
benchmark shapes; decode = bytes read per token (every weight once, an untied embedding as one
row, plus K and V of the mean cached length) x tokens/s / the read bandwidth.

Points run cheapest first. Each point's time is estimated beforehand from its FLOPs (or bytes),
the measured roofline and the efficiency seen so far in that mode; a point estimated over the
per-point cap, or past the run's time budget, is skipped and marked so in the table.
Writes bench/results/scaling.json, docs/scaling.png and the `## Scaling` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from bench.common import ROOT, command_line, machine_info, markdown_table, publish
from bench.roofline import SHAPES, matmul_peak, memory_bandwidth
from logitlab.generate.loop import SampleConfig, generate
from logitlab.model import accounting
from logitlab.model.families import PRESETS
from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.train.loop import cross_entropy
from logitlab.train.optim import build_adamw

MODES = ("forward", "train", "decode")
CONTEXTS = (128, 256, 512, 1024, 2048)
MODELS = ("tiny", "gpt2-tiny", "small", "gpt2")
PLOT = ROOT / "docs" / "scaling.png"
GUESS = {"forward": 0.3, "train": 0.2, "decode": 0.3}   # efficiency assumed before any measurement


@dataclasses.dataclass
class Settings:
    tokens: int = 512        # B*T of a forward / training step (B = max(1, tokens // T))
    repeats: int = 2         # timed calls per point at least, after one warm-up
    min_time_s: float = 1.0  # ... and more (up to 10) while a point has taken less than this
    new_tokens: int = 16     # decoded tokens per timed generate call
    point_cap_s: float = 60.0
    budget_s: float = 330.0


def model_config(name_or_config: str | ModelConfig, context: int) -> ModelConfig:
    """The preset (or config) with room for `context` positions and no dropout."""
    c = PRESETS[name_or_config] if isinstance(name_or_config, str) else name_or_config
    return dataclasses.replace(c, context_length=max(c.context_length, context), dropout=0.0)


def decode_bytes_per_token(model: Transformer, cached: float) -> float:
    """Bytes a batch-1 decode step must read at least: every weight once (an untied input embedding
    only as one row, learned positions as one row) plus K and V of `cached` positions per layer."""
    c = model.config
    total = 0
    for name, p in model.named_parameters():      # a tied head appears once
        if name in ("pos_emb.weight",) or (name == "tok_emb.weight" and not c.tie_embeddings):
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    item = next(model.parameters()).element_size()
    return total + 2 * c.n_layers * c.n_kv_heads * c.head_dim * cached * item


def _ids(config: ModelConfig, B: int, T: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))


def measurements(measure, repeats: int, min_time_s: float, most: int = 10) -> list[float]:
    """`measure()` at least `repeats` times, and again while less than `min_time_s` has passed
    (cheap points get more samples, so their best is less at the mercy of a shared machine)."""
    start, values = time.perf_counter(), []
    while len(values) < repeats or (time.perf_counter() - start < min_time_s and len(values) < most):
        values.append(measure())
    return values


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_forward(model: Transformer, B: int, T: int, repeats: int, min_time_s: float = 0.0) -> float:
    """Best seconds of a no-grad forward over B x T tokens, after a warm-up."""
    ids = _ids(model.config, B, T)                     # (B, T)
    model.eval()
    with torch.no_grad():
        model(ids)
        return min(measurements(lambda: _seconds(lambda: model(ids)), repeats, min_time_s))


def time_train(model: Transformer, B: int, T: int, repeats: int, min_time_s: float = 0.0) -> float:
    """Best seconds of a training step over B x T tokens, after a warm-up step."""
    ids = _ids(model.config, B, T + 1)                 # (B, T + 1): inputs and shifted targets
    x, y = ids[:, :-1], ids[:, 1:]
    model.train()
    opt = build_adamw(model, lr=1e-6)

    def step():
        loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    seconds = min(measurements(lambda: _seconds(step), repeats, min_time_s))
    model.eval()
    return seconds


def decode_rate(model: Transformer, T: int, new: int, repeats: int, min_time_s: float = 0.0) -> float:
    """Best decode tokens/s of greedy generate calls (prompt T - new, `new` tokens)."""
    prompt = _ids(model.config, 1, T - new)[0].tolist()
    cfg = SampleConfig(temperature=0, max_new_tokens=new)
    model.eval()
    with torch.no_grad():
        generate(model, prompt[:8], SampleConfig(temperature=0, max_new_tokens=4))   # warm-up
        return max(measurements(lambda: generate(model, prompt, cfg).decode_tokens_per_second, repeats,
                                min_time_s))


def estimate_s(cfg: ModelConfig, mode: str, T: int, s: Settings, peak: float, bw: float,
               efficiency: float, n_params: int) -> float:
    """Seconds the whole point should take (warm-up included) at `efficiency` of its roofline."""
    flops = accounting.flops_per_token(cfg, T)
    if mode == "decode":
        prefill = (T - s.new_tokens) * flops["forward"] / (peak * 1e9 * GUESS["forward"])
        step = n_params * 4 / (bw * 1e9) / efficiency + 1e-3 * cfg.n_layers   # + per-layer overhead
        return s.repeats * (prefill + s.new_tokens * step) + 4 * step
    tokens = max(1, s.tokens // T) * T
    return (1 + s.repeats) * tokens * flops["training" if mode == "train" else "forward"] / (peak * 1e9 * efficiency)


def run(models: dict[str, str | ModelConfig], contexts: tuple[int, ...], s: Settings,
        peak_gflops: float | None = None, bandwidth_gbs: float | None = None) -> dict:
    start = time.perf_counter()
    shapes = [x for group in SHAPES.values() for x in group]

    def roofline() -> tuple[float, float]:
        """(fp32 matmul GFLOP/s, read GB/s), measured now unless given."""
        out = (peak_gflops or matmul_peak("fp32", shapes, repeats=2),
               bandwidth_gbs or memory_bandwidth(mib=256, repeats=5))
        print(f"roofline: fp32 matmul {out[0]:.1f} GFLOP/s, read bandwidth {out[1]:.1f} GB/s", flush=True)
        return out

    measured = [roofline()]
    peak, bw = measured[0]
    configs = {name: model_config(m, max(contexts)) for name, m in models.items()}
    n_params = {name: accounting.count_parameters(c).total for name, c in configs.items()}
    seen: dict[str, list[float]] = {m: [] for m in MODES}   # measured / estimated, per mode

    def efficiency(mode: str) -> float:
        return GUESS[mode] / statistics.median(seen[mode]) if seen[mode] else GUESS[mode]

    plan = [(name, T, mode) for name in configs for T in contexts for mode in MODES]
    plan.sort(key=lambda p: estimate_s(configs[p[0]], p[2], p[1], s, peak, bw, GUESS[p[2]], n_params[p[0]]))
    built: dict[str, Transformer] = {}
    points = []
    for name, T, mode in plan:
        cfg = configs[name]
        B = 1 if mode == "decode" else max(1, s.tokens // T)
        est = estimate_s(cfg, mode, T, s, peak, bw, efficiency(mode), n_params[name])
        point = dict(model=name, params=n_params[name], T=T, mode=mode, batch=B, estimate_s=est,
                     flops_per_token=accounting.flops_per_token(cfg, T))
        points.append(point)
        left = s.budget_s - (time.perf_counter() - start)
        if est > s.point_cap_s or est > left:
            point["skipped"] = (f"est. {est:.0f} s > {s.point_cap_s:.0f} s cap" if est > s.point_cap_s
                                else f"est. {est:.0f} s, {max(left, 0):.0f} s of budget left")
            print(f"{name:10s} T={T:5d} {mode:8s} skipped ({point['skipped']})", flush=True)
            continue
        if name not in built:
            torch.manual_seed(0)
            built[name] = Transformer(cfg).eval()
        model = built[name]
        t0 = time.perf_counter()
        if mode == "forward":
            tok_s = B * T / time_forward(model, B, T, s.repeats, s.min_time_s)
            achieved = accounting.flops_per_token(cfg, T)["forward"] * tok_s / 1e9     # GFLOP/s
        elif mode == "train":
            tok_s = B * T / time_train(model, B, T, s.repeats, s.min_time_s)
            achieved = accounting.flops_per_token(cfg, T)["training"] * tok_s / 1e9    # GFLOP/s
        else:
            tok_s = decode_rate(model, T, s.new_tokens, s.repeats, s.min_time_s)
            point["bytes_per_token"] = decode_bytes_per_token(model, T - s.new_tokens / 2)
            achieved = point["bytes_per_token"] * tok_s / 1e9                          # GB/s
        point.update(tok_s=tok_s, achieved=achieved, seconds=time.perf_counter() - t0)
        seen[mode].append(point["seconds"] / estimate_s(cfg, mode, T, s, peak, bw, GUESS[mode], n_params[name]))
        frac = achieved / (bw if mode == "decode" else peak)
        print(f"{name:10s} T={T:5d} {mode:8s} B={B}: {tok_s:10.1f} tok/s, {frac:6.1%} of roofline "
              f"({point['seconds']:.1f} s, est. {est:.1f} s)", flush=True)
    del built
    measured.append(roofline())          # a shared machine: the best of start and end is the limit
    peak, bw = max(m[0] for m in measured), max(m[1] for m in measured)
    for p in points:
        if "achieved" in p:
            p["fraction"] = p["achieved"] / (bw if p["mode"] == "decode" else peak)
    points.sort(key=lambda p: (p["params"], p["model"], MODES.index(p["mode"]), p["T"]))
    return dict(command=command_line(), machine=machine_info(), settings=dataclasses.asdict(s),
                contexts=list(contexts), models=list(models), matmul_peak_gflops=peak,
                bandwidth_gbs=bw, roofline_measurements=measured, points=points,
                elapsed_s=time.perf_counter() - start)


def plot(result: dict, path: Path) -> Path:
    """Two rows x three modes: tokens/s against context (a line per model) and against parameters
    (a line per context); skipped points are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    done = [p for p in result["points"] if "tok_s" in p]
    fig, axes = plt.subplots(2, 3, figsize=(14, 8), squeeze=False)
    for col, mode in enumerate(MODES):
        top, bottom = axes[0][col], axes[1][col]
        for name in result["models"]:
            pts = [p for p in done if p["model"] == name and p["mode"] == mode]
            if pts:
                top.plot([p["T"] for p in pts], [p["tok_s"] for p in pts], marker="o",
                         label=f"{name} ({pts[0]['params'] / 1e6:.1f}M)")
        for T in result["contexts"]:
            pts = sorted((p for p in done if p["T"] == T and p["mode"] == mode), key=lambda p: p["params"])
            if pts:
                bottom.plot([p["params"] for p in pts], [p["tok_s"] for p in pts], marker="o", label=f"T={T}")
        top.set_xscale("log", base=2)
        top.set(yscale="log", xlabel="context T", ylabel="tokens/s", title=f"{mode} vs context")
        bottom.set(xscale="log", yscale="log", xlabel="parameters", ylabel="tokens/s",
                   title=f"{mode} vs model size")
        top.set_xticks(result["contexts"], [str(T) for T in result["contexts"]])
        top.xaxis.set_minor_formatter(NullFormatter())
        for ax in (top, bottom):
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"logitlab fp32 on {m['nproc']} CPUs ({m['cpu']}), {m['torch_threads']} thread(s); "
                 f"forward/train B*T = {result['settings']['tokens']}, decode batch 1")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _cell(p: dict) -> str:
    if "tok_s" not in p:
        return f"skipped ({p['skipped']})"
    rate = f"{p['tok_s']:,.0f}" if p["tok_s"] >= 100 else f"{p['tok_s']:.1f}"
    return f"{rate} ({p['fraction']:.0%})"


def trends(result: dict, mode: str) -> str:
    """Per model: tokens/s at the longest measured context / at the shortest, and for forward and
    training what the FLOP count alone predicts (the inverse ratio of FLOPs per token)."""
    out = []
    for name in result["models"]:
        pts = sorted((p for p in result["points"]
                      if p["model"] == name and p["mode"] == mode and "tok_s" in p), key=lambda p: p["T"])
        if len(pts) < 2:
            continue
        a, b = pts[0], pts[-1]
        text = f"{name} x{b['tok_s'] / a['tok_s']:.2f}"
        if mode != "decode":
            fa, fb = a["flops_per_token"], b["flops_per_token"]
            text += (f" (FLOPs predict x{fa['forward'] / fb['forward']:.2f}; attention "
                     f"{fb['attention'] / fb['forward']:.0%} of them at T={b['T']})")
        out.append(text + f" from T={a['T']} to {b['T']}")
    return "; ".join(out) or "too few points"


def render(result: dict) -> str:
    """The `## Scaling` section: a row per (model, mode), a column per context."""
    contexts, s, m = result["contexts"], result["settings"], result["machine"]
    rows = []
    for name in result["models"]:
        for mode in MODES:
            pts = {p["T"]: p for p in result["points"] if p["model"] == name and p["mode"] == mode}
            if pts:
                params = next(iter(pts.values()))["params"]
                rows.append([name, f"{params / 1e6:.1f}M", mode] + [_cell(pts[T]) if T in pts else "-"
                                                                    for T in contexts])
    table = markdown_table(["model", "params", "mode"] + [f"T={T}" for T in contexts], rows)
    skipped = sum("skipped" in p for p in result["points"])
    return f"""logitlab tokens/s (fp32, eager) against context length T and model size, and in brackets
the fraction of its roofline: MFU for forward and training (accounting.flops_per_token at context
T, 3x for training, over the best fp32 matmul rate at the benchmark shapes measured in the run,
{result['matmul_peak_gflops']:.1f} GFLOP/s), the fraction of the memory-bandwidth bound for decode
(bytes of weights + KV cache read per token over the read bandwidth measured in the run,
{result['bandwidth_gbs']:.1f} GB/s); each limit is the best of a measurement at the start of the run
and one at the end. Forward and training run B x T = max(T, {s['tokens']}) tokens per step (best of
{s['repeats']} to 10 timed calls after a warm-up, more while the point has taken under
{s['min_time_s']:g} s); training is forward + fp32 cross-entropy + backward + AdamW. Decode is
batch 1 through `logitlab.generate` (greedy, KV cache, no compilation), {s['new_tokens']} tokens after
a prompt of T - {s['new_tokens']}, tokens/s of the decode phase alone. Points run cheapest first; one
whose estimated time exceeded {s['point_cap_s']:.0f} s, or the run's {s['budget_s']:.0f} s budget, was
skipped ({skipped} here) and is marked so.

Command: `{result['command']}` — machine: {m['nproc']} CPUs ({m['cpu']}), torch {m['torch']}
({m['torch_threads']} thread(s)), Python {m['python']}, commit {m['commit']}, load average
{m.get('load_avg_1m', '?')} at the end (shared machine: absolute numbers move between runs),
{result['elapsed_s']:.0f} s in all.

{table}

![tokens/s against context and model size](scaling.png)

Reading it: tokens/s at the longest context over the shortest, forward: {trends(result, 'forward')}.
Training: {trends(result, 'train')}. Decode: {trends(result, 'decode')}. Per token a forward costs
2·N_matmul + 2·L·T·H·Dh FLOPs: the attention term grows with T and bites where it becomes a large
share of the FLOPs (narrow models with a small vocabulary), while the large LM head of the GPT-2
vocabulary (50257 x D) keeps gpt2-tiny's FLOPs per token nearly flat in T. Decode reads every weight
once per token plus a KV cache that grows with T, so its tokens/s falls with model size roughly as
the bytes grow; what separates the presets' bandwidth fractions is the fixed per-step cost of
eager PyTorch (dispatch of ~40 small operations per layer), which weighs most on the smallest
models. A bandwidth fraction above 100% means the weights were partly served from the CPU caches
(a model of a few MB fits) or the machine's memory was busier while the bandwidth was measured
(read bandwidth: the best of a measurement at the start and one at the end of the run).
Training and forward run with 1 torch thread by default: on this shared 2-core machine a second
thread stalls every parallel region whenever another process holds the other core
(`python3 -m bench.roofline` shows it at the small matmul shapes); `--threads 2` on an idle machine.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three small presets, T 128..512, tight caps")
    parser.add_argument("--models", nargs="*", choices=list(PRESETS), default=None, help="presets to run")
    parser.add_argument("--contexts", nargs="*", type=int, default=None, help="context lengths T")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run")
    parser.add_argument("--cap", type=float, default=None, help="seconds at most per point (estimated)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine a second thread stalls "
                             "every parallel region whenever another process holds its core)")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md or the plot")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = Settings(tokens=256, repeats=2, min_time_s=0.3, new_tokens=8, point_cap_s=10,
                 budget_s=50) if args.quick else Settings()
    s.budget_s = args.budget or s.budget_s
    s.point_cap_s = args.cap or s.point_cap_s
    names = args.models or (list(MODELS[:3]) if args.quick else list(MODELS))
    contexts = tuple(args.contexts or (CONTEXTS[:3] if args.quick else CONTEXTS))
    if any(T <= s.new_tokens for T in contexts):
        raise ValueError(f"contexts {contexts} must exceed the {s.new_tokens} decoded tokens")
    result = run({n: n for n in names}, contexts, s)
    print(f"measured in {result['elapsed_s']:.0f} s")
    if not args.no_doc:
        plot(result, PLOT)
    publish("scaling", "Scaling", result, render, args.quick, not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
