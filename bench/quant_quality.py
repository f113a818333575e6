"""What quantizing a trained model costs: bits per byte and greedy tokens against bf16.

    logitlab train --out runs/q --tie-embeddings false --steps 250        # any model works
    python3 -m bench.quant_quality runs/q --data-dir runs/q/data         # its held-out documents

The model is loaded in bf16 (the reference) and quantized the ways `logitlab generate --quantize`
does (int8 per output row; int4 in groups of 32, 64 and 128 with zero points; the quantized
products on the kernels quant.routes "auto" picks on this machine), and also written to GGUF
at Q8_0 and Q4_0 by logitlab's writer and read back (dequantized to bf16), the formats llama.cpp
decodes. For each:
- bits per byte (eval.evaluate_bpb) on held-out text: the validation documents of a prepared
  data directory (--data-dir: val.bin, cut at end-of-text, decoded), or --text files;
- greedy decoding of --prompts prompts (the first --prompt-tokens ids of the held-out documents
  and windows further in, in turn) for --new-tokens tokens each, against bf16's: how many tokens
  differ position by position, how many continuations differ at all, and where the first
  difference falls (the median over those that differ).
- the mean KL divergence KL(bf16 || variant) of the next-token distributions, in nats per token,
  over the first --kl-tokens ids of the held-out documents (each after end-of-text, in windows of
  the model's context): the finest of the three measures, it sees changes too small to move the
  bits per byte or the greedy tokens.
int8 is run both ways: weight only (the reference products, activations in bf16) and with the
activations quantized to int8 per block of 32 too (the int8dot route, what "auto" picks for a
bf16 model where it is faster). With llama-cpp-python installed, llama.cpp itself runs the GGUF
files (BF16, Q8_0, Q4_0) written by logitlab, on the same ids: its own products (Q8_0 and Q4_0
against activations it quantizes to 8 bits per block of 32, in float32 elsewhere); its KL and
greedy tokens are measured against logitlab's bf16 like the rest (its bits per byte are not).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
from pathlib import Path

from bench.common import add_section_option, command_line, machine_info, markdown_table, publish, results_name

TITLE = "Quantization quality"


def held_out_texts(data_dir: str | Path, tokenizer) -> list[str]:
    """The validation documents of a prepared data directory, as text (val.bin cut at end-of-text)."""
    import numpy as np

    data_dir = Path(data_dir)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    ids = np.fromfile(data_dir / manifest["splits"]["val"]["file"], dtype=manifest["dtype"])
    cuts = np.flatnonzero(ids == manifest["eot_id"])
    docs = np.split(ids, cuts + 1)
    return [tokenizer.decode([int(t) for t in d if t != manifest["eot_id"]]) for d in docs if len(d) > 1]


def prompt_set(docs: list[list[int]], n: int, length: int) -> list[list[int]]:
    """n prompts of `length` ids: window k of every document long enough, k = 0, 1, ... in turn."""
    prompts, k = [], 0
    while len(prompts) < n:
        found = False
        for d in docs:
            if len(d) >= (k + 1) * length and len(prompts) < n:
                prompts.append(d[k * length:(k + 1) * length])
                found = True
        if not found:
            break
        k += 1
    if len(prompts) < n:
        raise ValueError(f"the texts hold only {len(prompts)} prompts of {length} tokens, {n} asked for")
    return prompts


def token_differences(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Position-by-position differences of greedy continuations against the reference's."""
    differ = [sum(a != b for a, b in zip(x, y)) + abs(len(x) - len(y)) for x, y in zip(ours, reference)]
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y, d in zip(ours, reference, differ) if d]
    return {"tokens": sum(differ), "of": sum(len(y) for y in reference), "continuations": sum(1 for d in differ if d),
            "first_median": statistics.median(firsts) if firsts else None}


