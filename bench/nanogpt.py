"""Training step speed against nanoGPT's model.py, both compiled, with equal process settings.

    python3 -m bench.nanogpt --nanogpt ~/src/nanoGPT --threads 1             # both shapes, fp32 and bf16
    python3 -m bench.nanogpt --nanogpt ~/src/nanoGPT --keep-freed-memory     # both sides with it

nanoGPT is not a package: clone it anywhere outside this repository and name the folder (the one
holding its model.py). Nothing of it is copied here; its GPT class is imported from that folder.

The sides, each in a process of its own (bench.model.SideProcess), called in turn after two
warm-up steps, each timing its own training steps with the same clock:
- "logitlab": Transformer with the GPT-2 layout, `train.loss_fn(model, True)` (model and loss
  compiled as one graph, what `logitlab train --compile` runs), optim.build_adamw;
- "nanogpt": GPT from its model.py, `torch.compile(model)` with the loss computed inside its
  forward (what its train.py compiles), the AdamW of its configure_optimizers (on a CPU torch's
  foreach loop, as its train.py leaves it);
- "nanogpt-fused" (unless --no-fused-peer): the same with torch's fused AdamW, the optimizer
  logitlab uses, so that the optimizer is not where the ratio comes from.
Every side: the same starting weights (logitlab's seed-0 model; nanoGPT's Linear layers take the
transposed GPT-2 matrices), the same batch, forward + cross-entropy + backward + clipping to norm
1.0 + AdamW (lr 1e-5, weight decay 0.1, betas 0.9/0.95), bf16 as torch.autocast over fp32 weights,
torch.compile with default options on both sides, and the same allocator: glibc's defaults, or
with --keep-freed-memory kernels.allocator.keep_freed_memory in every side's process. What differs
is only what each side's own code does (its graph, its loss, its optimizer call, logitlab's
measured bf16 route). The models differ in one place: nanoGPT's MLP uses the exact (erf) GELU,
GPT-2 and logitlab's preset the tanh approximation. Ratio = peer time / logitlab time per round
(> 1: logitlab faster), median (min-max); MFU against the best 1024^3 matmul rate measured in the
same run (bf16 rows against the faster of the bf16 and fp32 rates).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import (
    add_section_option,
    command_line,
    cpu_flags,
    machine_info,
    markdown_table,
    publish,
    results_name,
)
from bench.model import SideProcess, _current_bf16_route, clock, install_bf16_route, optimizer_step, serve_requests
from logitlab.io import hf
from logitlab.kernels import allocator
from logitlab.model import accounting
from logitlab.model.families import PRESETS
from logitlab.model.transformer import Transformer
from logitlab.train.loss import loss_fn
from logitlab.train.optim import build_adamw, clip_grad_norm

POINTS = {  # name -> (config, B, T)
    "gpt2-small": (PRESETS["gpt2"], 4, 256),
    "gpt2-6x384": (dataclasses.replace(PRESETS["gpt2"], d_model=384, n_layers=6, n_heads=6, n_kv_heads=6,
                                      d_ff=1536), 8, 256),
}
SIDES = ("logitlab", "nanogpt", "nanogpt-fused")
LR, WEIGHT_DECAY, BETAS, CLIP = 1e-5, 0.1, (0.9, 0.95), 1.0
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def nanogpt_model(folder: str, config, directory: str):
    """nanoGPT's GPT for `config` holding the weights of the Hugging Face directory logitlab wrote
    (GPT-2's Conv1D matrices transposed into its Linear layers, the tied head shared)."""
    from safetensors.torch import load_file

    sys.path.insert(0, folder)
    try:
        from model import GPT, GPTConfig  # nanoGPT's model.py
    finally:
        sys.path.remove(folder)
    model = GPT(GPTConfig(block_size=config.context_length, vocab_size=config.vocab_size,
                          n_layer=config.n_layers, n_head=config.n_heads, n_embd=config.d_model,
                          dropout=0.0, bias=True))
    weights = load_file(str(Path(directory) / "model.safetensors"))
    own = model.state_dict()
    with torch.no_grad():
        for name, value in weights.items():
            key = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
            if key.endswith(TRANSPOSED):
                value = value.t()
            if own[key].shape != value.shape:
                raise ValueError(f"{key}: nanoGPT holds {tuple(own[key].shape)}, the checkpoint {tuple(value.shape)}")
            own[key].copy_(value)
    return model


def train_step(side: str, model, ids: torch.Tensor, autocast: bool):
    """One training step of `side` (see the module docstring) -> a callable."""
    model.train()
    targets = torch.roll(ids, -1, dims=1)
    if side == "logitlab":
        install_bf16_route(model, autocast, ids.shape[1])   # as the trainer (TrainConfig.bf16_matmul "auto")
        opt = build_adamw(model, LR, WEIGHT_DECAY, BETAS)
        compute = loss_fn(model, True)

        def loss():
            return compute(ids, targets)

        def clip():
            clip_grad_norm(model.parameters(), CLIP)
    else:
        opt = model.configure_optimizers(WEIGHT_DECAY, LR, BETAS, "cpu")
        if side == "nanogpt-fused":
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
            opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)   # its groups, fused
        compiled = torch.compile(model)

        def loss():
            return compiled(ids, targets)[1]

        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)

    return optimizer_step(loss, clip, opt, autocast)


