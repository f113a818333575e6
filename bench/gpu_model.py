"""The GPU check's model parts (bench.gpu_check runs each in a child process):

  device  the GPU's name, memory and versions, and the bf16 peak that MFU is read against;
  train   compiled bf16 training steps (autocast over float32 weights, as `logitlab train` on a
          GPU): GPT-2 small, a Qwen3.5-style hybrid (Qwen3.5-0.8B's widths, 8 layers: two groups
          of three Gated DeltaNet layers and one gated full-attention layer), and GPT-2 small with
          the Triton attention kernel installed (`train --attention-kernel triton`);
  decode  the compiled decode step (kernels.decode.compiled_decode_step) in bf16 through
          generate(), greedy, batch 1 and 32, the same two shapes.

MFU = training FLOPs per token (model.accounting.flops_per_token: 3 x the forward's matmuls and
attention) x tokens/s / the peak. The peak is the vendor's dense bf16 figure (fp32 accumulate, no
sparsity) for a device name in PEAK_BF16_TFLOPS, else an 8192^3 bf16 matmul measured here; the
figure's source is recorded beside it, and the measured matmul is reported either way.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import sys
import time

import torch

from bench.gpu_check import Rows, child_main, run_cases, time_left

# (pattern on torch.cuda.get_device_name(), dense bf16 TFLOP/s with fp32 accumulate, no sparsity), from
# the vendors' datasheets; the first pattern that matches wins, so the specific forms come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0), (r"H100.*NVL", 835.0), (r"H200.*NVL", 835.0),
    (r"\bH100\b|\bH800\b|\bGH200\b", 989.0), (r"\bH200\b", 989.0), (r"\bB200\b", 2250.0),
    (r"\bA100\b|\bA800\b", 312.0), (r"\bA40\b", 149.7), (r"\bA30\b", 165.0), (r"\bA10\b", 125.0),
    (r"\bL40S\b", 362.0), (r"\bL40\b", 181.0), (r"\bL4\b", 121.0),
    (r"RTX 4090", 165.2), (r"RTX 3090", 71.0), (r"RTX A6000", 154.8), (r"RTX 6000 Ada", 364.2),
)
MATMUL_N = 8192


def known_peak(name: str) -> float | None:
    """Dense bf16 FLOP/s of a device named `name` from PEAK_BF16_TFLOPS, or None."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return tflops * 1e12
    return None


def peak_flops(device: torch.device) -> tuple[float | None, str, float | None]:
    """(the peak MFU is read against, its source, the measured matmul FLOP/s); (None, ...) on CPU."""
    if device.type != "cuda":
        return None, "n/a on CPU", None
    from logitlab.model.matmul_rate import measure_matmul_flops

    name = torch.cuda.get_device_name(device)
    measured = measure_matmul_flops("bf16", MATMUL_N, seconds=1.0, device=device)
    known = known_peak(name)
    if known:
        return known, f"{name}: vendor datasheet, dense bf16", measured
    return measured, f"measured: best {MATMUL_N}^3 bf16 matmul (no datasheet figure for {name!r})", measured


def part_device(spec: dict, rows: Rows) -> None:
    device = torch.device("cpu" if spec["cpu"] else "cuda")
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nproc": os.cpu_count(), "cpu": platform.processor() or platform.machine()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["device"] = "CPU"
    rows.info(**info)
    peak, source, measured = peak_flops(device)
    rows.info(peak_flops=peak, peak_source=source)
    if measured is not None:
        rows.row(f"bf16 matmul {MATMUL_N}^3, best of 1 s", tflops=measured / 1e12)


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------

