"""The interpretability flags of `inspect` (cli/inspect.py registers them): --hooks lists the hook
points (model/hooks.py); --attribute takes a logit apart (inspect.attribution); --patch runs an
activation-patching sweep with its heatmap (inspect.patching); --early-exit reads the lens per
position (inspect.lenses); --save-direction writes a steering direction (inspect.steering) that
generate, chat and serve add with --steer."""

from __future__ import annotations

import dataclasses
import io
import json

PATCH_KINDS = {"resid_pre": ("blocks.*.resid_pre", "position"), "attn_out": ("blocks.*.attn_out", "position"),
               "mlp_out": ("blocks.*.mlp_out", "position"), "heads": ("blocks.*.attn.z", "head")}


def add_flags(i) -> None:
    """The flags, on the inspect parser."""
    i.add_argument("--hooks", action="store_true", help="list every hook point of the model (name, module, "
                   "shape): the names run_with_cache and hooks() take; TEXT is not needed")
    i.add_argument("--attribute", metavar="TOKEN[-TOKEN]", help="direct logit attribution at --position: the "
                   "logit of TOKEN (or TOKEN minus the other) split into the embeddings', each attention layer's "
                   "(and head's) and each MLP's contributions, through the final norm with its scale frozen")
    i.add_argument("--patch", nargs=2, metavar=("CLEAN", "CORRUPT"), help="activation patching: copy one "
                   "activation at a time from the CLEAN prompt's run into the CORRUPT one's (the same number of "
                   "tokens) and print the share of --metric restored; TEXT is not needed")
    i.add_argument("--metric", metavar="TOKEN-TOKEN", help="with --patch: the logit difference at the last "
                   "position, e.g. ' Paris- Rome' (one token each side; integer ids work too)")
    i.add_argument("--patch-kind", choices=sorted(PATCH_KINDS), default="resid_pre", help="with --patch: what is "
                   "patched, per layer and position (resid_pre, attn_out, mlp_out) or per layer and head (heads: "
                   "attn.z at every position); default resid_pre")
    i.add_argument("--plot", metavar="PNG", help="with --patch: draw the layer x position (or head) heatmap; with "
                   "--tuned-lens: the bits per layer of both lenses")
    i.add_argument("--tuned-lens", metavar="FILE", help="bits of KL to the model's final distribution per layer, "
                   "for the logit lens and the tuned lens in FILE (safetensors), over TEXT; a FILE that does not "
                   "exist is trained first on --lens-data and written")
    i.add_argument("--lens-data", metavar="TEXTFILE", help="with --tuned-lens: the text the translators are "
                   "trained on (the model's own kind of text), cut into windows of the model's context")
    i.add_argument("--lens-steps", type=int, default=200, metavar="N", help="with --tuned-lens: training steps "
                   "(default 200)")
    i.add_argument("--probe", metavar="HOOK", help="fit a linear probe on the hook point HOOK (e.g. "
                   "blocks.1.resid_post) for the --labelled prompts, beside its shuffled-label control; TEXT is "
                   "not needed")
    i.add_argument("--labelled", metavar="JSONL", help="with --probe: one {\"text\": ..., \"label\": int} a line; "
                   "the label is read at the text's last token")
    i.add_argument("--early-exit", action="store_true", help="per position, the first layer whose logit-lens "
                   "top-1 is the model's own, and the share of positions that could stop at each layer")
    i.add_argument("--save-direction", metavar="FILE", help="write a steering direction (safetensors): the "
                   "difference of the mean residual streams after --layer between --positive and --negative "
                   "prompts; add it with generate/chat/serve --steer FILE; TEXT is not needed")
    i.add_argument("--positive", metavar="FILE", help="with --save-direction: prompts, one a line")
    i.add_argument("--negative", metavar="FILE", help="with --save-direction: prompts, one a line")
    i.add_argument("--layer", type=int, metavar="L", help="with --save-direction: the block after which the "
                   "residual stream is read (0-based)")


def standalone(args) -> bool:
    """Whether the command is one of the flags that need no TEXT."""
    return bool(args.hooks or args.patch or args.save_direction or args.probe)


def token_pair(tokenizer, text: str, flag: str) -> tuple[int, int | None]:
    """'A-B' -> (id of A, id of B), or 'A' -> (id, None); each side one token or an integer id. The
    split is the first '-' whose two sides are single tokens (so a token may contain '-')."""
    from logitlab.cli.generate import _unescape as unescape

    def one(part: str) -> int | None:
        if part.strip().isdigit():
            return int(part)
        ids = tokenizer.encode(unescape(part), allowed_special="none")
        return ids[0] if len(ids) == 1 else None

    for cut in [k for k, ch in enumerate(text) if ch == "-" and 0 < k < len(text) - 1]:
        a, b = one(text[:cut]), one(text[cut + 1:])
        if a is not None and b is not None:
            return a, b
    if one(text) is not None:
        return one(text), None
    raise ValueError(f"{flag} {text!r}: expected TOKEN or TOKEN-TOKEN, each side a single token or an integer id")


