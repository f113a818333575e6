"""Post-training subcommands: `tokenizer add-special` (its parser is added by cli/tokenizer.py
through `add_special_parser`), `sft` (supervised fine-tuning, optionally with LoRA) and
`embedding-diff` (what fine-tuning changed in the embedding)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from logitlab.cli import common as cli

CHATML = "chatml"


# --------------------------------------------------------------------------------------------
# tokenizer add-special
# --------------------------------------------------------------------------------------------

def add_special_parser(sub) -> None:
    """`logitlab tokenizer add-special`, added to the tokenizer command's subparsers."""
    p = sub.add_parser("add-special", help="add special tokens (into a model's padded vocabulary slots)",
                       description="Give a tokenizer new special tokens at the ids after its last one. With "
                       "--model the model's visible vocabulary grows to match: into the padded rows of its "
                       "embedding and LM head when there are enough (no tensor changes shape), else by an "
                       "explicit resize; new rows start as the mean embedding (--init). Old ids keep their "
                       "rows, so the model's logits on old ids are unchanged.")
    cli.add_examples(p, "tokenizer add-special runs/demo --out runs/demo-chat",
                     "tokenizer add-special --tokenizer tok.json --tokens '<|tool|>' --out tok-chat.json")
    p.add_argument("model", metavar="MODEL", nargs="?", help="the model whose tokenizer is extended (a run, "
                   "checkpoint or model directory, or a Hugging Face directory or hub id); or give --tokenizer")
    p.add_argument("--tokenizer", help="tokenizer file, when there is no MODEL")
    p.add_argument("--tokens", nargs="+", action="extend", default=None, metavar="TOKEN",
                   help="special tokens to add; repeated flags add up (default: ChatML's <|im_start|> <|im_end|>)")
    p.add_argument("--chat-template", help="'chatml', a .jinja file, or a Hugging Face tokenizer_config.json "
                   "whose chat_template the tokenizer keeps (default: keep the tokenizer's; none means ChatML)")
    p.add_argument("--init", choices=["mean", "keep"], default="mean",
                   help="new rows: the mean of the old rows, or keep what padded slots hold (default: mean)")
    p.add_argument("--out", required=True, help="output: a model directory with --model, else a tokenizer file")
    p.set_defaults(func=cmd_add_special)


def _read_template(spec: str | None):
    from logitlab.tokenizer.chat import CHATML_TEMPLATE, read_hf_chat_template

    if spec is None or spec == CHATML:
        return CHATML_TEMPLATE if spec else None
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"chat template file not found: {path}")
    if path.suffix == ".json":
        template = read_hf_chat_template(path)
        if template is None:
            raise ValueError(f"{path} has no chat_template")
        return template
    return path.read_text(encoding="utf-8")


def cmd_add_special(args) -> int:
    from logitlab.io.files import atomic_directory
    from logitlab.io.model_dir import MODEL_KIND, TOKENIZER_FILE, write_model_files
    from logitlab.tokenizer.core import Tokenizer
    from logitlab.tokenizer.special import add_special_tokens
    from logitlab.train.vocab import fit_vocab

    if bool(args.model) == bool(args.tokenizer):
        raise ValueError("give exactly one of MODEL (a model and its tokenizer) or --tokenizer (a file)")
    model = None
    if args.model:
        from logitlab.io.loading import load_model_and_tokenizer

        loaded = load_model_and_tokenizer(args.model)
        model, tok = loaded.model, loaded.tokenizer
    else:
        tok = Tokenizer.load(args.tokenizer)
    new, added = add_special_tokens(tok, args.tokens or ["<|im_start|>", "<|im_end|>"])
    if args.chat_template is not None:
        new.chat_template = _read_template(args.chat_template)
    con = cli.console()
    if model is None:
        new.save(args.out)
        con.print(f"added {_listed(added)}; tokenizer written to {args.out}")
        return 0
    report = fit_vocab(model, new, args.init)
    with atomic_directory(args.out, MODEL_KIND, source=args.model) as tmp:
        write_model_files(model, tmp)
        new.save(Path(tmp) / TOKENIZER_FILE)
    tables = "the embedding, value embeddings and LM head" if model.value_embeds else "the embedding and LM head"
    how = (f"resized {tables} to " if report["resized"] else "used padded rows; tables stay at ")
    con.print(f"added {_listed(added)}; vocab {report['old_vocab_size']} -> {report['vocab_size']} "
              f"({how}{report['padded_vocab_size']} rows, new rows: {report['init']}); model written to {args.out}")
    return 0