def variants(model, tmp: Path) -> dict:
    """{label: a function building the variant from the bf16 `model`} (each builds a copy)."""
    from logitlab.quant import routes
    from logitlab.quant.apply import quantize_model
    from logitlab.quant.gguf import load_gguf, save_gguf
    from logitlab.quant.linear import QuantConfig

    def quantized(method, group=64, route="auto"):
        def build():
            m = copy.deepcopy(model)
            quantize_model(m, QuantConfig(method, group))
            routes.install(m, route)
            return m
        return build

    def gguf(qtype):
        def build():
            import torch

            return load_gguf(save_gguf(model, tmp / f"{qtype}.gguf", qtype, overwrite=True), dtype=torch.bfloat16)
        return build
    int8 = {"int8 (weight only)": quantized("int8", route="reference")}
    if routes.int8dot.available():
        int8["int8, int8 activations (int8dot)"] = quantized("int8", route="int8dot")
    return {"bf16": lambda: model, **int8, "int4 (group 128)": quantized("int4", 128),
            "int4 (group 64)": quantized("int4", 64), "int4 (group 32)": quantized("int4", 32),
            "GGUF Q8_0": gguf("Q8_0"), "GGUF Q4_0": gguf("Q4_0")}


def kl_windows(docs: list[list[int]], first: int, context: int, limit: int) -> list[list[int]]:
    """Windows of at most `context` ids, each document after `first` (end-of-text) cut in turn,
    until `limit` ids in all."""
    windows, total = [], 0
    for d in docs:
        ids = [first] + d
        for start in range(0, len(ids), context):
            w = ids[start:start + context][:limit - total]
            if w:
                windows.append(w)
                total += len(w)
            if total >= limit:
                return windows
    return windows


def log_probs(model, windows: list[list[int]]):
    """[(T, V) float32 log-softmax of `model`'s logits over each window]."""
    import torch

    return [torch.log_softmax(model(torch.tensor([w]))[0].float(), dim=-1) for w in windows]


def mean_kl(reference: list, got: list) -> float:
    """Mean over every position of KL(reference || got) in nats (both lists of (T, V) log-probs)."""
    total = sum(float((r.exp() * (r - g[:, :r.shape[1]])).sum()) for r, g in zip(reference, got))
    return total / sum(r.shape[0] for r in reference)


def measure(model, tokenizer, texts: list[str], prompts: list[list[int]], new_tokens: int, windows: list[list[int]],
            report=print) -> list[dict]:
    import torch

    from logitlab.eval import evaluate_bpb
    from logitlab.generate import SampleConfig, generate
    from logitlab.quant.apply import model_bytes

    rows, reference, reference_lp = [], None, None
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for label, build in variants(model, Path(tmp)).items():
            m = build()
            bpb = evaluate_bpb(m, tokenizer, texts).bits_per_byte
            out = generate(m, prompts, SampleConfig(temperature=0, max_new_tokens=new_tokens)).tokens
            lp = log_probs(m, windows)
            reference, reference_lp = reference or out, reference_lp or lp
            rows.append(dict(label=label, bpb=bpb, bytes=model_bytes(m), kl=mean_kl(reference_lp, lp),
                             **token_differences(out, reference)))
            report(f"{label}: {bpb:.4f} bits per byte, KL {rows[-1]['kl']:.2e}, {rows[-1]['tokens']} of "
                   f"{rows[-1]['of']} greedy tokens differ")
        rows += llama_cpp_rows(model, Path(tmp), prompts, new_tokens, windows, reference, reference_lp, report)
    return rows


