"""Subcommand `inspect` (registered by main.py): score a text token by token and show what the
model computes at one position (inspect.core), attention patterns with induction and previous-token
scores (inspect.patterns), attention sinks and the Gated DeltaNet state (inspect.mixers), a mixture
of experts' routing (inspect.experts), as tables and text grids or, with --json, one JSON object."""

from __future__ import annotations

import dataclasses
import json

from logitlab.cli import interpret
from logitlab.cli.common import add_examples
from logitlab.cli.generate import _model_flags as model_flags
from logitlab.cli.generate import _number as number
from logitlab.cli.generate import _unescape as unescape


def register(subparsers) -> None:
    """Add `inspect` to `subparsers`."""
    i = subparsers.add_parser("inspect", help="per-token surprisal, next-token table, logit lens, neighbours",
                              description="Score TEXT token by token (probability, surprisal in nats and "
                              "bits, cross-entropy, perplexity) and show the top next tokens at --position "
                              "before and after --temperature/--top-k/--top-p/--min-p; --lens adds the logit "
                              "lens at that position, --neighbours TOKEN the most cosine-similar embedding "
                              "rows.")
    model_flags(i)
    add_examples(i, 'inspect runs/a "import os" --position 0 --lens',
                 'inspect runs/a "def main():\\n    return" --rows 5 --temperature 0.7 --top-p 0.9',
                 'inspect gpt2 " the bank of the river" --neighbours " bank"',
                 'inspect gpt2 --hooks',
                 'inspect gpt2 "The capital of France is" --attribute " Paris- Rome"',
                 'inspect gpt2 --patch "Paris is in" "Rome is in" --metric " France- Italy" --plot patch.png')
    i.add_argument("text", nargs="?", help="the text to look at (\\n and \\t are a newline and a tab); "
                   "special-token text in it such as <|endoftext|> becomes its id unless --ordinary is given")
    i.add_argument("--ordinary", action="store_true", help="encode TEXT as plain text: special-token text stays "
                   "text (default: it becomes the special token's id)")
    i.add_argument("--position", type=int, default=-1, help="token index for the next-token table and the "
                   "lens (the prediction made after that token; default -1, the last)")
    i.add_argument("--rows", type=number(int, "an integer >= 1", lambda v: v >= 1), default=10,
                   help="how many candidates to list (default 10)")
    for name, kind, default, rule, ok, text in (
            ("temperature", float, 1.0, "a finite number >= 0", lambda v: v >= 0,
             "temperature of the 'after' column"),
            ("top-k", int, 0, "an integer >= 0", lambda v: v >= 0, "top-k of the 'after' column (0 = off)"),
            ("top-p", float, 1.0, "in (0, 1]", lambda v: 0 < v <= 1, "top-p of the 'after' column (1 = off)"),
            ("min-p", float, 0.0, "in [0, 1)", lambda v: 0 <= v < 1, "min-p of the 'after' column (0 = off)")):
        i.add_argument(f"--{name}", type=number(kind, rule, ok), default=default,
                       help=f"{text} (default {default})")
    i.add_argument("--lens", action="store_true", help="logit lens: top prediction at every layer")
    i.add_argument("--neighbours", metavar="TOKEN", help="embedding neighbours of TOKEN (a single-token "
                   "string or an integer id)")
    i.add_argument("--sinks", nargs="?", type=number(int, "an integer >= 1", lambda v: v >= 1), const=4,
                   metavar="K", help="attention sinks: per layer and head, the share of attention on position 0 "
                   "and on the first K positions (default K 4)")
    i.add_argument("--attention-patterns", type=_layer_head, metavar="LAYER[:HEAD]",
                   help="attention weights of one layer (every head, or HEAD alone) as a text grid, query rows "
                   "by key columns, with each head's induction and previous-token scores")
    i.add_argument("--linear", action="store_true", help="Gated DeltaNet layers: decay exp(g), beta and the "
                   "state norm per head over the text (mean over heads per position)")
    i.add_argument("--experts", action="store_true", help="mixture of experts: per MoE layer, the experts each "
                   "token goes to with their weights, and each expert's load over the text")
    i.add_argument("--bos", action="store_true", help="put the tokenizer's BOS token (<s>) first, or byte-level "
                   "BPE's end-of-text token, so the first token of TEXT is scored too (GPT-2 style)")
    i.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    interpret.add_flags(i)
    i.set_defaults(func=_inspect)