def run_standalone(args, m) -> int:
    """--hooks, --patch or --save-direction on the loaded model; prints and returns the exit code."""
    if args.hooks:
        from logitlab.model.hooks import hook_points

        points = hook_points(m.model)
        if args.json:
            print(json.dumps([dataclasses.asdict(p) for p in points]))
        else:
            _print_hooks(points)
        return 0
    if args.save_direction:
        return _save_direction(args, m)
    if args.probe:
        return _probe(args, m)
    return _patch(args, m)


def _probe(args, m) -> int:
    from pathlib import Path

    from logitlab.inspect.probes import linear_probe

    if not args.labelled:
        raise ValueError("--probe needs --labelled JSONL (one {\"text\", \"label\"} a line)")
    prompts, labels = [], []
    try:
        lines = Path(args.labelled).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"--labelled {args.labelled}: {e.strerror}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--labelled {args.labelled} line {n}: not JSON ({e.msg})") from None
        if not (isinstance(row, dict) and isinstance(row.get("text"), str) and row["text"]
                and isinstance(row.get("label"), int) and not isinstance(row["label"], bool) and row["label"] >= 0):
            raise ValueError(f"--labelled {args.labelled} line {n}: expected {{\"text\": a non-empty string, "
                             f"\"label\": an integer >= 0}}")
        prompts.append(m.tokenizer.encode(row["text"], allowed_special="none"))
        labels.append(row["label"])
    r = linear_probe(m.model, prompts, labels, args.probe)
    if args.json:
        print(json.dumps(dataclasses.asdict(r)))
    else:
        print(f"probe on {r.name}: test accuracy {r.accuracy:.3f}, shuffled-label control {r.control:.3f}, "
              f"majority class {r.majority:.3f} ({r.n_train} positions fitted, {r.n_test} tested)")
    return 0


def _print_hooks(points) -> None:
    from logitlab.cli.common import console, print_table

    rows = [[p.name, p.what] for p in points]
    print_table(console(), f"{len(points)} hook points, in the order the forward reaches them",
                ["name", "shape and meaning"], rows)


def _patch(args, m) -> int:
    from logitlab.cli.generate import _unescape as unescape
    from logitlab.inspect.patching import activation_patching, logit_difference

    if not args.metric:
        raise ValueError("--patch needs --metric TOKEN-TOKEN (the logit difference to restore)")
    tok = m.tokenizer
    clean, corrupt = (tok.encode(unescape(t), allowed_special="none") for t in args.patch)
    token, other = token_pair(tok, args.metric, "--metric")
    names, per = PATCH_KINDS[args.patch_kind]
    result = activation_patching(m.model, clean, corrupt, logit_difference(token, other), names, per)
    labels = [tok.token_bytes(i).decode("utf-8", errors="replace") for i in clean] if per == "position" else \
        [f"head {h}" for h in range(result.scores.shape[1])]
    if args.plot:
        _heatmap(result, labels, args.plot)
    if args.json:
        print(json.dumps(dict(names=result.names, per=per, clean=result.clean, corrupt=result.corrupt,
                              labels=labels, scores=result.scores.tolist()), ensure_ascii=False))
        return 0
    from logitlab.cli.common import console, print_table

    rows = [[name, *(f"{v:+.2f}" for v in row)] for name, row in zip(result.names, result.scores.tolist())]
    out = console()
    print_table(out, f"share of the logit difference restored by patching {args.patch_kind} (clean "
                f"{result.clean:.3f}, corrupt {result.corrupt:.3f})", ["patched", *labels], rows,
                right=tuple(range(1, len(labels) + 1)))
    if args.plot:
        out.print(f"heatmap written to {args.plot}", markup=False, highlight=False)
    return 0


def _heatmap(result, labels: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from logitlab.io.files import atomic_write_bytes

    scores = result.scores.numpy()
    R, C = scores.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * C + 2), max(2.5, 0.4 * R + 1.5)))
    limit = max(1.0, float(abs(scores).max()))
    image = ax.imshow(scores, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(C), [repr(x)[1:-1] for x in labels], rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(R), [n.removeprefix("blocks.") for n in result.names], fontsize=8)
    ax.set_title("share of the logit difference restored")
    fig.colorbar(image, ax=ax)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def _prompts(tokenizer, path: str, flag: str) -> list[list[int]]:
    from pathlib import Path

    if not path:
        raise ValueError(f"--save-direction needs {flag} FILE (prompts, one a line)")
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    if not lines:
        raise ValueError(f"{flag} {path} holds no prompt")
    return [tokenizer.encode(line, allowed_special="none") for line in lines]


def _save_direction(args, m) -> int:
    from logitlab.inspect.steering import save_steering, steering_direction

    if args.layer is None:
        raise ValueError("--save-direction needs --layer L (the block after which the residual stream is read)")
    positive = _prompts(m.tokenizer, args.positive, "--positive")
    negative = _prompts(m.tokenizer, args.negative, "--negative")
    direction = steering_direction(m.model, positive, negative, args.layer)
    save_steering(args.save_direction, direction, args.layer)
    print(f"wrote {args.save_direction}: a direction of norm {float(direction.norm()):.3f} after block "
          f"{args.layer} ({len(positive)} positive, {len(negative)} negative prompts)")
    return 0


