"""Model speed and training memory against transformers: forward and training-step tokens/s, peak RSS.

    python3 -m bench.model --threads 1    # full run (GPT-2 small 4 x 256, small Llama 8 x 256; fp32, bf16)
    python3 -m bench.model --quick        # the small Llama at half size, 2 repeats (a smoke run)

Both sides hold the same weights: logitlab builds the model, save_pretrained writes it, transformers
loads that directory (its default SDPA attention unless --peer-attn eager). Four sides, each in a
process of its own (SideProcess: the sides' heaps apart), run in turn (logitlab eager, logitlab
compiled, transformers, transformers compiled; A B C D A B C D ... after a warm-up), each timing
its own steps:
- forward: logits under no_grad; compiled = `torch.compile(model, fullgraph=True)` (transformers:
  `torch.compile(model)`, its model as a user compiles it);
- training step, as each library's trainer runs it: forward + float32 cross-entropy (the same
  function on both sides) + backward + clipping to global norm 1.0 + fused AdamW (logitlab:
  optim.build_adamw, what `logitlab train` uses; transformers: torch's fused AdamW, the default
  optimizer of transformers.Trainer with torch >= 2.8). Compiled = train.loss_fn(model, True), the
  model and the loss compiled as one graph, which is what `logitlab train --compile` runs;
  transformers compiled: its model and F.cross_entropy on the float32 logits through one
  torch.compile (default options), the optimizer eager on both.
bf16 is torch.autocast over fp32 weights. Timed with the process's CPU time when torch runs one
thread (see clock()), else the wall time. The compile time (the compiled side's first call less
its best timed step) is reported on its own and excluded from the timings. MFU = achieved FLOP/s
(accounting.flops_per_token x tokens; x3 for training) over the best 1024³ matmul rate measured in
the same run: fp32's for fp32 rows; for bf16 rows the faster of the bf16 and fp32 rates (a product
of bf16 operands is computed exactly by either kernel, and logitlab uses the faster). logitlab's
bf16 sides install the CPU bf16 routes as its trainer does (kernels.cpu_bf16.install(model, "auto",
seq_len=T): the products and attention each on the kernels measured faster in that process).

Kernel floor: the time of one step's matrix products and attention alone, run as logitlab runs
them (cpu_bf16.linear over the model's own Linear and LM-head weights at the step's B*T rows, and
SDPA at each layer's shapes, under the step's autocast; for training also their backward), best of
the same number of repetitions in user CPU time (page faults left out). Ceiling = transformers'
best step time / that floor: the largest ratio an implementation calling the same kernels could
reach. bf16 rows also report the floor on the bf16 kernels themselves ("native", what
transformers calls under autocast) beside the routes logitlab's "auto" took.

Memory: the peak resident memory of a training step of each side, each in a fresh process (VmHWM
above the RSS after the imports, the compiler's included, so that both sides pay the same), after
one warm-up step (the compiled side compiles in it; its peak is reported too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from bench import common
from bench.common import add_section_option, command_line, machine_info, markdown_table, publish, results_name
from logitlab.io import hf
from logitlab.kernels import cpu_bf16
from logitlab.model import accounting
from logitlab.model.families import PRESETS
from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.train import runtime
from logitlab.train.loop import loss_fn
from logitlab.train.optim import build_adamw, clip_grad_norm

SMALL_LLAMA = ModelConfig(vocab_size=8192, context_length=256, d_model=384, n_layers=6, n_heads=6,
                          n_kv_heads=2, d_ff=1024, norm="rmsnorm", mlp="swiglu", positions="rope",
                          bias=False, tie_embeddings=True)
POINTS = {  # name -> (config, batch, T)
    "gpt2-small": (PRESETS["gpt2"], 4, 256),
    "small-llama": (SMALL_LLAMA, 8, 256),
}
SIDES = ("ours", "compiled", "peer", "peer-compiled")
PEERS = ("peer", "peer-compiled")
NAMES = {"ours": "logitlab eager", "compiled": "logitlab compiled", "peer": "transformers",
         "peer-compiled": "transformers compiled"}
LR, WEIGHT_DECAY, CLIP = 1e-5, 0.1, 1.0

def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def forward_step(side: str, model, ids: torch.Tensor, autocast: bool, backend: str = "inductor") -> Callable:
    """One forward (logits (B, T, V), no grad) of `side`'s model; compiled: fullgraph torch.compile."""
    model.eval()
    if side in PEERS:
        def logits(ids):
            return model(input_ids=ids, use_cache=False).logits
        run = torch.compile(logits, backend=backend) if side == "peer-compiled" else logits
        run = (lambda f: lambda: f(ids))(run)
    else:
        install_bf16_route(model, autocast, ids.shape[1])
        run = torch.compile(model, fullgraph=True, backend=backend) if side == "compiled" else model
        run = (lambda f: lambda: f(ids))(run)

    def step():
        with torch.no_grad(), _autocast(autocast):
            run()
    return step


