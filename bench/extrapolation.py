"""Length extrapolation, measured: perplexity against evaluation length past the training length.

One tiny model per position scheme (learned, sinusoidal, rope, alibi, none) is trained from the
same seed on the same bytes of tinyshakespeare at T = --train-len, then evaluated on held-out
windows of each length in --lengths. RoPE is also evaluated with every inference-time scaling of
logitlab.model.positions.extended_config (linear, ntk, dynamic, yarn with factor L / T): none of
them retrains. Learned positions have no row past T, so they are reported up to T only.

CPU-sized on purpose (a byte-level model of 0.36M parameters, a few hundred steps): the numbers
show the shape of each curve, not what a real model reaches.

    python3 -m bench.extrapolation [--quick] [--steps 600] [--train-len 64] [--lengths 64,128,256,512]
        [--schemes learned,sinusoidal,rope,alibi,none] [--finetune STEPS] [--threads 2] [--data PATH]

Results: bench/results/extrapolation.json and a markdown table on stdout (docs/positions.md
carries a copy).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import machine_info, markdown_table, publish
from logitlab.model import ModelConfig, Transformer
from logitlab.model.positions import extended_config

DATA = Path("/work/shared/data/tinyshakespeare.txt")
SCHEMES = ("learned", "sinusoidal", "rope", "alibi", "none")
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn")
SHAPE = dict(vocab_size=256, d_model=96, n_layers=3, n_heads=4, norm="rmsnorm", mlp="swiglu", bias=False,
             tie_embeddings=True)


def load_bytes(path: Path) -> torch.Tensor:
    """The file's bytes as token ids (V = 256); a small synthetic text when it is absent."""
    if path.exists():
        data = path.read_bytes()
    else:
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
        g = torch.Generator().manual_seed(0)
        data = " ".join(words[i] for i in torch.randint(0, len(words), (60000,), generator=g)).encode()
    return torch.tensor(list(data), dtype=torch.long)


def train(scheme: str, tokens: torch.Tensor, T: int, steps: int) -> Transformer:
    """A model with positions=`scheme` trained for `steps` AdamW steps on random windows of T + 1."""
    torch.manual_seed(0)
    return fit(Transformer(ModelConfig(**SHAPE, context_length=T, positions=scheme)), tokens, steps)