def shapes(cpu: bool) -> dict:
    """name -> (ModelConfig, B, T) of the train and decode parts."""
    from logitlab.model.families import PRESETS

    if cpu:
        return {"gpt2-tiny": (PRESETS["gpt2-tiny"], 2, 32), "qwen3.5-tiny": (PRESETS["qwen3.5-tiny"], 2, 32)}
    hybrid = dataclasses.replace(PRESETS["qwen3.5-0.8b"], n_layers=8, context_length=4096,
                                 layer_types=PRESETS["qwen3.5-0.8b"].layer_types[:8])
    return {"gpt2-small": (PRESETS["gpt2"], 8, 1024), "qwen3.5-0.8b-width, 8 layers": (hybrid, 8, 1024)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# --------------------------------------------------------------------------------------------
# Training steps
# --------------------------------------------------------------------------------------------

def train_case(config, B: int, T: int, spec: dict, attention: str = "sdpa") -> dict:
    """Compiled training steps of a freshly built model on random ids, under the trainer's autocast
    (bf16 on a GPU, none on a CPU): the first step (the compile), one more, then timed steps until
    10 (1 on a CPU) or until the part's share runs low."""
    from logitlab.model.accounting import count_parameters, flops_per_token
    from logitlab.model.transformer import Transformer
    from logitlab.train import runtime
    from logitlab.train.loss import loss_fn
    from logitlab.train.optim import build_adamw, clip_grad_norm

    device = torch.device("cpu" if spec["cpu"] else "cuda")
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    if attention == "triton":
        from logitlab.kernels import triton_install

        triton_install.install(model)
    opt = build_adamw(model, lr=3e-4, weight_decay=0.1)
    loss_of = loss_fn(model, spec["backend"])
    ids = torch.randint(0, config.vocab_size, (B, T + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]

    amp = runtime.autocast_dtype(device, "auto")   # as `logitlab train`: bf16 on a GPU, float32 on a CPU

    def step() -> float:
        with runtime.autocast(device, amp):
            loss = loss_of(x, y)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t0 = time.perf_counter()
    first = float(step())
    compile_s = time.perf_counter() - t0
    step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, t0, wanted = [], time.perf_counter(), 1 if spec["cpu"] else 10
    while len(losses) < wanted and (len(losses) < 1 or time_left(spec) > 3 * (time.perf_counter() - t0) / len(losses)):
        losses.append(step())
    _sync(device)
    seconds = (time.perf_counter() - t0) / len(losses)
    last = float(losses[-1])
    tokens_per_s = B * T / seconds
    peak = spec.get("peak_flops")
    mfu = flops_per_token(config, T)["training"] * tokens_per_s / peak if peak and device.type == "cuda" else None
    return {"params_m": count_parameters(config).total / 1e6, "batch": B, "seq": T, "dtype": "bf16 autocast" if amp else "fp32",
            "attention": attention, "compile_s": compile_s, "step_ms": 1e3 * seconds, "steps_timed": len(losses),
            "tokens_per_s": tokens_per_s, "mfu": mfu, "loss_first": first, "loss_last": last,
            "finite": bool(torch.isfinite(torch.tensor([first, last])).all()), "peak_gib": _peak_gib(device)}


def part_train(spec: dict, rows: Rows) -> None:
    found = shapes(spec["cpu"])
    cases = [(name, lambda c=c, B=B, T=T: train_case(c, B, T, spec)) for name, (c, B, T) in found.items()]
    first_name, (c, B, T) = next(iter(found.items()))
    cases.append((f"{first_name}, Triton attention", lambda: train_case(c, B, T, spec, attention="triton")))
    run_cases(cases, spec, rows, min_s=10.0)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------

def decode_case(model, B: int, prompt: int, new: int, step, device: torch.device) -> dict:
    """Greedy generation of `new` tokens for B random prompts of `prompt` ids, after a short
    untimed one that compiles the step for this batch size."""
    from logitlab.generate.config import SampleConfig
    from logitlab.generate.loop import generate

    g = torch.Generator().manual_seed(B)
    prompts = torch.randint(0, model.config.vocab_size, (B, prompt), generator=g).tolist()
    t0 = time.perf_counter()
    with torch.no_grad():
        generate(model, prompts, SampleConfig(temperature=0, max_new_tokens=4), step=step)
        _sync(device)
        compile_s = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = generate(model, prompts, SampleConfig(temperature=0, max_new_tokens=new), step=step)
    steps = max(result.decode_tokens / B, 1)
    return {"batch": B, "prompt": prompt, "new": new, "dtype": "bf16", "compile_s": compile_s,
            "tokens_per_s": result.decode_tokens_per_second, "ms_per_step": 1e3 * result.decode_seconds / steps,
            "peak_gib": _peak_gib(device)}


def part_decode(spec: dict, rows: Rows) -> None:
    from logitlab.generate.loop import decode_step
    from logitlab.kernels.decode import compiled_decode_step
    from logitlab.model.transformer import Transformer

    device = torch.device("cpu" if spec["cpu"] else "cuda")
    prompt, new, batches = (8, 4, (1, 2)) if spec["cpu"] else (128, 64, (1, 32))
    cases = []
    for name, (config, _, _) in shapes(spec["cpu"]).items():
        built: dict = {}

        def model_and_step(config=config, built=built):
            if not built:   # built once per shape, by its first case
                torch.manual_seed(0)
                model = Transformer(config).to(device, torch.bfloat16).eval()
                built.update(model=model, step=compiled_decode_step(model, spec["backend"], step=decode_step))
            return built["model"], built["step"]

        def case(B, get=model_and_step):
            model, step = get()
            return decode_case(model, B, prompt, new, step, device)

        cases += [(f"{name}, batch {B}", lambda B=B, case=case: case(B)) for B in batches]
    run_cases(cases, spec, rows, min_s=10.0)


PARTS = {"device": part_device, "train": part_train, "decode": part_decode}

if __name__ == "__main__":
    sys.exit(child_main(PARTS, sys.argv[1:]))