def train_step(side: str, model, ids: torch.Tensor, autocast: bool, backend: str = "inductor") -> Callable:
    """One training step of `side` on ids (B, T) predicting ids shifted by one (see the module docstring)."""
    model.train()
    targets = torch.roll(ids, -1, dims=1)
    if side in PEERS:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def peer_loss(ids, targets):   # F.cross_entropy on float32 logits, as the eager peer's
            return F.cross_entropy(model(input_ids=ids, use_cache=False).logits.float().flatten(0, 1),
                                   targets.flatten())
        compute = torch.compile(peer_loss, backend=backend) if side == "peer-compiled" else peer_loss

        def loss():
            return compute(ids, targets)

        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    else:
        install_bf16_route(model, autocast, ids.shape[1])
        opt = build_adamw(model, LR, WEIGHT_DECAY)
        compute = loss_fn(model, backend if side == "compiled" else False)

        def loss():
            return compute(ids, targets)

        def clip():
            clip_grad_norm(model.parameters(), CLIP)

    return optimizer_step(loss, clip, opt, autocast)


def optimizer_step(loss: Callable, clip: Callable, opt, autocast: bool) -> Callable:
    """-> one training step: loss() under bf16 autocast (when `autocast`), backward, clip(),
    opt.step(), gradients set to None."""
    def step():
        with _autocast(autocast):
            value = loss()
        value.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def set_allocator(side: str, spec: dict) -> bool:
    """Each side runs with the allocator setting its trainer leaves: logitlab's compiled side in
    fp32 with runtime.keep_freed_memory (what `logitlab train --compile` applies on a CPU in fp32,
    TrainConfig.keep_freed_memory "auto"), its bf16 and eager sides and transformers' with glibc's
    defaults; spec["peer_keep_freed_memory"] gives transformers the setting too. -> applied?"""
    if ((side == "compiled" and spec.get("dtype", "fp32") == "fp32")
            or (side in PEERS and spec.get("peer_keep_freed_memory"))):
        return runtime.keep_freed_memory()
    return False


def clock() -> tuple[str, Callable[[], float]]:
    """The clock the timings use: with one torch thread the process's CPU time ("cpu": user +
    system, equal to the wall time on an idle machine, but without the time other jobs of a
    shared machine took from it), else the wall time ("wall", which counts every thread once)."""
    if torch.get_num_threads() == 1:
        return "cpu", time.process_time
    return "wall", time.perf_counter


class SideProcess:
    """One side of the comparison in a process of its own (spawned), holding its model and its
    step; the parent calls the sides in turn and each times its own step with its own clock.

    Separate processes keep the sides' heaps apart. In one process, each side's allocations and
    frees changed the page faults the other paid: transformers' GPT-2 small fp32 training step
    took 0.6-0.8 s of system time alone and 2-7 s interleaved with logitlab's steps (6.9 s of CPU
    time alone, 10-15 s interleaved), which no choice of malloc settings removed."""

    def __init__(self, side: str, spec: dict, serve: Callable | None = None):
        """serve(conn, side, spec): the child's loop (default: this module's _serve, the
        transformers comparison); another benchmark passes its own, a module-level function."""
        import multiprocessing

        self.side = side
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._proc = spawn.Process(target=serve or _serve, args=(child, side, spec), daemon=True)
        self._proc.start()
        child.close()
        self.keep_freed_memory = self._ask("ready")   # whether set_allocator applied the setting

    def _ask(self, *message):
        self._conn.send(message)
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"benchmark side {self.side!r} failed:\n{value}")
        return value

    def prepare(self, mode: str, autocast: bool) -> float:
        """Build the "forward" or "train" step (dropping the previous one) and run it once,
        untimed: -> wall seconds of that first call (compiling, for the compiled side)."""
        return self._ask("prepare", mode, autocast)

    def step(self) -> float:
        """One step, timed in the side's process with its clock (see clock()) -> seconds."""
        return self._ask("step")

    def call(self, name: str, *args):
        """A function of this module run in the side's process on its model: name(model, *args)."""
        return self._ask("call", name, args)

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("stop",))
            self._proc.join(timeout=60)
        self._conn.close()