def _listed(added: dict) -> str:
    return ", ".join(f"{s} = {i}" for s, i in added.items()) or "nothing (all were special tokens already)"


# --------------------------------------------------------------------------------------------
# sft
# --------------------------------------------------------------------------------------------

def register(subparsers) -> None:
    """Add `sft` and `embedding-diff` to `subparsers`."""
    from logitlab.cli.models import add_model_argument
    from logitlab.train.config import SFTConfig, TrainConfig

    p = subparsers.add_parser("sft", help="supervised fine-tuning on conversations (optionally LoRA)",
                              description="Fine-tune a model on a .jsonl of {\"messages\": [...]} or "
                              "{\"prompt\", \"completion\"} lines, with the loss on the assistant's tokens, "
                              "packed rows whose attention stays inside each conversation, a validation loss "
                              "on held-out conversations and sample replies at each evaluation.")
    add_model_argument(p, dtype=False)
    cli.add_examples(p, "sft runs/demo --data chats.jsonl --out runs/sft --steps 150",
                     "sft Qwen/Qwen3-0.6B --data chats.jsonl --out runs/lora --lora-targets q_proj,v_proj",
                     "sft runs/demo --data chats.jsonl --out runs/sft --resume")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--samples", type=int, default=2, help="held-out prompts answered at each evaluation (default: 2)")
    p.add_argument("--lora-targets", help="LoRA on these projections (q_proj,v_proj,... or all-linear; an "
                   "MoE's experts: experts.gate_up_proj,experts.down_proj); "
                   "default: full fine-tuning")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default: 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (default: 16)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout (default: 0)")
    p.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(r) (rsLoRA)")
    p.add_argument("--lora-tie", choices=["untie", "shared", "refuse"], default="untie",
                   help="a LoRA on the LM head of a tied model: untie first, adapt the shared matrix on both "
                   "sides, or refuse (default: untie)")
    p.add_argument("--train-special-rows", action="store_true",
                   help="with LoRA, also train the embedding (and head) rows of the special tokens, which new "
                   "tokens need (as PEFT's trainable_token_indices)")
    p.add_argument("--export-hf", metavar="DIR", help="at the end, write a Hugging Face model (and with LoRA "
                   "a PEFT adapter directory DIR-adapter beside the base model)")
    cli.add_config_flags(p, SFTConfig)
    # the SFT loop runs one eager process: the pretraining loop's compile, parallel and CPU-route flags do not apply
    cli.add_config_flags(p, TrainConfig, skip=("data_dir", "compile", "parallel", "keep_freed_memory", "bf16_matmul",
                                                "virtual_stages", "dist_timeout"),
                         shown_defaults={"lr": "a tenth of pretraining's default for the model's size; "
                                         "with LoRA, pretraining's default"}, renamed={"out_dir": "--out"})
    p.set_defaults(func=cmd_sft)

    g = subparsers.add_parser("sft-data", help="write a small instruction set from the standard library",
                              description="Write a .jsonl of conversations made from the running Python's "
                              "standard library: 'What does json.dumps do?' answered with the first line of its "
                              "docstring (no download; the same set on every run of one Python version).")
    cli.add_examples(g, "sft-data --out chats.jsonl --limit 2000")
    g.add_argument("--out", required=True, help=".jsonl file to write")
    g.add_argument("--limit", type=int, default=None, help="at most this many conversations (default: all)")
    g.set_defaults(func=cmd_sft_data)

    d = subparsers.add_parser("embedding-diff", help="per-token change of the embedding between two models",
                              description="Compare the embedding rows (and untied LM-head rows) of BASE and "
                              "TUNED: the tokens that moved most, special tokens first, and the share of the "
                              "change the special tokens carry.")
    cli.add_examples(d, "embedding-diff runs/demo runs/sft --data chats.jsonl --top 20")
    d.add_argument("base", metavar="BASE", help="the base MODEL (a run, checkpoint, logitlab or Hugging Face "
                   "directory, or a hub id)")
    d.add_argument("tuned", metavar="TUNED", help="the fine-tuned MODEL")
    d.add_argument("--data", help="SFT .jsonl: counts each token's frequency, shown beside its change")
    d.add_argument("--top", type=int, default=15, help="rows listed per table (default: 15)")
    d.add_argument("--by", choices=["l2", "relative", "angle"], default="l2",
                   help="rank rows by their L2 change, the change over the old row's norm, or 1 - cosine "
                   "(default: l2)")
    d.add_argument("--min-count", type=int, default=1,
                   help="with --data, list only ordinary tokens it uses at least this often (default: 1)")
    d.add_argument("--plot", metavar="PNG", help="scatter of change against frequency in --data")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    d.set_defaults(func=cmd_embedding_diff)


