"""`python3 -m bench.load [--quick] [--full] [--no-doc]`: loading a checkpoint, logitlab against
transformers' AutoModelForCausalLM.from_pretrained, on the same directories: logitlab's default
load (tensors kept as stored, and the fused projections' parts, left as private mappings of the
files) and, where no tensor is cast, load_pretrained(mmap=False) (every tensor read into memory
the model owns).

Synthetic, randomly initialised checkpoints are written to a temporary directory in Hugging Face's
layout, sharded with model.safetensors.index.json: small Llama and Qwen3.5 shapes by default (in
bf16 and fp32, and an fp32 file loaded as bf16), and with --full the published Llama-3.2-1B and
Qwen3.5-2B shapes in bf16 in 2 GB shards (2.5 and 3.8 GB) and Qwen3.5-2B in fp32 (7.5 GB). Each
load runs in a fresh process (the sides alternate, after the files were read once so all find
them in the page cache) that first imports both libraries and the checkpoint's transformers model
class (transformers imports its modelling code, several seconds, on first use), so the same imports
are left out of the measure, then reports:

  load s          from the call to the model returned;
  load MiB        peak resident memory above the RSS after the imports, once loaded;
  + forward MiB   the same peak after one forward pass over 8 tokens, which touches every weight:
                  transformers maps the safetensors files and reads a weight's pages only when it
                  is first used, so its RSS right after loading is not yet the model's;
  ratios          transformers' time / logitlab's (> 1: logitlab faster) and logitlab's memory /
                  transformers' (< 1: logitlab smaller), the median over the rounds.

Writing the checkpoint holds one shard in memory at a time. The largest shapes need the weights'
size in free memory for each side's process, one at a time; a shape that does not fit the memory
available is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import command_line, machine_info, markdown_table, publish, reset_peak_rss, rss_kib, run_child

GB = 10**9

# name -> (ModelConfig fields or a preset's name with fields, stored dtype, dtype asked for, shard bytes)
SHAPES = {
    "llama-125m": (dict(vocab_size=32000, context_length=131072, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                        d_ff=2048, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False,
                        tie_embeddings=False), "bf16", None, 128 * 2**20),
    "llama-125m-fp32": ("llama-125m", "fp32", None, 256 * 2**20),
    "llama-125m-fp32-as-bf16": ("llama-125m", "fp32", "bf16", 256 * 2**20),
    "qwen3.5-200m": (("qwen3.5-0.8b", dict(n_layers=8, vocab_size=65536, layer_types=(
        "linear_attention", "linear_attention", "linear_attention", "full_attention") * 2)), "bf16", None, 128 * 2**20),
    "llama3.2-1b": (("llama3.2-1b", {}), "bf16", None, 2 * GB),
    "qwen3.5-2b": (("qwen3.5-2b", {}), "bf16", None, 2 * GB),
    "qwen3.5-2b-fp32": (("qwen3.5-2b", {}), "fp32", None, 2 * GB),
}
DEFAULT = ("llama-125m", "llama-125m-fp32", "llama-125m-fp32-as-bf16", "qwen3.5-200m")
FULL = ("llama3.2-1b", "qwen3.5-2b", "qwen3.5-2b-fp32")


def shape_config(name: str):
    from logitlab.model import PRESETS, ModelConfig

    spec = SHAPES[name][0]
    if isinstance(spec, str):                      # the same shape as another entry
        return shape_config(spec)
    if isinstance(spec, tuple):                    # a preset, some fields replaced (none derived again)
        return ModelConfig(**{**PRESETS[spec[0]].to_dict(), **spec[1]})
    return ModelConfig(**spec)


def write_checkpoint(config, directory: Path, dtype_name: str, shard_bytes: int) -> int:
    """A random checkpoint of `config` in Hugging Face's layout (config.json, shards, index),
    written one shard at a time: normal(0, 0.02) matrices, ones for vectors. -> its bytes."""
    import torch
    from safetensors.torch import save_file

    from logitlab.model import families
    from logitlab.model.accounting import meta_model

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    shapes = {k: tuple(v.shape) for k, v in families.state_dict_to_hf(meta_model(config).state_dict(), config).items()}
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for key in sorted(shapes):
        n = torch.Size(shapes[key]).numel() * dtype.itemsize
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key], size = shapes[key], size + n
    shards.append(current)
    weight_map, total = {}, 0
    for i, part in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: (torch.randn(s, generator=g) * 0.02 if len(s) > 1 else torch.ones(s)).to(dtype)
                   for k, s in part.items()}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(part, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    hf = families.config_to_hf(config, dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype_name])
    (directory / "config.json").write_text(json.dumps({**hf, "bos_token_id": None, "eos_token_id": None}))
    return total


def _child(spec: dict) -> int:
    """One load in this fresh process: prints a JSON line of the seconds and peak MiB."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from logitlab.io import hf
    from logitlab.model import transformer  # noqa: F401

    torch.set_num_threads(spec["threads"])
    torch.empty(1, device="meta").normal_()                          # torch's lazy imports, on both sides
    arch = json.loads((Path(spec["directory"]) / "config.json").read_text())["architectures"][0]
    getattr(transformers, arch)         # transformers imports its modelling code (seconds) on first use
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[spec["dtype"]]
    base = reset_peak_rss()
    start = time.perf_counter()
    if spec["side"] != "transformers":
        model = hf.load_pretrained(spec["directory"], dtype=dtype, mmap=spec["side"] != "logitlab-read")
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(spec["directory"], dtype=dtype or "auto")
    seconds = time.perf_counter() - start
    load_kib = rss_kib("VmHWM") - base
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids) if spec["side"] != "transformers" else model(input_ids=ids)
        total = time.perf_counter() - start
        forward_kib = rss_kib("VmHWM") - base
        for p in model.parameters():                                   # every page of every weight, no copy
            p.amax()
    print(json.dumps(dict(seconds=seconds, forward_seconds=total, load_mib=load_kib / 1024,
                          forward_mib=forward_kib / 1024, read_mib=(rss_kib("VmHWM") - base) / 1024,
                          weights_mib=weights / 2**20)))
    return 0