def _serve(conn, side: str, spec: dict) -> None:
    """SideProcess's child: build the side's model (logitlab: Transformer(config) from seed 0, the
    weights the parent saved; transformers: from_pretrained of that directory) and answer
    requests until "stop" (serve_requests)."""
    import transformers

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    kept = set_allocator(side, spec)
    _, timer = clock()
    config = ModelConfig.from_dict(spec["config"])
    ids = torch.randint(0, config.vocab_size, (spec["B"], spec["T"]), generator=torch.Generator().manual_seed(0))
    if side in PEERS:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["directory"], dtype=torch.float32,
                                                                  attn_implementation=spec["peer_attn"])
    else:
        torch.manual_seed(0)
        model = Transformer(config)
    serve_requests(conn, kept, timer, lambda mode, autocast: (forward_step if mode == "forward" else train_step)(
        side, model, ids, autocast, spec["backend"]), lambda name, args: globals()[name](model, *args))


def serve_requests(conn, ready, timer: Callable[[], float], make_step: Callable, call: Callable) -> None:
    """A side process's request loop: "ready" -> `ready`; "prepare" mode autocast -> make_step(mode,
    autocast) built (the previous step dropped first) and run once, -> its wall seconds; "step" ->
    one call timed with `timer`; "call" name args -> call(name, args); "stop" returns. A failure
    is sent back as its traceback, for the parent to raise naming the side."""
    import traceback

    step = None
    while True:
        request = conn.recv()
        try:
            if request[0] == "stop":
                return
            if request[0] == "ready":
                value = ready
            elif request[0] == "prepare":
                step = None   # the previous step's optimizer state goes first
                step = make_step(request[1], request[2])
                start = time.perf_counter()
                step()
                value = time.perf_counter() - start
            elif request[0] == "step":
                start = timer()
                step()
                value = timer() - start
            else:   # "call"
                value = call(request[1], request[2])
            conn.send((True, value))
        except Exception:   # reported by the parent, naming the side
            conn.send((False, traceback.format_exc()))


def rotate(sides: dict[str, SideProcess], mode: str, autocast: bool, repeats: int) -> tuple[dict, dict]:
    """One untimed warm-up call per side, then `repeats` rounds calling every side in turn.

    -> ({side: wall seconds of its first call}, {side: [seconds per round, each side's clock]})"""
    first = {side: proc.prepare(mode, autocast) for side, proc in sides.items()}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, proc in sides.items():
            times[side].append(proc.step())
    return first, times


