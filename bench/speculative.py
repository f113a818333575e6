"""Speculative decoding against the plain loop: speed-up and acceptance on code and on prose.

    python3 -m bench.speculative runs/q --data-dir runs/q/data              # n-gram drafter
    python3 -m bench.speculative runs/q --data-dir runs/q/data --draft-model runs/small

For every prompt of two sets, greedy decoding of --new-tokens tokens by the model alone
(generate) and speculatively (speculative_generate: the n-gram drafter, prompt lookup, and with
--draft-model a smaller model sharing the tokenizer), alternating prompt by prompt after a
warm-up, each timed by this process's CPU time (one thread: holds on a shared machine). Prompts:
"code", the held-out documents of a prepared data directory (Python source: names, calls and
whole lines repeat); "prose", paragraphs of English text (--prose, default the shared corpus.en,
skipped with a line where absent). A prompt is --prompt-tokens ids from a document.
Speed-up: the plain loop's seconds over the speculative one's, summed over the set (prefill
included on both); acceptance: drafts accepted / drafts proposed; tokens per pass: decoded tokens
per target forward. Greedy speculative output must equal the plain loop's: any difference is
counted in the table (it should read 0).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import ROOT, add_section_option, command_line, machine_info, markdown_table, publish, results_name

TITLE = "Speculative decoding"
PROSE = ROOT.parent / "shared" / "data" / "corpus.en"


def prose_paragraphs(path: Path, lines_per_paragraph: int = 12) -> list[str]:
    """The file's lines grouped into paragraphs of `lines_per_paragraph` lines."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return ["\n".join(lines[i:i + lines_per_paragraph]) for i in range(0, len(lines), lines_per_paragraph)]


def run_set(target, drafters: dict, prompts: list[list[int]], new_tokens: int, k: int, clock) -> dict:
    """{drafter: {"plain_s", "spec_s", "drafted", "accepted", "passes", "decoded", "mismatches"}}."""
    from logitlab.generate import SampleConfig, generate
    from logitlab.generate.speculative import speculative_generate

    config = SampleConfig(temperature=0, max_new_tokens=new_tokens)
    generate(target, prompts[0], config)                                          # warm-up
    for draft in drafters.values():
        speculative_generate(target, prompts[0], config, draft=draft, k=k)
    out = {name: dict(plain_s=0.0, spec_s=0.0, drafted=0, accepted=0, passes=0, decoded=0, mismatches=0)
           for name in drafters}
    for prompt in prompts:
        for name, draft in drafters.items():
            start = clock()
            plain = generate(target, prompt, config).tokens[0]
            middle = clock()
            spec = speculative_generate(target, prompt, config, draft=draft, k=k)
            end = clock()
            o = out[name]
            o["plain_s"] += middle - start
            o["spec_s"] += end - middle
            o["drafted"] += spec.drafted
            o["accepted"] += spec.accepted
            o["passes"] += spec.target_passes
            o["decoded"] += spec.decode_tokens
            o["mismatches"] += spec.tokens[0] != plain
    return out


def row(set_name: str, drafter: str, o: dict, prompts: int) -> list[str]:
    return [set_name, drafter, str(prompts), f"**{o['plain_s'] / o['spec_s']:.2f}**",
            f"{o['accepted'] / o['drafted']:.0%}" if o["drafted"] else "-",
            f"{o['decoded'] / o['passes']:.2f}" if o["passes"] else "-", str(o["mismatches"])]


def render(result: dict) -> str:
    rows = [row(s, d, o, result["prompts"][s]) for s, by in result["sets"].items() for d, o in by.items()]
    m = result["machine"]
    skipped = "".join(f"\n- {why}" for why in result["skipped"])
    return f"""Greedy decoding of {result['new_tokens']} tokens after {result['prompt_tokens']}-token prompts by a trained model
({result['model']}), alone and speculatively with k = {result['k']} drafts per round, alternating prompt by
prompt, timed by process CPU time ({m['torch_threads']} thread; the machine was shared with other jobs).
"code": held-out documents of the training corpus (Python source); "prose": English text the
model was not trained on. Speed-up: plain seconds / speculative seconds over the set (> 1:
speculative faster); acceptance: drafts accepted / proposed; tokens per pass: decoded tokens per
target forward (1.00: no gain); "differ": speculative continuations not equal to the plain ones
(greedy: must be 0).{skipped}

Command: `{result['command'].replace(' --no-doc', '')}` — torch {m['torch']}, commit {m['commit']}, load average
{m.get('load_avg_1m', '-')} at the end.

{markdown_table(["prompts", "drafter", "n", "speed-up", "acceptance", "tokens per pass", "differ"], rows)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the target: a logitlab model directory or run")
    parser.add_argument("--data-dir", required=True, help="a prepared data directory: its held-out documents are the code set")
    parser.add_argument("--prose", default=str(PROSE), help="an English text file for the prose set (default: shared corpus.en)")
    parser.add_argument("--draft-model", help="also draft with this smaller model (sharing the target's tokenizer)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--about", default="", help="a few words on the model for the table's text")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    add_section_option(parser, TITLE)
    args = parser.parse_args(argv)
    import torch

    from bench.quant_quality import held_out_texts, prompt_set
    from logitlab.io.loading import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    loaded = load_model_and_tokenizer(args.model, None, None)
    target, tokenizer = loaded.model.eval(), loaded.tokenizer
    drafters, skipped = {"n-gram": "ngram"}, []
    if args.draft_model:
        drafters["model " + Path(args.draft_model).name] = load_model_and_tokenizer(args.draft_model, None, None).model.eval()
    texts = {"code": held_out_texts(args.data_dir, tokenizer)}
    if Path(args.prose).is_file():
        texts["prose"] = prose_paragraphs(Path(args.prose))
    else:
        skipped.append(f"prose skipped: no file at --prose {args.prose}")
    sets, counts = {}, {}
    with torch.no_grad():
        for name, docs in texts.items():
            prompts = prompt_set([tokenizer.encode(t) for t in docs], args.prompts, args.prompt_tokens)
            sets[name] = run_set(target, drafters, prompts, args.new_tokens, args.draft_k, time.process_time)
            counts[name] = len(prompts)
            print(name, {d: round(o["plain_s"] / o["spec_s"], 2) for d, o in sets[name].items()}, flush=True)
    c = target.config
    model = (f"{sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters, L={c.n_layers} D={c.d_model} "
             f"V={c.vocab_size}" + (f", {args.about}" if args.about else ""))
    result = {"command": command_line(), "machine": machine_info(), "model": model, "sets": sets, "prompts": counts,
              "skipped": skipped, "k": args.draft_k, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens}
    publish(results_name("speculative", args.section, TITLE), args.section, result, render, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