def _serve(conn, side: str, spec: dict) -> None:
    """SideProcess's child for one side: its model and step, answering the parent."""
    import contextlib
    import io

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    kept = allocator.keep_freed_memory() if spec["keep_freed_memory"] else False
    _, timer = clock()
    from logitlab.model.transformer import ModelConfig

    config = ModelConfig.from_dict(spec["config"])
    ids = torch.randint(0, config.vocab_size, (spec["B"], spec["T"]), generator=torch.Generator().manual_seed(0))
    try:
        if side == "logitlab":
            torch.manual_seed(0)
            model = Transformer(config)
        else:
            with contextlib.redirect_stdout(io.StringIO()):   # nanoGPT prints its parameter counts
                model = nanogpt_model(spec["nanogpt"], config, spec["directory"])
    except Exception:   # answer the parent's first request with the reason, naming the side there
        import traceback

        conn.recv()
        conn.send((False, traceback.format_exc()))
        return

    def make_step(mode: str, autocast: bool):
        with contextlib.redirect_stdout(io.StringIO()):
            return train_step(side, model, ids, autocast)

    def call(name: str, args):
        if name == "bf16_route":   # the routes logitlab's "auto" measured and took in this process
            return _current_bf16_route(model)
        raise ValueError(f"unknown call {name!r}")
    serve_requests(conn, kept, timer, make_step, call)