def _ratios(times: dict, side: str, peer: str = "peer") -> dict:
    """Median, min and max over rounds of `peer` time / `side` time (> 1: `side` faster)."""
    r = [p / s for s, p in zip(times[side], times[peer])]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def run(quick: bool = False, repeats: int | None = None, peer_attn: str = "sdpa",
        models: list[str] | None = None, compile: bool = True, memory: bool = True,
        threads: int | None = None, backend: str = "inductor", points: dict | None = None,
        peer_keep_freed_memory: bool = False, dtypes: tuple[str, ...] = ("fp32", "bf16")) -> dict:
    repeats = repeats or (2 if quick else 3)
    points = points or POINTS
    models = models or (["small-llama"] if quick else list(points))
    sides = SIDES if compile else ("ours", "peer")
    rates = {"fp32": 0.0, "bf16": 0.0}   # best matmul FLOP/s seen; re-measured before every point
    clock_name, _ = clock()

    def measure(dtype: str) -> None:
        rates[dtype] = max(rates[dtype], accounting.measure_matmul_flops(dtype, n=1024, seconds=0.5))

    rows, mem, kept = [], [], {}
    for name in models:
        config, B, T = points[name]
        if quick:
            B, T = max(1, B // 2), T // 2
        config = dataclasses.replace(config, dropout=0.0)
        fwd_flops = accounting.flops_per_token(config, T)["forward"] * B * T
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp) / "hf"
            torch.manual_seed(0)
            hf.save_pretrained(Transformer(config), directory)     # the weights every side holds
            for dtype in dtypes:   # processes per dtype: the allocator setting is process-wide
                spec = dict(config=config.to_dict(), directory=str(directory), B=B, T=T, threads=threads, dtype=dtype,
                            peer_attn=peer_attn, backend=backend, peer_keep_freed_memory=peer_keep_freed_memory)
                procs = {side: SideProcess(side, spec) for side in sides}
                kept[dtype] = {side: proc.keep_freed_memory for side, proc in procs.items()}
                for mode in ("forward", "train"):
                    measure(dtype)
                    first, times = rotate(procs, mode, dtype == "bf16", repeats)
                    row = dict(model=name, mode=mode, dtype=dtype, batch=B, T=T,
                               flops=fwd_flops * (3 if mode == "train" else 1), times=times)
                    for side in sides:
                        row[f"{side}_tok_s"] = B * T / min(times[side])
                    for side in ("ours", "compiled")[:1 + compile]:
                        row[f"{side}_ratio"] = _ratios(times, side)
                    if compile:
                        row["compiled_vs_peer_compiled"] = _ratios(times, "compiled", "peer-compiled")
                        row["compile_s"] = first["compiled"] - min(times["compiled"])
                        row["peer_compile_s"] = first["peer-compiled"] - min(times["peer-compiled"])
                    # the products alone, and the largest ratio any side on the same kernels could reach
                    ours = procs["ours"]   # the floor in logitlab's process, on its model
                    row["floor_s"] = ours.call("kernel_floor_s", B, T, mode, dtype == "bf16", repeats)
                    row["ceiling"] = min(times["peer"]) / row["floor_s"]
                    if dtype == "bf16":   # also the bf16 kernels themselves (transformers' under autocast)
                        row["bf16_route"] = ours.call("_current_bf16_route")   # the routes "auto" took
                        row["floor_native_s"] = ours.call("kernel_floor_s", B, T, mode, True, repeats, "native")
                        row["ceiling_native"] = min(times["peer"]) / row["floor_native_s"]
                    rows.append(row)
                    print(_line(row), flush=True)
                for proc in procs.values():
                    proc.close()
            if memory:
                for dtype in dtypes[:1] if quick else dtypes:
                    spec = dict(config=config.to_dict(), directory=str(directory), dtype=dtype, B=B, T=T,
                                threads=threads, peer_attn=peer_attn, backend=backend,
                                peer_keep_freed_memory=peer_keep_freed_memory)
                    got = {side: peak_rss_mib(dict(spec, side=side)) for side in sides if side != "peer-compiled"}
                    mem.append(dict(model=name, dtype=dtype, batch=B, T=T, **got))
                    print(f"{name:12s} train    {dtype:5s} peak RSS above imports (MiB): "
                          + ", ".join(f"{s} {mib['step_mib']:.0f}" for s, mib in got.items()), flush=True)
    # MFU against the best matmul rate of the whole run: bf16 products against the faster kernel
    peak = {"fp32": rates["fp32"], "bf16": max(rates["bf16"], rates["fp32"])}
    for row in rows:
        for side in sides:
            row[f"{side}_mfu"] = row["flops"] / min(row["times"][side]) / peak[row["dtype"]]
    return {"command": command_line(), "machine": machine_info(), "matmul_flops_per_s": rates,
            "quick": quick, "repeats": repeats, "clock": clock_name, "peer_attn": peer_attn, "sides": list(sides),
            "keep_freed_memory": kept,
            "rows": rows, "memory": mem}


def _allocator_text(result: dict) -> str:
    """The paragraph on each side's allocator setting; keep_freed_memory is {dtype: {side: bool}}."""
    names = NAMES
    kept = {(side, dtype) for dtype, sides in result.get("keep_freed_memory", {}).items()
            for side, on in sides.items() if on}
    if not kept:
        return ""
    dtypes = list(result["keep_freed_memory"])
    on, off = [], []
    for side in names:
        if not any(side in sides for sides in result["keep_freed_memory"].values()):
            continue
        with_it = [d for d in dtypes if (side, d) in kept]
        if with_it:
            on.append(names[side] + ("" if len(with_it) == len(dtypes) else " in " + " and ".join(with_it)))
        if len(with_it) < len(dtypes):
            without = [d for d in dtypes if (side, d) not in kept]
            off.append(names[side] + ("" if not with_it else " in " + " and ".join(without)))
    text = (f"\nAllocator: {' and '.join(on)} ran with runtime.keep_freed_memory (glibc malloc keeps freed "
            "blocks for reuse instead of unmapping them; `logitlab train --compile` applies it on a CPU in "
            "fp32, TrainConfig.keep_freed_memory \"auto\")")
    if off:
        listed = ", ".join(off[:-1]) + " and " + off[-1] if len(off) > 1 else off[0]
        text += (f", {listed} with glibc's defaults, as their trainers leave them, under which "
                 "each step page-faults its large activations in again")
        if not any(side in PEERS for side, _ in kept):
            text += " (`--peer-keep-freed-memory` gives transformers the setting too)"
    return "\n" + textwrap.fill(text.strip() + ".", 100, break_on_hyphens=False)


