"""Passkey retrieval (Mohtashami & Jaggi 2023), generated locally: a five-digit key hidden at a
chosen depth of filler text, then asked for. Accuracy by evaluation length x depth.

The haystack is, by default, the paper's own filler: the same few sentences repeated ("The grass
is green. The sky is blue. ..."), so once a model has learned the filler, the key's digits are the
only bytes it cannot predict, and copying them is what the loss rewards (--filler text takes real
tinyshakespeare bytes instead, which a model this small never learned to search through). The
needle is
" pass key 48213." inserted at `depth` (0 = the start, 1 = just before the question) and the
question " pass key? " then the answer "48213" at the end, the whole of exactly L bytes. An
example counts as retrieved when the model's argmax predicts all five digits (teacher-forced,
which is what greedy decoding would write when every digit is right).

The tiny models of bench.extrapolation (same shape) are trained at T = --train-len on the same
kind of examples (random keys, depths and filler phases), so retrieval is a learned skill at T,
and the question is whether it survives longer haystacks; RoPE is also evaluated with YaRN
scaling (factor L / T) at inference. CPU-sized; one seed.

    python3 -m bench.passkey [--quick] [--steps 600] [--train-len 64] [--lengths 64,128,256,512]
        [--schemes rope,alibi,none] [--filler repeated|text] [--plot PNG] [--threads 2]

Results: bench/results/passkey.json and markdown tables on stdout (length rows, depth columns;
each cell: keys retrieved / single digits right, chance 0.1 for a digit).
"""

from __future__ import annotations

import argparse

import torch

from bench.common import machine_info, markdown_table, publish
from bench.extrapolation import DATA, SHAPE, at_length, fit, load_bytes
from logitlab.model import ModelConfig, Transformer

# The byte just before the digits ("#") is the same in the needle and the question and occurs
# nowhere else, so the key can be found by matching one byte and copying what follows it (an
# induction head). With the question " pass key? " (an earlier version) the byte before the answer
# was a space, as in hundreds of places of the filler, and no model here learned to retrieve.
NEEDLE, QUESTION, DIGITS = b" pass key #%s.", b" pass key? #", 5
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FILLER = b" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def repeated_filler(n_bytes: int = 1 << 16) -> torch.Tensor:
    """FILLER repeated to n_bytes (long ids); examples start at random phases of it."""
    return torch.tensor(list((FILLER * (n_bytes // len(FILLER) + 1))[:n_bytes]), dtype=torch.long)


def example(haystack: torch.Tensor, L: int, depth: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One passkey example of exactly L bytes and its key: (ids (L,), key digits (DIGITS,))."""
    key = torch.randint(0, 10, (DIGITS,), generator=g)
    digits = bytes(ord("0") + int(d) for d in key)
    needle = torch.tensor(list(NEEDLE % digits))
    tail = torch.tensor(list(QUESTION + digits))
    n_fill = L - len(needle) - len(tail)
    if n_fill < 0:
        raise ValueError(f"a passkey example needs at least {len(needle) + len(tail)} bytes, got L={L}")
    start = int(torch.randint(0, len(haystack) - n_fill, (1,), generator=g))
    fill = haystack[start:start + n_fill]
    cut = round(depth * n_fill)
    return torch.cat((fill[:cut], needle, fill[cut:], tail)), key + ord("0")


def sampler(haystack: torch.Tensor):
    """Training rows (B, T + 1): passkey examples of random depth."""
    def sample(g: torch.Generator, B: int, T: int) -> torch.Tensor:
        depths = torch.rand(B, generator=g).tolist()
        return torch.stack([example(haystack, T + 1, d, g)[0] for d in depths])
    return sample


@torch.no_grad()
def accuracy(model: Transformer, haystack: torch.Tensor, L: int, depth: float, n: int = 20,
             seed: int = 0) -> tuple[float, float]:
    """(share of n examples of length L whose five digits the model's argmax all predicts, share of
    single digits it predicts; chance is 0.1)."""
    g = torch.Generator().manual_seed(seed)
    rows, keys = zip(*(example(haystack, L, depth, g) for _ in range(n)))
    ids, keys = torch.stack(rows), torch.stack(keys)                               # (n, L), (n, DIGITS)
    guess = model(ids[:, :-1])[:, -DIGITS:].argmax(-1)                            # the digits' positions
    hits = guess == keys                                                           # (n, DIGITS)
    return hits.all(dim=-1).float().mean().item(), hits.float().mean().item()


def run(steps: int, T: int, lengths: list[int], schemes=("rope", "alibi", "none"), n: int = 20,
        data=DATA, filler: str = "repeated", answer_weight: float = 10.0) -> dict:
    if filler == "repeated":
        train_tokens = held_out = repeated_filler()
    else:
        tokens = load_bytes(data)
        split = int(0.9 * len(tokens))
        train_tokens, held_out = tokens[:split], tokens[split:]
    rows = []
    for scheme in schemes:
        torch.manual_seed(0)
        model = fit(Transformer(ModelConfig(**SHAPE, context_length=T, positions=scheme)), train_tokens, steps,
                    sample=sampler(train_tokens), tail=(DIGITS, answer_weight))
        for scaling in (("none", "yarn") if scheme == "rope" else ("none",)):
            grid = {}
            for L in lengths:
                wide = at_length(model, L, scaling)
                grid[L] = None if wide is None else [[round(a, 3) for a in accuracy(wide, held_out, L, d, n)]
                                                     for d in DEPTHS]
            rows.append({"positions": scheme, "scaling": scaling, "accuracy": grid})
    return {"train_len": T, "steps": steps, "lengths": lengths, "depths": list(DEPTHS), "examples": n,
            "filler": filler, "answer_weight": answer_weight, "shape": SHAPE, "rows": rows, "machine": machine_info()}


def heat_map(result: dict, png) -> None:
    """One panel per (positions, scaling): keys retrieved by length (rows) x depth (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.8 * len(rows), 3.4), squeeze=False)
    fig.subplots_adjust(wspace=0.35)
    for ax, r in zip(axes[0], rows):
        grid = [[float("nan")] * len(result["depths"]) if acc is None else [a for a, _ in acc]
                for acc in r["accuracy"].values()]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(result["depths"])), [f"{d:g}" for d in result["depths"]])
        ax.set_yticks(range(len(grid)), [f"{L}{'*' if L == result['train_len'] else ''}" for L in r["accuracy"]])
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                ax.text(j, i, "-" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 else "white")
        ax.set_title(f"{r['positions']}, {r['scaling']}", fontsize=9)
        ax.set_xlabel("depth")
    axes[0][0].set_ylabel("length (* = training)")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="keys retrieved")
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)