def cmd_sft_data(args) -> int:
    from logitlab.data.sft import stdlib_conversations, write_conversations

    conversations = stdlib_conversations(limit=args.limit)
    write_conversations(conversations, args.out)
    cli.console().print(f"{len(conversations)} conversations written to {args.out}")
    return 0


def _sampler(tokenizer, val_path, train_cfg, sft_cfg, n: int):
    """on_eval(model, step) -> greedy replies to the first n held-out prompts."""
    from logitlab.data.sft import read_conversations
    from logitlab.generate.config import SampleConfig
    from logitlab.generate.loop import generate
    from logitlab.tokenizer.chat import end_of_turn_id
    from logitlab.train.sft import split_conversations

    if n <= 0:
        return None
    if val_path:
        held = read_conversations(val_path)
    else:
        held = split_conversations(read_conversations(sft_cfg.data), sft_cfg.val_fraction, train_cfg.seed)[1]
    prompts = []
    for messages in held[:n]:
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        prompts.append(tokenizer.apply_chat_template(messages[:last], add_generation_prompt=True))
    config = SampleConfig(max_new_tokens=48, temperature=0.0)

    def on_eval(model, step):
        model.eval()
        out = generate(model, prompts, config, eot_id=end_of_turn_id(tokenizer))
        model.train()
        return [tokenizer.decode(ids) for ids in out.tokens]
    return on_eval


def _report(con):
    def callback(event: str, record: dict) -> None:
        if event == "start":
            con.print(f"sft: {record['train_rows']} train rows ({record['train_trained_tokens']} trained tokens), "
                      f"{record['val_rows']} validation rows; {record['truncated']} cut, {record['dropped']} dropped")
        elif event == "eval":
            con.print(f"step {record['step']}: val loss {record['val_loss']:.4f}")
            for text in record.get("samples") or []:
                con.print(f"  sample: {text!r}", soft_wrap=True)
        elif event == "step" and "val_loss" not in record:
            con.print(f"step {record['step']}: loss {record['loss']:.4f}", style="dim")
    return callback


def cmd_sft(args) -> int:
    from logitlab.cli.models import load
    from logitlab.train.config import TrainConfig
    from logitlab.train.lora import LoRAConfig, apply_lora, train_token_rows
    from logitlab.train.sft import SFTConfig, run_sft

    sft_cfg = cli.build_config(SFTConfig, args)
    train_cfg = cli.build_config(TrainConfig, args)
    base = load(args)
    model, tok = base.model.train(), base.tokenizer
    lora = None
    if args.lora_targets:
        lora = LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                          targets=args.lora_targets, rslora=args.rslora, tie=args.lora_tie)
        apply_lora(model, lora, seed=train_cfg.seed)
        if args.train_special_rows:
            train_token_rows(model, sorted(tok.special_tokens.values()))
    elif args.train_special_rows:
        raise ValueError("--train-special-rows is for LoRA runs (--lora-targets); full fine-tuning trains every row")
    con = cli.console()
    result = run_sft(model, tok, train_cfg, sft_cfg, resume=args.resume, callback=_report(con),
                     on_eval=_sampler(tok, sft_cfg.val_data, train_cfg, sft_cfg, args.samples),
                     base=base.pinned)
    con.print(f"done: {result.step} steps; checkpoint {result.checkpoint}")
    if args.export_hf:
        _export(model, tok, lora, Path(args.export_hf), con)
    return 0