def _line(row: dict) -> str:
    text = (f"{row['model']:12s} {row['mode']:8s} {row['dtype']:5s} B{row['batch']} T{row['T']}: "
            f"transformers {row['peer_tok_s']:8.0f} tok/s, eager {row['ours_tok_s']:8.0f} "
            f"x{row['ours_ratio']['median']:.2f}")
    if "compiled_tok_s" in row:
        text += (f", compiled {row['compiled_tok_s']:8.0f} x{row['compiled_ratio']['median']:.2f} "
                 f"({row['compiled_ratio']['min']:.2f}-{row['compiled_ratio']['max']:.2f}; "
                 f"compile {row['compile_s']:.0f} s); transformers compiled {row['peer-compiled_tok_s']:8.0f}, "
                 f"compiled vs it x{row['compiled_vs_peer_compiled']['median']:.2f}")
    text += f"; kernel floor {1e3 * row['floor_s']:.0f} ms (ceiling x{row['ceiling']:.2f})"
    if "floor_native_s" in row:
        text += f", native bf16 {1e3 * row['floor_native_s']:.0f} ms (x{row['ceiling_native']:.2f})"
    return text


# --------------------------------------------------------------------------------------------
# Kernel floor: a step's matrix products and attention alone
# --------------------------------------------------------------------------------------------

def _user_time() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


INSTALLED: list = []   # logitlab's sides: the cpu_bf16.Installed of the current bf16 step


def install_bf16_route(model, autocast: bool, T: int) -> None:
    """The CPU bf16 routes as logitlab's trainer installs them (TrainConfig.bf16_matmul "auto",
    attention measured at T) for a bf16 step; the previous step's routes are taken out first."""
    while INSTALLED:
        INSTALLED.pop().remove()
    if autocast:
        INSTALLED.append(cpu_bf16.install(model, "auto", seq_len=T))


def _current_bf16_route(model) -> str:
    """The routes the current bf16 step runs on, as the tables print them."""
    if not INSTALLED:
        return "-"
    return f"{INSTALLED[-1].route} / {INSTALLED[-1].attention_route}"


def kernel_floor_s(model: Transformer, B: int, T: int, mode: str, autocast: bool, repeats: int = 3,
                   bf16_matmul: str = "auto", timer: Callable[[], float] | None = None) -> float:
    """Seconds of one forward ("forward") or training step ("train") spent in its matrix products
    and attention alone, as logitlab runs them: cpu_bf16.linear over every Linear weight of `model`
    (q/k/v, o, MLP; biases in the product as the layers add them) and the LM head's V rows, each on
    random activations (B, T, K) in the step's compute dtype (bfloat16 under autocast, so rounding
    float32 activations is not counted), and per layer the causal SDPA call the model makes (q
    (B, H, T, Dh), k and v (B, Hkv, T, Dh), GQA in the kernel), under the step's autocast (bf16
    when `autocast`) and, for "forward", no_grad. "train" adds the backward of every one (grad
    input and grad weight, through torch.autograd.grad: no accumulation into .grad, no bias
    gradients, which are sums, not products). Norms, activations, RoPE, the loss and the
    optimizer are left out. bf16_matmul: the cpu_bf16 mode whose routes the products and attention
    take ("auto": measured, as the trainer; "native": the bf16 kernels themselves). -> the best of `repeats` timings (`timer`; by default
    the process's user CPU time with one torch thread, else the wall time) after a warm-up call.
    User time leaves out the system time of page faults on the step's freshly allocated
    (B, T, N) outputs and gradients (up to a second per GPT-2 small training step here), which
    is not kernel work: the floor stays a lower bound."""
    timer = timer or (_user_time if clock()[0] == "cpu" else time.perf_counter)
    if mode not in ("forward", "train"):
        raise ValueError(f"mode must be 'forward' or 'train', got {mode!r}")
    V = model.config.vocab_size
    head = model.lm_head.weight                                    # (V_padded, D)
    weights = [(m.weight, None if m.bias is None else m.bias.detach()) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    weights.append((head if head.shape[0] == V else head[:V], None))   # as Transformer._head calls it
    dtype = torch.bfloat16 if autocast else torch.float32
    train = mode == "train"
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, T, w.shape[1], generator=g, dtype=dtype).requires_grad_(train)
              for w, _ in weights]                                  # (B, T, K) per product
    grads = [torch.randn(B, T, w.shape[0], generator=g, dtype=dtype) for w, _ in weights] if train else []
    c = model.config
    H, Hkv, Dh = c.n_heads, c.n_kv_heads, c.head_dim
    qkv = [[torch.randn(B, h, T, Dh, generator=g, dtype=dtype).requires_grad_(train) for h in (H, Hkv, Hkv)]
           for _ in range(c.n_layers)]                          # (B, H|Hkv, T, Dh) per layer
    attn_grads = [torch.randn(B, H, T, Dh, generator=g, dtype=dtype) for _ in qkv] if train else []

    def step() -> None:
        with torch.set_grad_enabled(train), _autocast(autocast):
            ys = [linear(x, w, b) for x, (w, b) in zip(inputs, weights)]   # (B, T, N) each
            ys += [attend(q, k, v, None, True) for q, k, v in qkv]         # (B, H, T, Dh) each
        if train:   # outside autocast, as the step's backward: grad input and grad weight of each
            torch.autograd.grad(ys, inputs + [w for w, _ in weights] + [t for group in qkv for t in group],
                                grads + attn_grads)

    route = cpu_bf16.install(model, bf16_matmul, seq_len=T)         # the routes the mode picks
    route.remove()
    linear = cpu_bf16.linear if route.route == "fp32" else F.linear
    if route.attention_route == "fp32":
        def attend(q, k, v, mask, causal):
            return cpu_bf16.attention_via_fp32(cpu_bf16._sdpa, q, k, v, mask, causal)
    else:
        attend = cpu_bf16._sdpa
    step()   # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = timer()
        step()
        best = min(best, timer() - start)
    return best