def render(result: dict) -> str:
    parts = []
    for r in result["rows"]:
        heads = ["length \\ depth"] + [f"{d:.2f}" for d in result["depths"]]
        body = [[f"{L}{' (train)' if L == result['train_len'] else ''}"]
                + (["-"] * len(result["depths"]) if acc is None else [f"{a:.2f} / {b:.2f}" for a, b in acc])
                for L, acc in r["accuracy"].items()]
        parts.append(f"**{r['positions']}, scaling {r['scaling']}** (keys retrieved / digits right)\n\n"
                     + markdown_table(heads, body))
    return "\n\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 steps, lengths up to 2x, 5 examples")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--train-len", type=int, default=64)
    parser.add_argument("--lengths", default=None)
    parser.add_argument("--schemes", default="rope,alibi,none")
    parser.add_argument("--filler", choices=("repeated", "text"), default="repeated",
                        help="haystack: the repeated filler sentences (default) or tinyshakespeare bytes")
    parser.add_argument("--plot", help="also write a heat map PNG here")
    parser.add_argument("--answer-weight", type=float, default=10.0,
                        help="the answer digits' weight in the training loss (1 = plain language modelling)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-doc", action="store_true", help="accepted for `python3 -m bench`; nothing to update")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    T = args.train_len
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [T, 2 * T, 4 * T, 8 * T]
    if args.quick:
        lengths = [L for L in lengths if L <= 2 * T]
    result = run(40 if args.quick else args.steps, T, lengths, tuple(args.schemes.split(",")),
                 n=5 if args.quick else 20, filler=args.filler, answer_weight=args.answer_weight)
    print(render(result))
    if args.plot:
        heat_map(result, args.plot)
    publish("passkey", "Passkey retrieval", result, render, quick=args.quick, doc=False)


if __name__ == "__main__":
    main()