def _read_through(directory: Path) -> None:
    """Read every file once, so that both sides find them in the page cache."""
    for path in sorted(directory.iterdir()):
        with open(path, "rb") as f:
            while f.read(64 * 2**20):
                pass


def measure(name: str, root: Path, repeats: int, threads: int) -> list[dict] | None:
    """The rows of one checkpoint: logitlab's default load and (where nothing is cast) mmap=False,
    each against the same transformers runs; None when it does not fit the memory available."""
    from logitlab.model.memory import available_memory, format_bytes, parameter_count

    config = shape_config(name)
    _, stored, asked, shard_bytes = SHAPES[name]
    size = parameter_count(config) * (4 if (asked or stored) == "fp32" else 2)
    free = available_memory()
    if free is not None and 2.2 * size > free:                        # the file's pages and one side's model
        print(f"{name}: skipped, {format_bytes(size)} of weights and {format_bytes(free)} available", flush=True)
        return None
    directory = root / name
    file_bytes = write_checkpoint(config, directory, stored, shard_bytes)
    _read_through(directory)
    modes = ["logitlab"] + (["logitlab-read"] if asked in (None, stored) else [])   # a cast maps nothing
    runs = {side: [] for side in (*modes, "transformers")}
    for _ in range(repeats):
        for side in runs:
            spec = dict(side=side, directory=str(directory), dtype=asked, threads=threads)
            runs[side].append(json.loads(run_child("bench.load", "--child", spec)[-1]))
    base = dict(stored=stored, dtype=asked or stored, file_gb=file_bytes / GB,
                shards=len(list(directory.glob("*.safetensors"))), params=parameter_count(config))
    rows = [_row(name if mode == "logitlab" else f"{name}, mmap=False", base, runs[mode], runs["transformers"])
            for mode in modes]
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    return rows


def _row(shape: str, base: dict, ours: list[dict], theirs: list[dict]) -> dict:
    """One table row: the medians of each side's runs and of the ratios of the alternating pairs."""
    out = dict(shape=shape, **base)
    for key in ("seconds", "forward_seconds", "load_mib", "forward_mib", "read_mib", "weights_mib"):
        out[f"logitlab_{key}"] = statistics.median(v[key] for v in ours)
        out[f"transformers_{key}"] = statistics.median(v[key] for v in theirs)
    pairs = list(zip(ours, theirs))
    out["speed"] = statistics.median(t["seconds"] / o["seconds"] for o, t in pairs)
    out["forward_speed"] = statistics.median(t["forward_seconds"] / o["forward_seconds"] for o, t in pairs)
    out["memory"] = statistics.median(o["forward_mib"] / t["forward_mib"] for o, t in pairs)
    out["read_memory"] = statistics.median(o["read_mib"] / t["read_mib"] for o, t in pairs)
    out["ratio_to_weights"] = out["logitlab_forward_mib"] / out["logitlab_weights_mib"]
    print(f"{shape}: load {out['logitlab_seconds']:.2f} s vs {out['transformers_seconds']:.2f} s "
          f"({out['speed']:.2f}x), with a forward {out['forward_speed']:.2f}x, peak with a forward "
          f"{out['logitlab_forward_mib']:.0f} vs {out['transformers_forward_mib']:.0f} MiB ({out['memory']:.2f}x; "
          f"logitlab {out['ratio_to_weights']:.2f}x its weights), every weight read {out['read_memory']:.2f}x",
          flush=True)
    return out