# --------------------------------------------------------------------------------------------
# Peak memory of a training step, in a fresh process
# --------------------------------------------------------------------------------------------

def peak_rss_mib(spec: dict) -> dict:
    """Peak resident memory (MiB) of `spec['side']`'s training step in a fresh process:
    {"step_mib": a step after the warm-up, "first_mib": the first step (compiling, for the
    compiled side), "between_mib": resident between steps}, all above the RSS after the imports."""
    step, first, between = (float(x) for x in common.run_child("bench.model", "--peak-rss", spec)[-3:])
    return {"step_mib": step, "first_mib": first, "between_mib": between}


def _peak_rss_child(spec: dict) -> int:
    import torch._inductor.compile_fx  # noqa: F401  (every side pays the compiler's imports)
    import transformers

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    set_allocator(spec["side"], spec)
    config = ModelConfig.from_dict(spec["config"])
    ids = torch.randint(0, config.vocab_size, (spec["B"], spec["T"]), generator=torch.Generator().manual_seed(0))
    base = common.reset_peak_rss()
    if spec["side"] in PEERS:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["directory"], dtype=torch.float32,
                                                                  attn_implementation=spec["peer_attn"])
    else:
        torch.manual_seed(0)
        model = Transformer(config)
    step = train_step(spec["side"], model, ids, spec["dtype"] == "bf16", spec["backend"])
    step()   # warm-up: optimizer state allocated, compiled side compiled
    first = common.rss_kib("VmHWM")
    between = common.reset_peak_rss()
    step()
    peak = common.rss_kib("VmHWM")
    for kib in (peak, first, between):
        print((kib - base) / 1024)
    return 0


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------

def _ratio_cell(r: dict) -> str:
    return f"**{r['median']:.2f}** ({r['min']:.2f}-{r['max']:.2f})"


def _floor_text(result: dict) -> str:
    """The paragraph on the matmul floor and ceiling columns."""
    routes = ", ".join(sorted({r["bf16_route"] for r in result["rows"] if "bf16_route" in r}))
    return f"""

Kernel floor: one step's matrix products and attention alone, run as logitlab runs them:
cpu_bf16.linear over the model's own Linear and LM-head weights at the step's B x T rows
(activations in the step's compute dtype, so rounding float32 activations to bf16 is not
counted) and each layer's causal SDPA call, under the step's autocast, and for training also their
backward (grad input and grad weight of each product); norms, activations, RoPE, the loss and the
optimizer are not in it. Best of {result['repeats']} after a warm-up, timed in user CPU time (one
thread; the system time of page faults on fresh outputs is not kernel work). Ceiling =
transformers' best step time / that floor: the largest ratio an implementation calling the same
kernels could reach. In bf16 the
floor runs on the routes logitlab's sides took (kernels.cpu_bf16.install "auto", products / attention:
{routes or "-"}; fp32 = float32 kernels over bf16-rounded operands, native = the bf16 kernels); the
last column is the floor with the bf16 kernels themselves ("native", what transformers calls under
autocast) and transformers' step over it."""