def llama_cpp_rows(model, tmp: Path, prompts, new_tokens: int, windows, reference, reference_lp, report) -> list[dict]:
    """llama.cpp (llama-cpp-python) on `model` written to GGUF: KL and greedy tokens against
    logitlab's bf16 (none without llama-cpp-python)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return []
    import numpy as np
    import torch

    from logitlab.quant.gguf import save_gguf

    rows = []
    for qtype in ("BF16", "Q8_0", "Q4_0"):
        path = save_gguf(model, tmp / f"llama-{qtype}.gguf", qtype, overwrite=True)
        llm = Llama(model_path=str(path), n_ctx=model.config.context_length, n_batch=256, logits_all=True,
                    n_threads=torch.get_num_threads(), verbose=False)

        def logits(ids, llm=llm):
            llm.reset()
            llm.eval(ids)
            return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
        lp = [torch.log_softmax(logits(w), dim=-1) for w in windows]
        out = []
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                ids.append(int(logits(ids)[-1].argmax()))
            out.append(ids[len(prompt):])
        rows.append(dict(label=f"llama.cpp {qtype}", bpb=None, bytes=path.stat().st_size, kl=mean_kl(reference_lp, lp),
                         **token_differences(out, reference)))
        report(f"llama.cpp {qtype}: KL {rows[-1]['kl']:.2e}, {rows[-1]['tokens']} of {rows[-1]['of']} greedy tokens differ")
    return rows


def render(result: dict) -> str:
    base = result["rows"][0]

    def bpb(r):
        return ["-", "-"] if r["bpb"] is None else [f"{r['bpb']:.4f}", f"{r['bpb'] - base['bpb']:+.4f}"]
    rows = [[r["label"], f"{r['bytes'] / 2**20:,.2f}", *bpb(r), f"{r['kl']:.2e}",
             f"{r['tokens']} of {r['of']} ({r['tokens'] / r['of']:.1%})", f"{r['continuations']} of {result['prompts']}",
             "-" if r["first_median"] is None else f"{r['first_median']:g}"] for r in result["rows"]]
    m = result["machine"]
    return f"""A trained model ({result['model']}) in bf16 and quantized: bits per byte on
{result['text']} ({result['documents']} documents), the mean KL(bf16 || variant) of the next-token
distributions over the first {result['kl_tokens']} ids of them, in nats per token, and greedy decoding of {result['prompts']} prompts of
{result['prompt_tokens']} tokens taken from them, {result['new_tokens']} new tokens each, against bf16's tokens (a token
counts as differing where the two continuations differ at that position; "first" is the median
position of the first difference among the continuations that differ). int8/int4: `generate
--quantize` (LM head included, the embedding table kept); int8 weight only (the reference products,
bf16 activations) and with int8 activations (the int8dot route: x quantized per block of 32);
int4 on the products "auto" picks; GGUF: written by logitlab at that type (every matrix, the
embedding table too) and read back dequantized to bf16; llama.cpp: those files run by llama.cpp
itself (llama-cpp-python {result.get('llama_cpp') or '-'}: Q8_0 and Q4_0 multiply activations it quantizes
to 8 bits per block of 32; its bits per byte are not measured). Weights: MiB of the model as held
(int4 on the packed kernel keeps its repacked copy outside the count; llama.cpp: the file).

Command: `{result['command'].replace(' --no-doc', '')}` — torch {m['torch']}, commit {m['commit']}.

{markdown_table(["weights", "MiB", "bits per byte", "vs bf16", "KL vs bf16 (nats)", "greedy tokens differing",
                 "continuations differing", "first difference at"], rows)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a logitlab model directory or run (its latest checkpoint)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", help="a prepared data directory: its validation documents are scored")
    source.add_argument("--text", nargs="+", help="text files to score instead")
    parser.add_argument("--max-documents", type=int, default=8, help="score the first N documents (default 8)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kl-tokens", type=int, default=4096, help="ids of the held-out text the KL is measured over")
    parser.add_argument("--about", default="", help="a few words on the model for the table's text (how it was trained)")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    add_section_option(parser, TITLE)
    args = parser.parse_args(argv)
    from logitlab.io.loading import load_model_and_tokenizer

    loaded = load_model_and_tokenizer(args.model, None, "bf16")
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    if args.data_dir:
        texts, what = held_out_texts(args.data_dir, tokenizer), "its held-out validation documents"
    else:
        texts, what = [Path(p).read_text() for p in args.text], "the files " + ", ".join(Path(p).name for p in args.text)
    texts = texts[:args.max_documents]
    docs = [tokenizer.encode(t) for t in texts]
    prompts = prompt_set(docs, args.prompts, args.prompt_tokens)
    first = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eot_id
    windows = kl_windows(docs, first, model.config.context_length, args.kl_tokens)
    rows = measure(model, tokenizer, texts, prompts, args.new_tokens, windows)
    c = model.config
    result = {"command": command_line(), "machine": machine_info(), "rows": rows, "text": what, "documents": len(texts),
              "model": f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, L={c.n_layers} D={c.d_model} "
                       f"V={c.vocab_size}" + (f", {args.about}" if args.about else ""),
              "prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "kl_tokens": sum(len(w) for w in windows), "llama_cpp": _version("llama_cpp")}
    publish(results_name("quant_quality", args.section, TITLE), args.section, result, render, doc=not args.no_doc)
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