def run(folder: str, shapes: list[str], dtypes: list[str], repeats: int, threads: int | None,
        keep_freed_memory: bool, fused_peer: bool) -> dict:
    sides = SIDES if fused_peer else SIDES[:2]
    rates = {"fp32": 0.0, "bf16": 0.0}
    rows = []
    for name in shapes:
        config, B, T = POINTS[name]
        config = dataclasses.replace(config, dropout=0.0)
        flops = 3 * accounting.flops_per_token(config, T)["forward"] * B * T
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp) / "hf"
            torch.manual_seed(0)
            hf.save_pretrained(Transformer(config), directory)   # the weights every side starts from
            for dtype in dtypes:
                spec = dict(config=config.to_dict(), directory=str(directory), B=B, T=T, threads=threads,
                            nanogpt=str(Path(folder).resolve()), keep_freed_memory=keep_freed_memory)
                procs = {side: SideProcess(side, spec, _serve) for side in sides}
                try:
                    for d in ("fp32", "bf16"):
                        rates[d] = max(rates[d], accounting.measure_matmul_flops(d, n=1024, seconds=0.5))
                    first = {s: p.prepare("train", dtype == "bf16") for s, p in procs.items()}
                    for _ in range(2):        # the optimizer state exists from the second step
                        for p in procs.values():
                            p.step()
                    times = {s: [] for s in sides}
                    for _ in range(repeats):
                        for s, p in procs.items():
                            times[s].append(p.step())
                    route = procs["logitlab"].call("bf16_route") if dtype == "bf16" else "-"
                finally:
                    for p in procs.values():
                        p.close()
                row = dict(shape=name, dtype=dtype, B=B, T=T, flops=flops, times=times, route=route,
                           first_s={s: first[s] - min(times[s]) for s in sides})
                for s in sides[1:]:
                    r = [b / a for a, b in zip(times["logitlab"], times[s])]
                    row[f"{s}_ratio"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
                rows.append(row)
                print(_line(row, sides), flush=True)
    peak = {"fp32": rates["fp32"], "bf16": max(rates.values())}
    for row in rows:
        row["mfu"] = {s: row["flops"] / min(row["times"][s]) / peak[row["dtype"]] for s in sides}
    return {"command": command_line(), "machine": machine_info(), "cpu_flags": cpu_flags(),
            "matmul_flops_per_s": rates, "repeats": repeats, "clock": clock()[0], "sides": list(sides),
            "keep_freed_memory": keep_freed_memory, "rows": rows}


def _line(row: dict, sides) -> str:
    text = f"{row['shape']:11s} {row['dtype']:5s} B{row['B']} T{row['T']}: logitlab {1e3 * min(row['times']['logitlab']):.0f} ms"
    for s in sides[1:]:
        r = row[f"{s}_ratio"]
        text += f", {s} {1e3 * min(row['times'][s]):.0f} ms (x{r['median']:.2f} {r['min']:.2f}-{r['max']:.2f})"
    return text


def render(result: dict) -> str:
    sides = result["sides"]
    headers = ["shape", "dtype", "B x T", "bf16 route (auto): products / attention"] + [f"{s} ms" for s in sides]
    headers += [f"ratio vs {s}" for s in sides[1:]] + ["MFU " + " / ".join(sides), "compile s " + " / ".join(sides)]
    rows = []
    for r in result["rows"]:
        rows.append([r["shape"], r["dtype"], f"{r['B']} x {r['T']}", r["route"]]
                    + [f"{1e3 * min(r['times'][s]):,.0f}" for s in sides]
                    + [f"**{r[f'{s}_ratio']['median']:.2f}** ({r[f'{s}_ratio']['min']:.2f}-{r[f'{s}_ratio']['max']:.2f})"
                       for s in sides[1:]]
                    + [" / ".join(f"{r['mfu'][s]:.0%}" for s in sides),
                       " / ".join(f"{r['first_s'][s]:.0f}" for s in sides)])
    m = result["machine"]
    rates = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in result["matmul_flops_per_s"].items())
    alloc = ("every side's process with kernels.allocator.keep_freed_memory" if result["keep_freed_memory"]
             else "glibc's defaults in every side's process")
    return f"""Training step of logitlab against nanoGPT's model.py, both compiled with torch.compile's
default options, each side in a process of its own, alternating after two warm-up steps; the same
starting weights, batch, loss, clipping and AdamW hyperparameters, and the same allocator
({alloc}). nanogpt: its configure_optimizers (torch's foreach AdamW on a CPU);
nanogpt-fused: the same model with torch's fused AdamW, the optimizer logitlab uses, so its
ratio is the graphs' alone. nanoGPT's MLP uses the exact GELU, logitlab's GPT-2 preset the tanh
form. Ratio = peer time / logitlab time per round (> 1: logitlab faster), median (min-max) of
{result['repeats']} rounds; ms: the best round, {"CPU time (one torch thread)" if result['clock'] == "cpu" else "wall time"}.
MFU against the best 1024³ matmul rate measured in the same run ({rates}; bf16 rows against the
faster of the two). "bf16 route": the routes logitlab's "auto" measured and took in its process,
products / attention (native: the bf16 kernels, as nanoGPT's; fp32: float32 kernels over
bf16-rounded operands).

Command: `{result['command'].replace(' --no-doc', '')}` — machine: {m['nproc']} CPUs ({m['cpu']};
{", ".join(result['cpu_flags']) or "no listed features"}), torch {m['torch']} ({m['torch_threads']} threads),
commit {m['commit']}, load average {m.get('load_avg_1m', '-')} at the end.

{markdown_table(headers, rows)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", required=True, metavar="FOLDER",
                        help="a clone of nanoGPT outside this repository (the folder holding its model.py)")
    parser.add_argument("--shapes", nargs="+", choices=list(POINTS), default=list(POINTS))
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per point (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="apply kernels.allocator.keep_freed_memory in every side's process")
    parser.add_argument("--no-fused-peer", action="store_true", help="skip the nanogpt-fused side")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    add_section_option(parser, "Training against nanoGPT")
    args = parser.parse_args(argv)
    if not (Path(args.nanogpt) / "model.py").is_file():
        parser.error(f"--nanogpt {args.nanogpt}: no model.py there (give the folder of a nanoGPT clone)")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.nanogpt, args.shapes, args.dtypes, args.repeats, args.threads,
                 args.keep_freed_memory, not args.no_fused_peer)
    kept = " (kept freed memory)" if args.keep_freed_memory else ""
    name = results_name("nanogpt-kept" if kept else "nanogpt", args.section, "Training against nanoGPT")
    publish(name, args.section + kept, result, render, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