def render(result: dict) -> str:
    """The docs/benchmarks.md "Model" section for one run's results."""
    m = result["machine"]
    compiled = "compiled" in result.get("sides", SIDES)
    headers = ["model", "step", "dtype", "B x T", "transformers tok/s", "logitlab eager tok/s", "eager ratio"]
    if compiled:
        headers += ["logitlab compiled tok/s", "compiled ratio", "transformers compiled tok/s",
                    "compiled vs transformers compiled"]
    headers += ["MFU transformers / eager" + (" / compiled / transformers compiled" if compiled else "")]
    if compiled:
        headers += ["compile s (logitlab / transformers)"]
    floors = any("floor_s" in r for r in result["rows"])
    if floors:
        headers += ["kernel floor ms", "ceiling (transformers step / floor)", "bf16 native floor ms (ceiling)"]
    rows = []
    for r in result["rows"]:
        row = [r["model"], r["mode"], r["dtype"], f"{r['batch']} x {r['T']}", f"{r['peer_tok_s']:,.0f}",
               f"{r['ours_tok_s']:,.0f}", _ratio_cell(r["ours_ratio"])]
        if compiled:
            row += [f"{r['compiled_tok_s']:,.0f}", _ratio_cell(r["compiled_ratio"]),
                    f"{r['peer-compiled_tok_s']:,.0f}", _ratio_cell(r["compiled_vs_peer_compiled"])]
        row += [" / ".join(f"{r[f'{s}_mfu']:.0%}" for s in ("peer", "ours", "compiled", "peer-compiled")
                           if f"{s}_mfu" in r)]
        if compiled:
            row += [f"{r['compile_s']:.0f} / {r['peer_compile_s']:.0f}"]
        if floors:
            row += [f"{1e3 * r['floor_s']:,.0f}" if "floor_s" in r else "-",
                    f"{r['ceiling']:.2f}x" if "ceiling" in r else "-",
                    f"{1e3 * r['floor_native_s']:,.0f} ({r['ceiling_native']:.2f}x)" if "floor_native_s" in r else "-"]
        rows.append(row)
    table = markdown_table(headers, rows)
    memory = ""
    if result.get("memory"):
        mem_rows = []
        for r in result["memory"]:
            row = [r["model"], r["dtype"], f"{r['batch']} x {r['T']}", f"{r['peer']['step_mib']:,.0f}",
                   f"{r['ours']['step_mib']:,.0f}"]
            if "compiled" in r:
                row += [f"{r['compiled']['step_mib']:,.0f}"]
            mem_rows.append(row)
        mem_headers = ["model", "dtype", "B x T", "transformers MiB", "logitlab eager MiB"]
        if compiled:
            mem_headers += ["logitlab compiled MiB"]
        memory = f"""
Peak resident memory of a training step after one warm-up step, each side in a fresh process,
above its RSS after the imports (torch, transformers and the compiler, the same for every side):
weights, gradients, AdamW state (allocated at the end of the first step, so the second step is
the peak), activations, and for the compiled side the compiled graphs.

{markdown_table(mem_headers, mem_rows)}
"""
    cmd = result["command"].replace(" --no-doc", "")
    load = f", load average {m['load_avg_1m']} at the end" if "load_avg_1m" in m else ""
    rates = ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in result["matmul_flops_per_s"].items())
    clock_text = ("Times are the process's CPU time (one torch thread: other jobs' time on the shared machine is "
                  "left out)." if result.get("clock") == "cpu" else "Times are wall-clock times.")
    return f"""Forward (logits, no grad) and training step tokens/s of logitlab, eager and compiled,
against `transformers` holding the same weights (attn_implementation="{result.get('peer_attn', 'sdpa')}";
logitlab with SDPA), each side in a process of its own, called in turn (eager, compiled,
transformers, ... after a warm-up) and timing its own steps; in one process, each side's memory
use changed the page faults the other paid (transformers' GPT-2 small fp32 training step 1.5-2x
slower interleaved with logitlab's than alone).
A training step is what each library's trainer runs: forward + float32 cross-entropy (the same
function for both) + backward + clipping to norm 1.0 + fused AdamW (`logitlab train`'s
optim.build_adamw; transformers.Trainer's default `adamw_torch_fused`). Compiled: the forward is
`torch.compile(model, fullgraph=True)`; the training step compiles the model and the loss as one
graph (train.loss_fn, what `logitlab train --compile` runs), the optimizer stays eager. bf16 is
torch.autocast over fp32 weights. Ratio = transformers time / logitlab time per round (> 1:
logitlab faster), median (min-max) of {result['repeats']} rounds; tok/s from the best round.
{clock_text}{_allocator_text(result)}
Compile time (wall time of the first call less the best step) is reported apart, excluded from
the timings; it is short when inductor's on-disk cache holds the graphs from an earlier run (a
cold compile took 20-70 s here). MFU against the best 1024³ matmul rate measured in the same run
({rates}): fp32 rows against fp32's, bf16 rows against the faster of the two (either kernel
computes a product of bf16 operands exactly, and logitlab's bf16 products take the faster), the
same denominator for every side of a row.{_floor_text(result) if floors else ""}

Command: `{cmd}` — machine: {m['nproc']} CPUs ({m['cpu']}), torch {m['torch']}
({m['torch_threads']} threads), transformers {m['transformers']}, Python {m['python']},
commit {m['commit']}{load}.

{table}
{memory}
Reading it: the machine is shared, so single timings swing by up to 2x and the min-max spread of
the per-round ratios is wide; the median ratio is the number to read. The ceiling column bounds
every ratio reachable with the same kernels. In fp32 both sides call the same kernels for the
matrix products and attention (MKL/oneDNN GEMMs, the CPU flash-attention kernel), and they take
most of each step (compare the kernel floor with the step time), so the room is the
elementwise work between them and the system's time: compiling fuses the norms, activations
(GELU's tanh form as x * sigmoid(2u), which inductor's CPU code evaluates 2x faster), RoPE and
residual adds, and compiling the loss with the model fuses the float32 upcast and log-softmax of
the (B, T, V) logits and their backward (1.01-1.04x faster than compiling the model alone); the
compiled side also keeps freed memory (above), which spares it the page faults of reallocating
each step's activations (0.1-0.4 s of system time per step alone, more when other processes run
between the steps, as here: transformers' steps pay it, and eager logitlab's). In bf16 logitlab
takes, for the products and for attention each, the kernels its "auto" measured faster in that
process (kernels.cpu_bf16; the route column of the floor paragraph): on a CPU whose bf16 kernels
are slow, float32 kernels over the bf16-rounded operands (exact products, float32 accumulation,
the result rounded to bf16: the bf16 kernel's values up to summation order); compare the two
floor columns for what that is worth on the machine of the run. On a heavily loaded machine (load
average 4-6) the compiled ratios came out larger (small Llama fp32 training 1.20x in CPU time): other
jobs' memory traffic slows the memory-bound elementwise work that compiling removes, so read the
ratios of a quiet run (load average about 1 from the benchmark itself). Measured without gain
(CPU time, 1 thread): mode="max-autotune-no-cudagraphs" for the training step (small Llama bf16
1.13x vs 1.14x, before the float32-GEMM path), a softmax(QK^T)V attention written out for inductor instead of
SDPA's flash kernel (fp32 forward 12.5 vs 8.0 ms, forward + backward 34 vs 25 ms at the small-Llama
shape).
A point worth doubting is worth re-measuring alone:
`python3 -m bench.model --models small-llama --threads 1 --no-doc`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the small Llama only (unless --models), half-size batches, 2 repeats, memory in the first dtype only")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds per point (default 3; 2 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--peer-attn", default="sdpa", choices=["sdpa", "eager"],
                        help="transformers' attention kernel (default sdpa, its default)")
    parser.add_argument("--models", nargs="*", choices=list(POINTS), default=None,
                        help="which shapes to run (default: all; --quick: small-llama)")
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"],
                        help="the dtypes to time (default both)")
    add_section_option(parser, "Model")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled sides (logitlab's and transformers')")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--peer-keep-freed-memory", action="store_true",
                        help="give transformers' process the allocator setting logitlab's trainer applies "
                             "(runtime.keep_freed_memory), to see how much of a ratio it accounts for")
    parser.add_argument("--peak-rss", metavar="JSON", help=argparse.SUPPRESS)   # the memory child process
    args = parser.parse_args(argv)
    if args.peak_rss:
        return _peak_rss_child(json.loads(args.peak_rss))
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.quick, args.repeats, args.peer_attn, args.models, compile=not args.no_compile,
                 memory=not args.no_memory, threads=args.threads,
                 peer_keep_freed_memory=args.peer_keep_freed_memory, dtypes=tuple(args.dtypes))
    publish(results_name("model", args.section, "Model"), args.section, result, render, args.quick, not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