def _export(model, tok, lora, out: Path, con) -> None:
    from logitlab.io.hf import save_pretrained
    from logitlab.tokenizer.chat import write_hf_tokenizer_config
    from logitlab.train.lora import base_model
    from logitlab.train.lora_peft import save_peft_adapter

    plain = base_model(model) if lora is not None else model
    save_pretrained(plain, out, tok)
    write_hf_tokenizer_config(tok, out, model.config.context_length)   # adds the chat template
    con.print(f"Hugging Face model written to {out}")
    if lora is not None:
        adapter = out.with_name(out.name + "-adapter")
        save_peft_adapter(model, adapter, base_model_name_or_path=str(out))
        con.print(f"PEFT adapter written to {adapter} (tied embeddings: {model.config.tie_embeddings})")


# --------------------------------------------------------------------------------------------
# embedding-diff
# --------------------------------------------------------------------------------------------

def cmd_embedding_diff(args) -> int:
    from logitlab.data.sft import read_conversations
    from logitlab.inspect.embed_diff import embedding_diff, token_counts
    from logitlab.io.loading import load_model_and_tokenizer

    base = load_model_and_tokenizer(args.base).model
    tuned, tok = (loaded := load_model_and_tokenizer(args.tuned)).model, loaded.tokenizer
    counts = None
    if args.data:
        ids = (tok.apply_chat_template(m) for m in read_conversations(args.data))
        counts = token_counts(ids, tuned.config.vocab_size)
    out = embedding_diff(base, tuned, tok, counts, top=args.top, by=args.by, min_count=args.min_count)
    if args.plot:
        _plot(out, counts, args.plot)
    if args.json:
        keep = {k: v for k, v in out.items() if k not in ("l2", "cos", "head")}
        if out["head"] is not None:
            keep["head"] = {k: v for k, v in out["head"].items() if k not in ("l2", "cos")}
        print(json.dumps(keep, indent=1))
        return 0
    con = cli.console()
    for title, table in (("embedding", out), ("LM head", out["head"])):
        if table is None:
            continue
        con.print(f"{title}: special tokens carry {100 * table['special_share']:.1f}% of the total row change "
                  f"({table['total_l2']:.3f})")
        for kind in ("top_special", "top_ordinary"):
            rows = [[str(r["id"]), json.dumps(r.get("token", "")), f"{r['l2']:.4f}", _num(r["relative"]),
                     _num(r["cos"]), "-" if r["count"] is None else str(r["count"])] for r in table[kind]]
            cli.print_table(con, f"{title}: {kind.replace('top_', '')} tokens that moved most (by {args.by})",
                            ["id", "token", "L2", "L2/|old|", "cos", "count"], rows, right=(0, 2, 3, 4, 5))
    return 0


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _plot(out: dict, counts, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from logitlab.io.files import atomic_write_bytes

    fig, ax = plt.subplots(figsize=(6, 4))
    l2 = out["l2"].numpy()
    x = (counts[:len(l2)].numpy() + 1) if counts is not None else range(len(l2))
    special = out["special_ids"]
    ax.scatter(x, l2, s=4, label="ordinary")
    ax.scatter([x[i] for i in special if i < len(l2)], [l2[i] for i in special if i < len(l2)], s=24, c="red",
               label="special")
    ax.set_xscale("log" if counts is not None else "linear")
    ax.set_xlabel("1 + count in the SFT data" if counts is not None else "token id")
    ax.set_ylabel("L2 change of the embedding row")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