def _token_id(tokenizer, text: str) -> int:
    ids = [int(text)] if text.lstrip("-").isdigit() else tokenizer.encode(unescape(text), allowed_special="none")
    if len(ids) != 1:
        raise ValueError(f"--neighbours {text!r} encodes to {len(ids)} tokens {ids}; give one token or an id")
    return ids[0]


def _layer_head(text: str) -> tuple[int, int | None]:
    """--attention-patterns LAYER[:HEAD] -> (layer, head or None)."""
    import argparse

    layer, _, head = text.partition(":")
    if not layer.isdigit() or (head and not head.isdigit()):
        raise argparse.ArgumentTypeError(f"expected LAYER or LAYER:HEAD (integers >= 0), got {text!r}")
    return int(layer), int(head) if head else None


def _patterns(model, ids, layer: int, head: int | None) -> dict:
    """The --attention-patterns part of the report: one layer's weights and its heads' scores."""
    from logitlab.inspect.patterns import attention_patterns, induction_scores, previous_token_scores

    if len(ids) < 2:
        raise ValueError("--attention-patterns needs a text of at least 2 tokens")
    patterns = attention_patterns(model, ids)
    if layer not in patterns:
        kinds = model.config.layer_kinds
        what = f"a {kinds[layer]} layer, which has no attention weights" if layer < len(kinds) else "no such layer"
        raise ValueError(f"--attention-patterns {layer}: {what}; attention layers: {sorted(patterns)}")
    w = patterns[layer]                                                   # (H, T, T)
    if head is not None and not 0 <= head < w.shape[0]:
        raise ValueError(f"--attention-patterns {layer}:{head}: the layer has heads 0..{w.shape[0] - 1}")
    heads = list(range(w.shape[0])) if head is None else [head]
    repeats = len(set(ids)) < len(ids)
    return dict(layer=layer, heads=heads, weights=[w[h].tolist() for h in heads],
                previous_token=previous_token_scores({layer: w})[layer],
                induction=induction_scores({layer: w}, ids)[layer] if repeats else None)


def _inspect(args) -> int:
    from logitlab.cli.models import load
    from logitlab.generate.config import SampleConfig
    from logitlab.inspect import core as ins

    tok = (m := load(args)).tokenizer
    if interpret.standalone(args):
        return interpret.run_standalone(args, m)
    if args.text is None:
        raise ValueError("inspect needs TEXT (or one of --hooks, --patch, --save-direction, --probe)")
    ids = tok.encode(unescape(args.text), allowed_special="none" if args.ordinary else "all")
    first = tok.bos_id if tok.bos_id is not None else tok.eot_id  # <s>, or byte-level BPE's <|endoftext|>
    if args.bos and first is None:
        raise ValueError("--bos needs a tokenizer with a BOS token or <|endoftext|>")
    ids = [first] + ids if args.bos else ids
    if not ids:
        raise ValueError("the text encodes to no tokens")
    label = lambda i: tok.token_bytes(i).decode("utf-8", errors="replace")  # noqa: E731  (what i adds: "▁a" -> " a")
    cfg = SampleConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    report = dict(ids=ids, bos=bool(args.bos))
    if len(ids) >= 2:
        report["surprisal"] = ins.token_surprisals(m.model, ids, label)
    report["next"] = ins.next_token_table(m.model, ids, args.position, cfg, args.rows, label)
    if args.lens:
        report["lens"] = ins.logit_lens(m.model, ids, args.position, 1, label)
    if args.sinks is not None:
        from logitlab.inspect.mixers import sink_shares

        report["sinks"] = sink_shares(m.model, ids, args.sinks)
    if args.attention_patterns is not None:
        report["patterns"] = _patterns(m.model, ids, *args.attention_patterns)
    if args.linear:
        from logitlab.inspect.mixers import linear_trace

        report["linear"] = linear_trace(m.model, ids)
        if not report["linear"]:
            raise ValueError("--linear: this model has no Gated DeltaNet (linear_attention) layer")
    if args.experts:
        from logitlab.inspect.experts import expert_routing

        report["experts"] = expert_routing(m.model, ids)
    if args.neighbours is not None:
        token = _token_id(tok, args.neighbours)
        nearest = ins.embedding_neighbours(m.model, token, args.rows, label)  # checks the id
        report["neighbours"] = dict(id=token, text=label(token), nearest=nearest)
    interpret.extend_report(args, m, ids, report)
    print(json.dumps(report, default=dataclasses.asdict, ensure_ascii=False)) if args.json \
        else _print_inspect(report, tok.token_bytes)
    return 0