def fit(model: Transformer, tokens: torch.Tensor, steps: int, batch: int = 16, lr: float = 3e-3,
        sample=None, tail: tuple[int, float] | None = None) -> Transformer:
    """`steps` AdamW steps (warm-up, cosine decay) on random windows of the model's context + 1,
    or on the rows sample(generator, batch, T) -> (B, T + 1) returns. tail=(k, w): the last k
    targets of each row weigh w times the others in the mean loss (an answer at the end)."""
    T = model.config.context_length
    sample = sample or (lambda g, B, T: windows(tokens, g, B, T))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for group in opt.param_groups:                             # linear warm-up, cosine decay
            warm = min(1.0, (step + 1) / 30)
            group["lr"] = lr * warm * 0.5 * (1 + math.cos(math.pi * step / steps))
        rows = sample(g, batch, T)                                                # (B, T + 1)
        nll = F.cross_entropy(model(rows[:, :-1]).transpose(1, 2), rows[:, 1:], reduction="none")  # (B, T)
        weights = torch.ones_like(nll)
        if tail is not None:
            weights[:, -tail[0]:] = tail[1]
        loss = (nll * weights).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def windows(tokens: torch.Tensor, g: torch.Generator, B: int, T: int) -> torch.Tensor:
    """B random windows of T + 1 tokens: (B, T + 1)."""
    starts = torch.randint(0, len(tokens) - T - 1, (B,), generator=g)
    return torch.stack([tokens[s:s + T + 1] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model: Transformer, tokens: torch.Tensor, L: int, n_tokens: int = 8192) -> float:
    """exp(mean next-token loss) over every position of consecutive held-out windows of length L."""
    n = max(2, n_tokens // L)
    rows = torch.stack([tokens[i * L:i * L + L + 1] for i in range(n)])                  # (n, L + 1)
    losses = [F.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten()).item()
              for chunk in rows.split(8)]
    sizes = [len(chunk) for chunk in rows.split(8)]
    return math.exp(sum(l_ * s for l_, s in zip(losses, sizes)) / sum(sizes))


def at_length(model: Transformer, L: int, scaling: str) -> Transformer | None:
    """The trained weights in a model built for L positions with `scaling`, or None (learned past T)."""
    try:
        config = extended_config(model.config, L, scaling)
    except ValueError:
        return None
    if config is model.config:
        return model
    wide = Transformer(config).eval()
    wide.load_state_dict(model.state_dict())
    return wide


def run(steps: int, T: int, lengths: list[int], data: Path = DATA, schemes=SCHEMES, eval_tokens: int = 8192,
        finetune: int = 0) -> dict:
    """Train every scheme, evaluate it (and RoPE under each scaling) at every length; with
    `finetune` > 0, also fine-tune the RoPE model that many steps at the longest length under
    linear (PI) and YaRN scaling, and evaluate those up to that length."""
    tokens = load_bytes(data)
    split = int(0.9 * len(tokens))
    train_tokens, held_out = tokens[:split], tokens[split:]
    rows = []
    for scheme in schemes:
        start = time.perf_counter()
        model = train(scheme, train_tokens, T, steps)
        seconds = time.perf_counter() - start
        for scaling in (ROPE_SCALINGS if scheme == "rope" else ("none",)):
            ppl = {}
            for L in lengths:
                wide = at_length(model, L, scaling)
                ppl[L] = None if wide is None else round(perplexity(wide, held_out, L, eval_tokens), 3)
            rows.append({"positions": scheme, "scaling": scaling, "train_seconds": round(seconds, 1), "ppl": ppl})
        if scheme == "rope" and finetune:
            rows += [finetuned(model, train_tokens, held_out, lengths, kind, finetune, eval_tokens)
                     for kind in ("linear", "yarn")]
    return {"train_len": T, "steps": steps, "finetune_steps": finetune, "lengths": lengths, "shape": SHAPE, "data": str(data),
            "rows": rows, "machine": machine_info()}


def finetuned(model, train_tokens, held_out, lengths, kind: str, steps: int, eval_tokens: int) -> dict:
    """The trained RoPE model extended to max(lengths) with `kind`, fine-tuned `steps` steps there."""
    L = max(lengths)
    torch.manual_seed(0)
    wide = fit(at_length(model, L, kind), train_tokens, steps,
               batch=max(1, 16 * model.config.context_length // L), lr=1e-3)
    return {"positions": "rope", "scaling": f"{kind} + {steps} steps at {L}",
            "ppl": {n: round(perplexity(wide, held_out, n, eval_tokens), 3) for n in lengths}}


def render(result: dict) -> str:
    T = result["train_len"]
    heads = ["positions", "scaling"] + [f"{L}{' (train)' if L == T else ''}" for L in result["lengths"]]
    body = [[r["positions"], r["scaling"]] + ["-" if r["ppl"][L] is None else f"{r['ppl'][L]:.2f}"
                                               for L in result["lengths"]] for r in result["rows"]]
    return (f"Byte-level perplexity on held-out tinyshakespeare, trained at T = {T} for {result['steps']} steps "
            f"(d_model {SHAPE['d_model']}, {SHAPE['n_layers']} layers; CPU-sized).\n\n" + markdown_table(heads, body))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 steps, lengths up to 4x: a smoke run")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--train-len", type=int, default=64)
    parser.add_argument("--lengths", default=None, help="comma-separated evaluation lengths")
    parser.add_argument("--finetune", type=int, default=0,
                        help="also fine-tune the RoPE model this many steps at the longest length (PI, YaRN)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated positions values")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--no-doc", action="store_true", help="accepted for `python3 -m bench`; nothing to update")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    T = args.train_len
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [T, 2 * T, 4 * T, 8 * T]
    steps = 40 if args.quick else args.steps
    if args.quick:
        lengths = [L for L in lengths if L <= 4 * T]
    schemes = tuple(args.schemes.split(","))
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown:
        parser.error(f"unknown --schemes {unknown}; known: {', '.join(SCHEMES)}")
    result = run(steps, T, lengths, args.data, schemes, finetune=args.finetune)
    print(render(result))
    publish("extrapolation", "Length extrapolation", result, render, quick=args.quick, doc=False)


if __name__ == "__main__":
    main()
