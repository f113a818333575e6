"""Time to a target loss: logitlab's training recipes against nanoGPT's, on the same data and budget.

    python3 -m bench.speedrun --nanogpt ~/src/nanoGPT                        # demo size, 240 s a run
    python3 -m bench.speedrun --nanogpt ~/src/nanoGPT --sizes demo 4x --seeds 1 2 3
    python3 -m bench.speedrun --nanogpt ~/src/nanoGPT --budget-tokens 2000000 --ablation
    python3 -m bench.speedrun --nanogpt ~/src/nanoGPT --budget-flops 5e13 --fractions 1 0.5

nanoGPT is not a package: clone it outside this repository and name the folder (its train.py is
run as it is; speedrun_sides.py says how). Every run trains from scratch on the default corpus (the
Python standard library's source, prepared once under --workdir) and is scored on one fixed
validation set in bits per byte. The budget is the same for every recipe of a size, one of:
- --budget-s S (wall clock): each recipe's step is timed first (a short run, in turn), and its
  step count is what fits S; the time reported is the sum of its steps' own times (evaluations
  and saving excluded, as nanoGPT's iteration times exclude nothing but are corrected for its
  evaluations);
- --budget-tokens N: N training tokens for every recipe (the same batch and length);
- --budget-flops F: F training FLOPs (3x the forward, accounting.flops_per_token; Muon's
  Newton-Schulz products added per step);
- --budget-steps-of RECIPE N (wall clock, scaled to a reference): the time RECIPE takes for N steps
  here, each recipe's step timed first as for --budget-s; so "N steps of the baseline", the work
  `logitlab demo` does in its 4 minutes on a quiet machine, keeps its meaning on a loaded one (every
  recipe gets the same share of the load, and the steps that fit RECIPE's N steps' time).
Runs alternate (round r starts with the r-th recipe), over --seeds (nanoGPT's train.py fixes its
own seed, so its repeats differ only in time). Each size reports, per recipe, the validation bits
per byte at the end of the budget (mean, min-max over seeds), and the time and the share of the
budget at which it first reaches the target: the bits per byte nanoGPT's recipe ends at (linear
between evaluations; with --fractions also the final loss of runs given a share of the budget,
whose schedule ends there). --ablation adds the speedrun recipe with one trick removed at a time.

On a shared machine wall-clock budgets move with the load: the token and FLOP budgets hold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench import speedrun_sides as sides
from bench.common import add_section_option, command_line, machine_info, markdown_table, publish, results_name

SIZES = {  # the demo's model (cli/demo.py) and one about 4x its parameters
    "demo": dict(context_length=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384),
    "4x": dict(context_length=128, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=768),
}
BATCH, EVAL_TOKENS, EVALS = 16, 16384, 10
# the demo's training today: the tiny preset (Llama's layout) with AdamW at 3e-3 and the cosine to lr/10
BASELINE = dict(model={}, train=dict(lr=3e-3))
# the speedrun recipe with one trick removed (its fields as they are without it), and with each of the
# two published parts it leaves out (they measured worse here) put back
ABLATIONS = {
    "no Muon (AdamW)": dict(train=dict(optimizer="adamw", matrix_lr=None)),
    "no WSD (cosine)": dict(train=dict(lr_schedule="cosine")),
    "no ReLU² (SwiGLU)": dict(model=dict(mlp="swiglu", d_ff="size")),
    "no QK-norm": dict(model=dict(qk_norm=False)),
    "no value embeddings": dict(model=dict(value_embeddings="none")),
    "no soft-cap": dict(model=dict(logit_softcap=None)),
    "no zero init": dict(model=dict(zero_init_output=False)),
    "with an untied head (own rate)": dict(model=dict(tie_embeddings=False), train=dict(head_lr=3e-3)),
    "with parameter-free norms": dict(model=dict(norm_affine=False)),
}


def recipe_fields(name: str, size: str) -> tuple[dict, dict]:
    """(ModelConfig fields beyond the tiny preset's, TrainConfig fields) of a logitlab recipe."""
    from logitlab.train.recipes import SPEEDRUN

    if name == "baseline":
        return {}, dict(BASELINE["train"])
    model, train = dict(SPEEDRUN.model), dict(SPEEDRUN.train)
    if name != "speedrun":
        change = ABLATIONS[name.removeprefix("speedrun, ")]
        model.update(change.get("model", {}))
        train.update(change.get("train", {}))
    if model.get("d_ff") == "size":
        model["d_ff"] = SIZES[size]["d_ff"]
    return model, train


def model_config(name: str, size: str, vocab_size: int) -> dict:
    from logitlab.model.families import get_preset

    model, _ = recipe_fields(name, size)
    return get_preset("tiny", vocab_size=vocab_size, **{**SIZES[size], **model}).to_dict()


def logitlab_spec(name: str, size: str, seed: int, steps: int, out: Path, paths: dict, vocab: int,
                  threads: int | None, evals: int = EVALS) -> dict:
    _, train = recipe_fields(name, size)
    every = max(1, steps // evals) if evals else 0
    train.update(data_dir=paths["data"], out_dir=str(out), steps=steps, batch_size=BATCH,
                 seq_len=SIZES[size]["context_length"], warmup_steps=max(1, steps // 20), eval_every=every,
                 eval_tokens=EVAL_TOKENS, eval_at_start=False, save_every=0, keep_last=1, seed=seed,
                 device="cpu", precision="fp32", tensorboard=False, keep_freed_memory="on")
    return {"name": name, "model": model_config(name, size, vocab), "train": train, "threads": threads}


def step_seconds(args, names: list[str], size: str, paths: dict, vocab: int) -> dict[str, float]:
    """The median step time of every recipe here, from short runs in turn (no evaluations)."""
    work, shape, steps = Path(args.workdir), SIZES[size], args.calibration_steps
    out = {}
    for name in names:
        if name == "nanogpt":
            r = sides.run_nanogpt(Path(args.nanogpt), paths, shape, steps, BATCH, work / "calibrate-nanogpt",
                                  steps, 1, args.threads)
        else:
            spec = logitlab_spec(name, size, 0, steps, work / "calibrate", paths, vocab, args.threads, evals=0)
            r = sides.run_logitlab(spec, work)
        out[name] = statistics.median(r["step_s"][1:])
    return out


def planned_steps(args, names, size, paths, vocab) -> dict[str, int]:
    """Every recipe's step count for the budget (see the module docstring)."""
    tokens_per_step = BATCH * SIZES[size]["context_length"]
    if args.budget_tokens:
        return {n: max(1, args.budget_tokens // tokens_per_step) for n in names}
    if args.budget_flops:
        from logitlab.model.accounting import flops_per_token
        from logitlab.model.transformer import ModelConfig

        steps = {}
        for n in names:
            if n == "nanogpt":
                per_step = sides.nanogpt_train_flops_per_token(SIZES[size], vocab) * tokens_per_step
            else:
                spec = logitlab_spec(n, size, 0, 1, Path(args.workdir), paths, vocab, None)
                per_step = float(flops_per_token(ModelConfig.from_dict(spec["model"]))["training"]) * tokens_per_step
                per_step += sides.muon_flops_per_step(spec["model"], spec["train"])
            steps[n] = max(1, int(args.budget_flops // per_step))
        return steps
    seconds = step_seconds(args, names, size, paths, vocab)
    budget_s = args.budget_s
    if args.budget_steps_of:
        anchor, anchor_steps = args.budget_steps_of
        budget_s = int(anchor_steps) * seconds[anchor]
    return {n: max(1, int(budget_s / s)) for n, s in seconds.items()}


def run_one(args, name: str, size: str, seed: int, steps: int, paths: dict, vocab: int, val: tuple) -> dict:
    work = Path(args.workdir)
    shape = SIZES[size]
    if name == "nanogpt":
        r = sides.run_nanogpt(Path(args.nanogpt), paths, shape, steps, BATCH, work / f"nanogpt-{size}",
                              max(1, steps // EVALS), 8, args.threads)
        final = sides.score_nanogpt(Path(args.nanogpt), r.pop("ckpt"), paths, shape["context_length"], BATCH,
                                    EVAL_TOKENS)
        r["curve"].append([sum(r["step_s"]), steps * BATCH * shape["context_length"], final])
        r["params"] = None
    else:
        r = sides.run_logitlab(logitlab_spec(name, size, seed, steps, work / "run", paths, vocab, args.threads), work)
    r["bpb"] = [[t, tok, sides.bits_per_byte(nats, *val)] for t, tok, nats in r["curve"]]
    r.update(name=name, size=size, seed=seed, train_s=sum(r["step_s"]), final_bpb=r["bpb"][-1][2])
    return r


def reach(curve: list, target: float) -> tuple[float, float] | None:
    """(training seconds, tokens) at which the (seconds, tokens, bpb) curve first reaches `target`,
    linear between its points; None if it never does."""
    prev = None
    for t, tok, b in curve:
        if b <= target:
            if prev is None:
                return t, tok
            t0, tok0, b0 = prev
            w = (b0 - target) / (b0 - b) if b0 != b else 1.0
            return t0 + (t - t0) * w, tok0 + (tok - tok0) * w
        prev = (t, tok, b)
    return None


def run(args) -> dict:
    from logitlab.tokenizer.core import Tokenizer

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    paths = sides.prepare(work)
    vocab = Tokenizer.load(paths["tokenizer"]).vocab_size
    names = ["nanogpt", *args.recipes] + ([f"speedrun, {a}" for a in ABLATIONS] if args.ablation else [])
    result = {"command": command_line(), "machine": machine_info(), "budget": budget_words(args), "sizes": {}}
    for size in args.sizes:
        val = sides.validation_bytes(paths, SIZES[size]["context_length"], BATCH, EVAL_TOKENS)
        steps = planned_steps(args, names, size, paths, vocab)
        runs = []
        for fraction in args.fractions:
            for r_i, seed in enumerate(args.seeds):
                order = names[r_i % len(names):] + names[:r_i % len(names)]    # alternate who goes first
                for name in order:
                    if name == "nanogpt" and (fraction != 1 or r_i > 0 and not args.repeat_peer):
                        continue                                             # its seed is fixed: once
                    n = max(1, int(steps[name] * fraction))
                    runs.append({**run_one(args, name, size, seed, n, paths, vocab, val), "fraction": fraction})
                    print(f"{size} {name} seed {seed} x{fraction}: {n} steps, {runs[-1]['train_s']:.0f} s, "
                          f"{runs[-1]['final_bpb']:.4f} bpb", file=sys.stderr, flush=True)
        result["sizes"][size] = summarize(runs, steps, val)
    return result


def summarize(runs: list[dict], steps: dict, val: tuple) -> dict:
    peer = [r for r in runs if r["name"] == "nanogpt"]
    target = statistics.mean(r["final_bpb"] for r in peer)
    budget_s = statistics.mean(r["train_s"] for r in peer)
    budget_tokens = peer[0]["bpb"][-1][1]
    rows = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name and r["fraction"] == 1]
        hits = [reach(r["bpb"], target) for r in mine]
        short = {f: [r["final_bpb"] for r in runs if r["name"] == name and r["fraction"] == f]
                 for f in sorted({r["fraction"] for r in runs if r["name"] == name}) if f != 1}
        rows[name] = dict(steps=steps[name], params=mine[0]["params"], train_s=[r["train_s"] for r in mine],
                          final_bpb=[r["final_bpb"] for r in mine], time_to_target=[h and h[0] for h in hits],
                          share_of_budget=[h and h[0] / budget_s for h in hits],
                          token_share=[h and h[1] / budget_tokens for h in hits],
                          shorter_runs=short, curves=[r["bpb"] for r in mine])
    return {"target_bpb": target, "nanogpt_train_s": budget_s, "nanogpt_tokens": budget_tokens,
            "val_targets_bytes": list(val), "recipes": rows}


def budget_words(args) -> str:
    if args.budget_tokens:
        return f"{args.budget_tokens:,} training tokens"
    if args.budget_flops:
        return f"{args.budget_flops:.3g} training FLOPs"
    if args.budget_steps_of:
        return f"the training time of {int(args.budget_steps_of[1]):,} {args.budget_steps_of[0]} steps (wall clock)"
    return f"{args.budget_s:g} s of training steps (wall clock)"


def _span(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.mean(values)
    return f"{mean:.4f}" if len(values) == 1 else f"{mean:.4f} ({min(values):.4f}-{max(values):.4f})"


def _reach(row: dict) -> str:
    shares = row["share_of_budget"]
    if any(s is None for s in shares):
        return f"not reached in {sum(s is None for s in shares)} of {len(shares)}"
    return (f"{statistics.mean(shares):.2f} ({statistics.mean(row['time_to_target']):.0f} s); "
            f"tokens {statistics.mean(row['token_share']):.2f}")


def render(result: dict) -> str:
    m = result["machine"]
    parts = [f"`{result['command']}` on {m['cpu']} ({m['nproc']} cores, torch {m['torch']}, load average "
             f"{m.get('load_avg_1m', '?')} at the start; commit {m['commit']}). Budget: {result['budget']} per run. "
             "Bits per byte on the fixed validation set; \"to target\": the share of nanoGPT's training time "
             "(and the seconds), and of its tokens, at which a recipe first reaches nanoGPT's final bits per byte "
             "(linear between evaluations)."]
    for size, s in result["sizes"].items():
        rows = []
        for name, row in s["recipes"].items():
            short = "; ".join(f"x{f}: {_span(v)}" for f, v in row["shorter_runs"].items()) or "-"
            rows.append([name, f"{row['params']:,}" if row["params"] else "-", str(row["steps"]),
                         f"{statistics.mean(row['train_s']):.0f}", _span(row["final_bpb"]),
                         "-" if name == "nanogpt" else _reach(row), short])
        parts.append(f"**{size}** (target {s['target_bpb']:.4f} bpb, nanoGPT trained {s['nanogpt_train_s']:.0f} s)\n\n"
                     + markdown_table(["recipe", "parameters", "steps", "train s", "val bpb at the end",
                                       "to target: share of nanoGPT's time (s); of its tokens",
                                       "shorter budgets, final bpb"], rows))
    return "\n\n".join(parts)


def plot(result: dict, size: str, path: Path) -> Path:
    """Validation bits per byte against training seconds and against training tokens, one line per
    recipe (its first seed; the ablations left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["sizes"][size]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    for ax, x, label in ((axes[0], 0, "training seconds (sum of step times)"), (axes[1], 1, "training tokens")):
        for name, row in s["recipes"].items():
            if name.startswith("speedrun, "):
                continue
            curve = row["curves"][0]
            if name == "nanogpt":   # its own estimates (random validation batches), then the fixed set's final
                line = ax.plot([p[x] for p in curve[:-1]], [p[2] for p in curve[:-1]], marker="o", ms=3, ls="--",
                               label="nanoGPT (its own validation estimate)")
                ax.plot([curve[-1][x]], [curve[-1][2]], marker="*", ms=11, ls="", color=line[0].get_color(),
                        label="nanoGPT's final, fixed validation set")
                continue
            ax.plot([p[x] for p in curve], [p[2] for p in curve], marker="o", ms=3, label=f"logitlab {name}")
        ax.axhline(s["target_bpb"], color="grey", ls="--", lw=1, label="target: nanoGPT's final")
        ax.set_xlabel(label)
    axes[0].set_ylabel("validation bits per byte")
    axes[1].legend()
    fig.suptitle(f"{size} model: {result['budget']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _checked(parser, args):
    """args, with 1 in --fractions; a folder without train.py or an unknown recipe is a usage error."""
    if not (Path(args.nanogpt) / "train.py").is_file():
        parser.error(f"--nanogpt {args.nanogpt}: no train.py there (give the folder of a nanoGPT clone)")
    if 1.0 not in args.fractions:
        args.fractions = [1.0, *args.fractions]
    unknown = [r for r in args.recipes if r not in ("baseline", "speedrun")
               and r.removeprefix("speedrun, ") not in ABLATIONS]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; known: baseline, speedrun, " +
                     ", ".join(f"'speedrun, {a}'" for a in ABLATIONS))
    if args.budget_steps_of and (args.budget_steps_of[0] not in ["nanogpt", *args.recipes]
                                 or not args.budget_steps_of[1].isdigit() or int(args.budget_steps_of[1]) < 1):
        parser.error(f"--budget-steps-of {' '.join(args.budget_steps_of)}: give one of the recipes run "
                     f"(nanogpt, {', '.join(args.recipes)}) and a step count >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        sides.logitlab_child(argv[1])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", required=True, metavar="FOLDER", help="a clone of nanoGPT outside this "
                        "repository (the folder holding its train.py)")
    parser.add_argument("--workdir", default="/tmp/logitlab-speedrun", help="prepared data and runs (reused)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["demo"])
    parser.add_argument("--recipes", nargs="+", default=["baseline", "speedrun"],
                        help="logitlab recipes besides nanoGPT: baseline, speedrun, 'speedrun, <ablation>'")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-s", type=float, default=240.0, help="seconds of training steps (default 240)")
    budget.add_argument("--budget-tokens", type=int, help="training tokens per run")
    budget.add_argument("--budget-flops", type=float, help="training FLOPs per run")
    budget.add_argument("--budget-steps-of", nargs=2, metavar=("RECIPE", "STEPS"),
                        help="the time RECIPE's STEPS steps take here (its step timed first), for every recipe")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--fractions", nargs="+", type=float, default=[1.0],
                        help="also runs given these shares of the budget (their schedules end there)")
    parser.add_argument("--ablation", action="store_true", help="add the speedrun recipe less one trick each")
    parser.add_argument("--repeat-peer", action="store_true", help="run nanoGPT in every round (timing only)")
    parser.add_argument("--calibration-steps", type=int, default=12, help="steps timed per recipe (--budget-s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--plot", default=None, help="PNG of the first size's curves (default: none)")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    add_section_option(parser, "Time to a target loss against nanoGPT")
    args = _checked(parser, parser.parse_args(argv))
    result = run(args)
    if args.plot:
        print(f"plot: {plot(result, args.sizes[0], Path(args.plot))}")
    publish(results_name("speedrun", args.section, "Time to a target loss against nanoGPT"), args.section, result,
            render, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