def _p(p: float) -> str:
    return "0" if p == 0 else f"{p:.4f}" if p >= 1e-3 else f"{p:.2e}"


def _cell(token_bytes, token_id: int) -> str:
    """A token for print_table, quoted as `tokenizer show` quotes it (cli.common.quote_token), from
    its bytes (so part of a multi-byte character shows as \\xNN), rich markup escaped."""
    from rich.markup import escape

    from logitlab.cli.common import quote_token

    return escape(quote_token(token_bytes(token_id)))


def _print_inspect(report: dict, token_bytes) -> None:
    from logitlab.cli.common import console, print_table, quote_token

    out = console()
    s = report.get("surprisal")
    if s is not None:
        rows = [[str(r.position), str(r.id), _cell(token_bytes, r.id),
                 *(("-",) * 3 if r.probability is None else
                   (_p(r.probability), f"{r.surprisal_nats:.3f}", f"{r.surprisal_bits:.3f}"))] for r in s.tokens]
        print_table(out, "per-token surprisal", ["pos", "id", "token", "p", "nats", "bits"], rows,
                    right=(0, 1, 3, 4, 5))
        scored = f"{s.scored} token{'' if s.scored == 1 else 's'} scored"
        out.print(f"{scored}: total {s.total_nats:.2f} nats, cross-entropy {s.mean_nats:.3f} "
                  f"nats ({s.mean_bits:.3f} bits) per token, perplexity {s.perplexity:.2f}", markup=False)
    out.print("token 0 is the start token added by --bos: it is context, so the text's first token is "
              "scored" if report.get("bos") else "token 0 is not scored: nothing before it predicts it (pass "
              "--bos to put a start token first and score it too)", markup=False, highlight=False)
    n = report["next"]
    settings = " ".join(f"{k.replace('_', '-')}={v}" for k, v in n.settings.items())
    columns = ["rank", "id", "token", "logit", "model: softmax(logits)", "sampler: what is drawn from"]
    for ranked_by, rows in (("model", n.before), ("sampler", n.after)):
        if ranked_by == "sampler" and [c.id for c in n.after] == [c.id for c in n.before][:len(n.after)]:
            continue  # the same order: the model's table already shows it
        rows = [[str(rank), str(c.id), _cell(token_bytes, c.id), f"{c.logit:.3f}", _p(c.model_probability),
                 _p(c.sampler_probability)] for rank, c in enumerate(rows, start=1)]
        print_table(out, f"next token after position {n.position}, ranked by the {ranked_by} (sampler: "
                    f"{settings}; {n.kept} tokens kept)", columns, rows, right=(0, 1, 3, 4, 5))
    if "lens" in report:
        rows = [[str(e.layer), _cell(token_bytes, e.top[0].id), _p(e.top[0].probability),
                 "-" if e.target_probability is None else _p(e.target_probability)] for e in report["lens"]]
        print_table(out, f"logit lens at position {n.position} (layer 0 = embeddings)",
                    ["layer", "top token", "p", "p(actual next)"], rows, right=(0, 2, 3))
    if "sinks" in report:
        _print_sinks(out, report["sinks"])
    if "patterns" in report:
        _print_patterns(out, report["patterns"], report["ids"], token_bytes)
    if "linear" in report:
        _print_linear(out, report["linear"], report["ids"], token_bytes)
    if "experts" in report:
        _print_experts(out, report["experts"], report["ids"], token_bytes)
    interpret.print_report(out, report, token_bytes)
    if "neighbours" in report:
        nb = report["neighbours"]
        name = quote_token(token_bytes(nb["id"]))
        rows = [[str(r.id), _cell(token_bytes, r.id), f"{r.cosine:.4f}"] for r in nb["nearest"]]
        print_table(out, f"embedding neighbours of {name} (id {nb['id']})", ["id", "token", "cosine"], rows,
                    right=(0, 2))


def _print_sinks(out, shares) -> None:
    from logitlab.cli.common import print_table

    if not shares:
        out.print("no attention layer: no sinks to show", markup=False)
        return
    k = shares[0].k
    rows = [[str(s.layer), str(h), f"{first:.3f}", f"{first_k:.3f}"]
            for s in shares for h, (first, first_k) in enumerate(zip(s.first, s.first_k))]
    print_table(out, f"attention on the first positions, mean over the queries after them (K = {k})",
                ["layer", "head", "on position 0", f"on positions 0..{k - 1}"], rows, right=(0, 1, 2, 3))
    out.print("a head that parks its attention on position 0 whatever the token is an attention sink; "
              "StreamingLLM keeps those positions in its cache (generate(..., streaming=(sink, window)))",
              markup=False, highlight=False)