def render(result: dict) -> str:
    m = result["machine"]
    rows = [[r["shape"], f"{r['params'] / 1e9:.2f}B", f"{r['stored']} -> {r['dtype']}",
             f"{r['file_gb']:.2f} ({r['shards']})", f"{r['logitlab_seconds']:.2f} / {r['transformers_seconds']:.2f}",
             f"**{r['speed']:.2f}x**", f"{r['forward_speed']:.2f}x",
             f"{r['logitlab_load_mib']:.0f} / {r['transformers_load_mib']:.0f}",
             f"{r['logitlab_forward_mib']:.0f} / {r['transformers_forward_mib']:.0f}", f"**{r['memory']:.2f}x**",
             f"{r['read_memory']:.2f}x", f"{r['ratio_to_weights']:.2f}x"] for r in result["results"]]
    skipped = f" Skipped for lack of memory: {', '.join(result['skipped'])}." if result["skipped"] else ""
    return (f"Command: `{result['command']}`  \nMachine: {m['nproc']} CPUs ({m['cpu']}), torch {m['torch']} with "
            f"{result['threads']} thread(s), transformers {m['transformers']}, commit {m['commit']}, load average "
            f"{m.get('load_avg_1m', '?')} when it started; median of {result['repeats']} alternating round(s), each "
            "load in a fresh process. The machine was shared with other work, so absolute times move between "
            f"runs; the ratios come from alternating runs.{skipped}\n\n"
            + markdown_table(["checkpoint", "parameters", "dtype (stored -> loaded)", "GB (shards)",
                              "load s: logitlab / transformers", "load speed", "load + forward speed",
                              "load MiB: logitlab / transformers", "load + forward MiB", "memory ratio",
                              "every weight read", "logitlab peak / its weights"], rows)
            + "\n\nSpeeds are transformers' time over logitlab's (> 1: logitlab faster). The memory ratio is "
              "logitlab's peak over transformers' after one forward pass (< 1: logitlab smaller); \"every weight "
              "read\" is the same after a maximum over every parameter, when both sides hold every page of every "
              "weight. Right after loading transformers' resident memory is small because its weights are still "
              "pages of the mapped files, read on first use (and an untied embedding's rows that no token looks "
              "up are never read). logitlab's default load leaves the tensors kept as stored (embeddings, "
              "o_proj, down_proj, the head) as private mappings of the files, as transformers does, and lays "
              "out each fused projection (q, k, v; gate, up) from mapped pages of its parts, reading only the "
              "page or two where two parts meet; it checks every tensor for NaN / inf (on a few threads beside "
              "the reads), which maps every page of every weight into the process during the load (its load MiB), "
              "pages the first forward pass would map anyway; an untied token table's pages, of which a forward "
              "pass reads only its tokens' rows, are let go again. That check is the whole of what the load does "
              "beyond transformers' (it reads every byte once, about 10 GB/s per core). With mmap=False every "
              "tensor is read into memory the model owns: most of its time is the kernel handing out fresh pages "
              "(zeroed, then filled). transformers pays for its pages on first use, in the forward pass, which is "
              "why the load + "
              "forward speed is closer to even than the load speed.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small bf16 Llama only, one round")
    ap.add_argument("--full", action="store_true", help="also the published Llama-3.2-1B and Qwen3.5-2B shapes "
                    f"({', '.join(FULL)}; up to 7.5 GB)")
    ap.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES), help="these checkpoints instead")
    ap.add_argument("--repeats", type=int, default=None, help="alternating rounds (default 3; --quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process (default 1)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    ap.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)   # one measured load
    args = ap.parse_args(argv)
    if args.child:
        return _child(json.loads(args.child))
    shapes = args.shapes or (["llama-125m"] if args.quick else list(DEFAULT) + (list(FULL) if args.full else []))
    repeats = args.repeats or (1 if args.quick else 3)
    info = machine_info()
    results, skipped = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for name in shapes:
            rows = measure(name, Path(root), repeats, args.threads)
            (results.extend(rows) if rows is not None else skipped.append(name))
    payload = dict(machine=info, command=command_line(), repeats=repeats, threads=args.threads, results=results,
                   skipped=skipped)
    publish("load", "Loading a checkpoint against transformers", payload, render, quick=args.quick,
            doc=not args.no_doc and not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
