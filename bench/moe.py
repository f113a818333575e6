"""Mixture of experts against transformers, the same weights on both sides, and decode speed
against a dense model of equal active parameters.

Parts:
  block   the MoE layer alone (router, experts, weighted sum): logitlab's MoE (its "auto" form,
          the faster of "sorted" and "grouped" as measured in this process: the form column)
          against transformers' Qwen3MoeSparseMoeBlock with two of its experts implementations,
          "eager" (a loop over the experts hit) and "grouped_mm" (its default since 5.0: sorted
          tokens and torch's grouped matrix product), forward and training step (forward +
          backward);
  model   a small Qwen3-MoE model (Qwen3MoeForCausalLM) loaded into logitlab: forward and training
          step, against transformers' default;
  decode  greedy decode tokens/s of a small MoE against the dense model whose MLP has the width of
          the K experts a token uses (equal active parameters), logitlab's generate for both; and
          the MoE's default ("auto") form against its gather form, which "auto" takes only under
          torch.compile.

Each pair is timed alternately (bench.common.alternate) and reported as ratios: > 1 means logitlab
(or, in decode, the MoE) is faster. Beside each block shape, its GEMM floor: the same expert
products (the rows each expert gets, forward; and the four backward products per projection for
the training step) timed alone, with nothing else, so that eager's time over the floor is the most
any implementation of these products in the same precision could gain on eager. On a shared,
loaded machine timings are noisy; --cpu-time with --threads 1 counts only this process's CPU time.

    python3 -m bench.moe [--quick] [--no-doc] [--threads 2] [--cpu-time] [--repeats 5] [--section TITLE]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from bench.common import (
    add_section_option,
    alternate,
    machine_info,
    markdown_table,
    publish,
    results_name,
    timed,
    use_cpu_time,
)

TITLE = "Mixture of experts against transformers"
# (name, D, E, K, F, tokens): a small layer, a Mixtral-like one (few wide experts) and a fine-grained
# one (many narrow experts, as Qwen3-MoE)
BLOCK_SHAPES = [("D 128, 16 experts of 128, top-2", 128, 16, 2, 128, 256),
                ("D 256, 8 experts of 512, top-2", 256, 8, 2, 512, 1024),
                ("D 256, 64 experts of 64, top-8", 256, 64, 8, 64, 1024)]


def _their_block(D, E, K, F, implementation):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=True)
    config._experts_implementation = implementation
    return Qwen3MoeSparseMoeBlock(config)


def _blocks(D, E, K, F):
    """logitlab's MoE and transformers' block in its two implementations, all with the same weights."""
    from logitlab.model import ModelConfig
    from logitlab.model.moe import MoE

    torch.manual_seed(0)
    theirs = {impl: _their_block(D, E, K, F, impl) for impl in ("eager", "grouped_mm")}
    first = theirs["eager"]
    for p in first.parameters():
        torch.nn.init.normal_(p, 0.0, 0.05)
    theirs["grouped_mm"].load_state_dict(first.state_dict())
    ours = MoE(ModelConfig(vocab_size=8, context_length=8, d_model=D, n_layers=1, n_heads=1, norm="rmsnorm",
                           mlp="swiglu", positions="rope", bias=False, n_experts=E, n_experts_per_token=K, moe_d_ff=F))
    s = first.state_dict()
    with torch.no_grad():
        ours.router.weight.copy_(s["gate.weight"])
        ours.experts.gate_up_proj.copy_(s["experts.gate_up_proj"])
        ours.experts.down_proj.copy_(s["experts.down_proj"])
    return ours, theirs


def _forward(module, x):
    def run():
        with torch.no_grad():
            module(x)
    return run


def _train_step(module, x):
    def run():
        y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        y.square().mean().backward()
        module.zero_grad(set_to_none=True)
    return run


def _gemm_floor(ours, x, train: bool):
    """The expert products of ours on x alone: each expert's gate_up and down product over the rows
    the router gives it (and, for a training step, the four backward products), on random rows."""
    import torch.nn.functional as F

    from logitlab.model.moe import route

    D, Fe = ours.config.d_model, ours.config.moe_d_ff
    with torch.no_grad():
        _, experts = route(ours.router(x.reshape(-1, D)), ours.config)
    sizes = torch.bincount(experts.reshape(-1), minlength=ours.config.n_experts).tolist()
    w1, w2 = ours.experts.gate_up_proj.detach(), ours.experts.down_proj.detach()
    g = torch.Generator().manual_seed(3)
    parts = [(e, torch.randn(n, D, generator=g), torch.randn(n, Fe, generator=g), torch.randn(n, 2 * Fe, generator=g))
             for e, n in enumerate(sizes) if n]

    def run():
        for e, rows, act, grad in parts:
            F.linear(rows, w1[e])
            y = F.linear(act, w2[e])
            if train:                                   # dy = y's shape: dact, dw2; dh: drows, dw1
                y @ w2[e], y.t() @ act, grad @ w1[e], grad.t() @ rows
    return run


def _floors(ours, x, repeats: int) -> dict:
    """{"forward": s, "training step": s}: the median GEMM floor of each pass (_gemm_floor)."""
    out = {}
    for pass_, train in (("forward", False), ("training step", True)):
        run = _gemm_floor(ours, x, train)
        run()
        out[pass_] = sorted(timed(run) for _ in range(repeats))[repeats // 2]
    return out


def bench_block(quick: bool, repeats: int) -> list[dict]:
    rows = []
    for name, D, E, K, F, N in BLOCK_SHAPES[:1] if quick else BLOCK_SHAPES:
        ours, theirs = _blocks(D, E, K, F)
        x = torch.randn(max(N // 256, 1), min(N, 256), D, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = theirs["eager"](x)
            assert torch.allclose(ours(x), want, atol=1e-5), "the two blocks disagree"
        form = ours.form(x.reshape(-1, D))                                 # auto's choice, measured above
        floors = _floors(ours, x, repeats)
        for pass_, make in (("forward", _forward), ("training step", _train_step)):
            for impl, block in theirs.items():
                r = alternate(make(ours, x), make(block, x), repeats=repeats)
                rows.append(dict(part="block", shape=f"{name}, {N} tokens", pass_=pass_, against=f"transformers {impl}",
                                 form=form, floor=floors[pass_], **r))
    return rows


def _their_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024)
    return Qwen3MoeForCausalLM(config).eval()


def bench_model(quick: bool, repeats: int, tmp) -> list[dict]:
    from logitlab.io.hf import load_pretrained

    theirs = _their_model()
    theirs.save_pretrained(tmp / "hf")
    ours = load_pretrained(tmp / "hf").eval()
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(2))

    def their_forward():
        with torch.no_grad():
            theirs(ids)

    def their_train():
        theirs(ids, labels=ids).loss.backward()
        theirs.zero_grad(set_to_none=True)

    def our_train():
        from logitlab.train.loss import cross_entropy

        cross_entropy(ours(ids[:, :-1]), ids[:, 1:]).backward()
        ours.zero_grad(set_to_none=True)

    rows = []
    for pass_, mine, peer in (("forward", _forward(ours, ids), their_forward), ("training step", our_train, their_train)):
        r = alternate(mine, peer, repeats=repeats)
        form = ours.blocks[0].mlp.form(torch.zeros(ids.numel(), 256))      # auto's choice for 1,024 tokens
        rows.append(dict(part="model", shape="Qwen3-MoE, 4 layers, D 256, 16 experts top-2, 4 x 256 tokens",
                         pass_=pass_, against=f"transformers {theirs.config._experts_implementation}", form=form, **r))
    return rows


def bench_decode(quick: bool, repeats: int) -> list[dict]:
    """tokens/s of greedy decoding: an MoE (8 experts of width F, 2 per token) against the dense
    model whose MLP is 2 * F wide, so a token multiplies the same number of weights; at D = F = 256
    and, unless quick, at D = F = 1024."""
    rows = []
    for D in (256,) if quick else (256, 1024):
        rows += _decode_pair(D, 32 if quick else 64, repeats)
    return rows


def _decode_pair(D: int, n: int, repeats: int) -> list[dict]:
    from logitlab.generate import SampleConfig, generate
    from logitlab.model import ModelConfig, Transformer
    from logitlab.model.accounting import count_parameters, matmul_params
    from logitlab.model.moe import set_moe_impl

    base = dict(vocab_size=4096, context_length=512, d_model=D, n_layers=4, n_heads=D // 64, n_kv_heads=2,
                norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    moe_cfg = ModelConfig(**base, d_ff=D, n_experts=8, n_experts_per_token=2)
    dense_cfg = ModelConfig(**base, d_ff=2 * D)
    torch.manual_seed(0)
    moe, dense = Transformer(moe_cfg).eval(), Transformer(dense_cfg).eval()
    prompt, sample = list(range(1, 33)), SampleConfig(max_new_tokens=n, temperature=0)

    def decode(model):
        return lambda: generate(model, prompt, sample)

    r = alternate(decode(moe), decode(dense), repeats=repeats)
    shape = f"D {D}, 4 layers; MoE 8 x {D} top-2 vs dense F {2 * D}, {n} tokens"
    form = moe.blocks[0].mlp.form(torch.zeros(1, D))                       # auto's choice for one token
    rows = [dict(part="decode", shape=shape, pass_="decode", against="dense, equal active", form=form,
                 moe_tokens_per_s=n / min(r["ours"]), dense_tokens_per_s=n / min(r["peer"]),
                 active=[matmul_params(moe_cfg), matmul_params(dense_cfg)],
                 total=[count_parameters(moe_cfg).total, count_parameters(dense_cfg).total], **r)]
    gathered = copy.deepcopy(moe)                    # the decode form "auto" takes under torch.compile
    set_moe_impl(gathered, "gather")
    r = alternate(decode(moe), decode(gathered), repeats=repeats)
    return rows + [dict(part="decode form", shape=shape, pass_="decode", against="the gather form", form=form, **r)]


def render(result: dict) -> str:
    m = result["machine"]
    rows = [[r["part"], r["shape"], r["pass_"], r.get("form", ""), r["against"], f"{r['ratio']:.2f}x",
             f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"] for r in result["rows"]]
    text = [f"`{result['command']}` on {m['cpu']} ({m['nproc']} cores, {m['torch_threads']} threads, load "
            f"{m.get('load_avg_1m')} when it started: a shared machine), torch {m['torch']}, transformers "
            f"{m['transformers']}, {result['clock']}, commit {m.get('commit')}. Ratios are the peer's time over logitlab's (decode: the "
            "dense model's time over the MoE's; decode form: the gather form's time over the default's), median "
            "of alternating pairs, with min-max; form: the expert products' form logitlab's \"auto\" took "
            "(measured in the run):", "",
            markdown_table(["part", "shape", "pass", "form", "against", "ratio", "range"], rows)]
    floors = [[r["shape"], r["pass_"], f"{r['floor'] * 1e3:.1f}", f"{_median(r['ours']) * 1e3:.1f}",
               f"{_median(r['peer']) * 1e3:.1f}", f"{r['floor'] / _median(r['ours']):.0%}",
               f"{_median(r['peer']) / r['floor']:.2f}x"]
              for r in result["rows"] if r.get("floor") and r["against"] == "transformers eager"]
    if floors:
        text += ["", "GEMM floor: the expert products alone (see bench/moe.py), in ms, against logitlab's and "
                 "transformers eager's median times in the same run; eager / floor is the most any implementation "
                 "of these products in this precision could gain on eager:", "",
                 markdown_table(["shape", "pass", "GEMM floor ms", "logitlab ms", "eager ms", "logitlab's GEMM share",
                                 "eager / floor"], floors)]
    for r in result["rows"]:
        if r["part"] == "decode":
            text += ["", f"Decode: MoE {r['moe_tokens_per_s']:.0f} tok/s, dense {r['dense_tokens_per_s']:.0f} tok/s "
                     f"(weights multiplied per token {r['active'][0]:,} and {r['active'][1]:,}; total parameters "
                     f"{r['total'][0]:,} and {r['total'][1]:,})."]
    return "\n".join(text)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main(argv=None) -> int:
    import tempfile
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true", help="time with process CPU time instead of wall time")
    parser.add_argument("--parts", default="block,model,decode", help="comma-separated parts to run")
    add_section_option(parser, TITLE)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = use_cpu_time(args.cpu_time)
    parts, rows = args.parts.split(","), []
    with tempfile.TemporaryDirectory() as tmp:
        if "block" in parts:
            rows += bench_block(args.quick, args.repeats)
        if "model" in parts:
            rows += bench_model(args.quick, args.repeats, Path(tmp))
        if "decode" in parts:
            rows += bench_decode(args.quick, args.repeats)
    for r in rows:
        print(f"{r['part']:6} {r['shape'][:40]:40} {r['pass_']:13} {r.get('form', ''):7} vs {r['against']:23} "
              f"{r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
    result = dict(command=" ".join(["python3 -m bench.moe", *sys.argv[1:]]), machine=machine_info(), clock=clock,
                  rows=copy.deepcopy(rows))
    publish(results_name("moe", args.section, TITLE), args.section, result, render, quick=args.quick, doc=not args.no_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