def _print_linear(out, traces, ids, token_bytes) -> None:
    from logitlab.cli.common import print_table

    for trace in traces:
        mean = lambda row: sum(row) / len(row)  # noqa: E731
        rows = [[str(t), _cell(token_bytes, ids[t]), f"{mean(d):.3f}", f"{mean(b):.3f}", f"{mean(n):.3f}"]
                for t, (d, b, n) in enumerate(zip(trace.decay, trace.beta, trace.state_norm))]
        print_table(out, f"Gated DeltaNet layer {trace.layer}: mean over {len(trace.decay[0])} heads",
                    ["pos", "token", "decay exp(g)", "beta", "||S||"], rows, right=(0, 2, 3, 4))
    out.print("decay near 1 keeps the state, near 0 forgets it; beta is how far the state moves towards "
              "the new value for each key", markup=False, highlight=False)


def _print_experts(out, routing, ids, token_bytes) -> None:
    from logitlab.cli.common import print_table

    for r in routing:
        rows = [[str(t), _cell(token_bytes, ids[t]), "  ".join(f"{e}: {w:.2f}" for e, w in zip(es, ws)),
                 f"{h:.2f}"] for t, (es, ws, h) in enumerate(zip(r.experts, r.weights, r.entropy))]
        print_table(out, f"MoE layer {r.layer}: each token's experts, heaviest first (expert: weight)",
                    ["pos", "token", "experts", "router entropy"], rows, right=(0, 3))
        E, n = len(r.load), sum(r.load)
        load = ", ".join(f"{e}: {c}" for e, c in enumerate(r.load))
        dropped = f"; {r.dropped:.1%} of them over capacity, dropped" if r.dropped else ""
        out.print(f"layer {r.layer} load over the text ({n} assignments, {n / E:.1f} per expert if balanced): "
                  f"{load}{dropped}", markup=False, highlight=False)
    out.print("the router's entropy is ln E when it cannot tell experts apart, 0 when it is sure; a token's "
              "output is the weighted sum of its experts' outputs", markup=False, highlight=False)


SHADES = ".:-=+*#%@"   # a weight in [k/9, (k+1)/9) shows as SHADES[k]; exactly 0 (a masked key) as a space


def pattern_grid(weights, labels: list[str]) -> list[str]:
    """weights (T, T) nested lists -> text lines: a key-position header, then one row per query,
    `pos label |cells|`, each cell a SHADES character for its weight."""
    T = len(weights)
    width = max(len(str(T - 1)) + 1 + max(len(x) for x in labels), 1)
    lines = [" " * width + "  " + "".join(str(s % 10) for s in range(T))]
    for t, row in enumerate(weights):
        cells = "".join(" " if w == 0 else SHADES[min(int(w * len(SHADES)), len(SHADES) - 1)] for w in row)
        lines.append(f"{f'{t} {labels[t]}':<{width}} |{cells}|")
    return lines


def _print_patterns(out, report: dict, ids, token_bytes) -> None:
    from logitlab.cli.common import print_table, quote_token

    labels = [quote_token(token_bytes(i))[:12] for i in ids]
    layer = report["layer"]
    for h, weights in zip(report["heads"], report["weights"]):
        out.print(f"layer {layer} head {h}: rows are queries, columns keys; ' ' masked (0), then "
                  f"{SHADES[0]} < 0.11 ... {SHADES[-1]} >= 0.89", markup=False, highlight=False)
        for line in pattern_grid(weights, labels):
            out.print(line, markup=False, highlight=False)
    ind = report["induction"]
    rows = [[str(h), f"{report['previous_token'][h]:.3f}", "-" if ind is None else f"{ind[h]:.3f}"]
            for h in range(len(report["previous_token"]))]
    print_table(out, f"layer {layer}: mean weight on the previous token, and on the token after the previous "
                "occurrence of the query's token (induction)", ["head", "previous token", "induction"], rows,
                right=(0, 1, 2))
    if ind is None:
        out.print("no token of the text repeats, so there is no induction score", markup=False, highlight=False)