def extend_report(args, m, ids, report: dict) -> None:
    """--attribute and --early-exit, added to inspect's report for TEXT."""
    if args.attribute:
        from logitlab.inspect.attribution import direct_logit_attribution

        token, other = token_pair(m.tokenizer, args.attribute, "--attribute")
        report["attribution"] = direct_logit_attribution(m.model, ids, token, other, args.position)
    if args.early_exit:
        from logitlab.inspect.lenses import early_exit

        report["early_exit"] = early_exit(m.model, ids)
    if args.tuned_lens:
        report["lens_bits"] = _lens_bits(args, m, ids)


def _lens_bits(args, m, ids) -> dict:
    """--tuned-lens: the lens loaded (or trained on --lens-data and saved), the bits over TEXT."""
    from pathlib import Path

    import torch

    from logitlab.inspect.lenses import lens_bits, load_tuned_lens, save_tuned_lens, train_tuned_lens

    path = Path(args.tuned_lens)
    trained = not path.exists()
    if trained:
        if not args.lens_data:
            raise ValueError(f"--tuned-lens {path} does not exist: give --lens-data TEXTFILE to train it")
        try:
            data = m.tokenizer.encode(Path(args.lens_data).read_text(encoding="utf-8"), allowed_special="none")
        except OSError as e:
            raise ValueError(f"--lens-data {args.lens_data}: {e.strerror}") from None
        T = min(m.model.config.context_length, 128)
        if len(data) < T:
            raise ValueError(f"--lens-data {args.lens_data} holds {len(data)} tokens; it needs at least {T}")
        windows = torch.tensor([data[i:i + T] for i in range(0, len(data) - T + 1, T)])    # (N, T)
        lens = train_tuned_lens(m.model, windows, steps=args.lens_steps)
        save_tuned_lens(lens, path)
    else:
        lens = load_tuned_lens(path, m.model)
    bits = lens_bits(m.model, ids, lens)
    if args.plot:
        _bits_plot(bits, args.plot)
    return dict(file=str(path), trained=trained, logit_lens=bits.logit_lens, tuned_lens=bits.tuned_lens)


def _bits_plot(bits, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from logitlab.io.files import atomic_write_bytes

    fig, ax = plt.subplots(figsize=(6, 3.5))
    layers = range(len(bits.logit_lens))
    ax.plot(layers, bits.logit_lens, marker="o", label="logit lens")
    ax.plot(layers, bits.tuned_lens, marker="o", label="tuned lens")
    ax.set_xlabel("layer (0: the embeddings)")
    ax.set_ylabel("KL to the final distribution (bits)")
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def print_report(out, report: dict, token_bytes) -> None:
    """The tables of --attribute and --early-exit."""
    from logitlab.cli.common import print_table, quote_token

    a = report.get("attribution")
    if a is not None:
        what = quote_token(token_bytes(a.token)) + ("" if a.other is None else
                                                    " - " + quote_token(token_bytes(a.other)))
        rows = [[name, f"{v:+.4f}"] for name, v in a.parts.items()]
        print_table(out, f"direct logit attribution of {what} at position {a.position} (final norm's scale "
                    "frozen)", ["part", "contribution"], rows, right=(1,))
        out.print(f"sum of the parts {a.total:+.4f}; the model's logit {a.logit:+.4f}", markup=False,
                  highlight=False)
        top = sorted(a.heads.items(), key=lambda kv: -abs(kv[1]))[:10]
        if top:
            print_table(out, "the heads with the largest contributions", ["head", "contribution"],
                        [[n, f"{v:+.4f}"] for n, v in top], right=(1,))
    b = report.get("lens_bits")
    if b is not None:
        pairs = zip(b["logit_lens"], b["tuned_lens"])
        rows = [[str(layer), f"{a:.3f}", f"{t:.3f}"] for layer, (a, t) in enumerate(pairs)]
        print_table(out, f"bits of KL to the final distribution, mean over the text (tuned lens {b['file']}"
                    f"{', trained now' if b['trained'] else ''})", ["layer", "logit lens", "tuned lens"], rows,
                    right=(0, 1, 2))
    e = report.get("early_exit")
    if e is not None:
        ids = report["ids"]
        rows = [[str(t), quote_token(token_bytes(ids[t])), str(layer)] for t, layer in enumerate(e.exit_layer)]
        print_table(out, "early exit: the first layer whose logit-lens top-1 is the model's (layer "
                    f"{len(e.share) - 1} = the full model)", ["pos", "token", "exit layer"], rows, right=(0, 2))
        out.print("could exit by layer: " + ", ".join(f"{layer}: {c:.0%}" for layer, c in enumerate(e.cumulative)),
                  markup=False, highlight=False)
