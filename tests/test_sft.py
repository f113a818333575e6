"""SFT: the loss mask (all / assistant / last), packing with attention kept inside each
conversation (equal to running each conversation alone), the loop's checkpoints and an exact
resume, and a validation loss that falls."""

from __future__ import annotations

import json

import pytest
import torch

from logitlab.data import sft as sft_data
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer
from logitlab.tokenizer.bpe import train_tokenizer
from logitlab.tokenizer.special import add_special_tokens
from logitlab.train.config import TrainConfig
from logitlab.train.sft import SFTConfig, document_mask, forward_packed, run_sft

WORDS = ["len", "abs", "max", "min", "sum", "sorted", "repr", "hash", "iter", "next"]
ANSWERS = {"len": "Return the number of items.", "abs": "Return the absolute value.",
           "max": "Return the largest item.", "min": "Return the smallest item.",
           "sum": "Return the sum of the items.", "sorted": "Return a new sorted list.",
           "repr": "Return the canonical string.", "hash": "Return the hash value.",
           "iter": "Return an iterator.", "next": "Return the next item."}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "a.txt"
    path.write_text(" ".join(f"What does {w} do? {a}" for w, a in ANSWERS.items()) * 10)
    base = train_tokenizer(path, 300, ["<|endoftext|>"], workers=1)
    return add_special_tokens(base, ["<|im_start|>", "<|im_end|>"])[0]


def tiny_model(tok, positions="rope"):
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=128, d_model=32, n_layers=2, n_heads=2,
                      vocab_pad_multiple=64, positions=positions, norm="rmsnorm", mlp="swiglu", bias=False)
    return Transformer(cfg)


def chat(w):
    return [{"role": "user", "content": f"What does {w} do?"}, {"role": "assistant", "content": ANSWERS[w]}]


def test_loss_mask_modes(tok):
    messages = chat("len") + [{"role": "user", "content": "And abs?"}, {"role": "assistant", "content": "Absolute."}]
    turns = tok.chat_turns(messages)
    ids, on = sft_data.mask_turns(turns, "assistant")
    trained = tok.decode([i for i, t in zip(ids, on) if t])
    assert trained == "Return the number of items.<|im_end|>\nAbsolute.<|im_end|>\n"
    ids, on = sft_data.mask_turns(turns, "last")
    assert tok.decode([i for i, t in zip(ids, on) if t]) == "Absolute.<|im_end|>\n"
    assert all(sft_data.mask_turns(turns, "all")[1])
    x, y = sft_data.encode_conversation(tok, messages)
    assert len(x) == len(y) == len(ids) - 1
    assert tok.decode([t for t in y if t != sft_data.IGNORE_INDEX]).endswith("Absolute.<|im_end|>\n")
    with pytest.raises(ValueError, match="train_on"):
        sft_data.mask_turns(turns, "user")


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_packed_rows_equal_each_conversation_alone(tok, positions):
    model = tiny_model(tok, positions).eval()
    examples = [sft_data.encode_conversation(tok, chat(w)) for w in ("len", "sorted", "abs")]
    rows = sft_data.build_rows(examples, seq_len=128, pack=True)
    assert len(rows) == 1 and rows.segments[0].max() == 2
    inputs = sft_data.PackedInputs(rows.ids, rows.segments, rows.positions)
    with torch.no_grad():
        packed = forward_packed(model, inputs)
        at = 0
        for x, _ in examples:
            alone = model(torch.tensor([x]))
            torch.testing.assert_close(packed[0, at:at + len(x)], alone[0], atol=1e-5, rtol=1e-5)
            at += len(x)
    padded = sft_data.build_rows(examples, seq_len=128, pack=False)
    assert len(padded) == 3 and padded.trained_tokens == rows.trained_tokens


def test_document_mask_keeps_conversations_apart():
    mask = document_mask(torch.tensor([[0, 0, 1, 1, -1]]))[0, 0]
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 1]]


def test_rows_truncate_and_drop(tok):
    long = sft_data.encode_conversation(tok, chat("sorted"))
    prompt_only = sft_data.encode_conversation(tok, [{"role": "user", "content": "hi"}])
    first_trained = next(t for t, y in enumerate(long[1]) if y != sft_data.IGNORE_INDEX)
    rows = sft_data.build_rows([long, prompt_only], seq_len=first_trained + 3)
    assert rows.truncated == 1 and rows.dropped == 1 and len(rows) == 1 and rows.trained_tokens == 3


def test_reading_conversations_names_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:3: needs a 'messages' list"):
        sft_data.read_conversations(path)
    path.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: message 0 needs string"):
        sft_data.read_conversations(path)
    path.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": " ", "content": "b"}]}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: message 1 has an empty 'role'"):
        sft_data.read_conversations(path)
    good = json.dumps({"prompt": "a", "completion": "b"}).encode()
    path.write_bytes(good + b"\n" + good.replace(b'"a"', b'"a\xff"') + b"\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: not UTF-8 \(byte 0xff at column 14\)"):
        sft_data.read_conversations(path)


def write_data(path, n=40):
    with open(path, "w") as f:
        for k in range(n):
            f.write(json.dumps({"messages": chat(WORDS[k % len(WORDS)])}) + "\n")
    return path


def train_cfg(tmp_path, steps, **kw):
    return TrainConfig(out_dir=str(tmp_path), steps=steps, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=2,
                       eval_every=4, device="cpu", precision="fp32", tensorboard=False, seed=3, **kw)


def test_sft_run_learns_and_resumes_exactly(tok, tmp_path):
    data = write_data(tmp_path / "chats.jsonl")
    sft = SFTConfig(data=str(data), val_fraction=0.2)
    torch.manual_seed(0)
    base = tiny_model(tok).state_dict()
    model = tiny_model(tok)
    model.load_state_dict(base)
    events = []
    result = run_sft(model, tok, train_cfg(tmp_path / "a", 8), sft, callback=lambda e, r: events.append((e, r)),
                     on_eval=lambda m, step: [f"step {step}"])
    evals = [r for e, r in events if e == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert evals[-1]["samples"] == ["step 8"]
    assert result.step == 8 and result.checkpoint is not None
    # stopped by the time limit after one step, then resumed to 8: the same weights bit for bit
    again = tiny_model(tok)
    again.load_state_dict(base)
    run_sft(again, tok, train_cfg(tmp_path / "b", 8, save_every=4, time_limit_s=1e-9), sft)
    resumed = tiny_model(tok)
    run_sft(resumed, tok, train_cfg(tmp_path / "b", 8), sft, resume=True)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0)


def test_lora_sft_checkpoints_merge_and_resume_exactly(tok, tmp_path):
    from logitlab.io.checkpoint import load_for_inference
    from logitlab.train.lora import LoRAConfig, apply_lora, lora_state_dict

    data = write_data(tmp_path / "chats.jsonl", n=20)
    sft = SFTConfig(data=str(data), val_fraction=0.2, pack=False)
    base = tiny_model(tok).state_dict()
    lora = LoRAConfig(r=2, targets="all-linear")

    def fresh():
        m = tiny_model(tok)
        m.load_state_dict(base)
        apply_lora(m, lora, seed=1)                             # the same A initialisation each time
        return m
    whole = fresh()
    result = run_sft(whole, tok, train_cfg(tmp_path / "a", 5), sft)
    merged, _ = load_for_inference(result.checkpoint)            # a plain model: the adapters merged in
    ids = torch.tensor([tok.encode("What does len do?")])
    whole.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), whole(ids), atol=1e-5, rtol=1e-5)
    run_sft(fresh(), tok, train_cfg(tmp_path / "b", 5, time_limit_s=1e-9), sft)
    resumed = fresh()
    run_sft(resumed, tok, train_cfg(tmp_path / "b", 5), sft, resume=True)
    for key, value in lora_state_dict(whole).items():
        torch.testing.assert_close(lora_state_dict(resumed)[key], value, rtol=0, atol=0)
    assert any(v.abs().max() > 0 for k, v in lora_state_dict(whole).items() if ".lora_B." in k)


def test_stdlib_instruction_set_is_deterministic_and_readable(tmp_path):
    from logitlab.cli.main import main

    convs = sft_data.stdlib_conversations(limit=50)
    assert len(convs) == 50 and convs == sft_data.stdlib_conversations(limit=50)
    assert all(c[0]["content"].startswith("What does ") and c[1]["content"] for c in convs)
    assert main(["sft-data", "--out", str(tmp_path / "c.jsonl"), "--limit", "7"]) == 0
    assert len(sft_data.read_conversations(tmp_path / "c.jsonl")) == 7


def test_a_lora_checkpoint_exports_base_and_peft_adapter(tok, tmp_path):
    pytest.importorskip("peft")
    import peft
    import transformers

    from logitlab.io.model_dir import TOKENIZER_FILE, save_model
    from logitlab.train.lora import LoRAConfig, apply_lora
    from logitlab.train.lora_peft import export_lora_checkpoint

    save_model(tiny_model(tok), tmp_path / "base")
    tok.save(tmp_path / "base" / TOKENIZER_FILE)
    from logitlab.io.checkpoint import load_for_inference

    model, _ = load_for_inference(tmp_path / "base")
    apply_lora(model, LoRAConfig(r=2, targets="q_proj,v_proj"), seed=0)
    data = write_data(tmp_path / "chats.jsonl", n=12)
    result = run_sft(model, tok, train_cfg(tmp_path / "run", 2), SFTConfig(data=str(data)),
                     base=str(tmp_path / "base"))
    hf_dir, adapter = export_lora_checkpoint(result.checkpoint, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    ids = torch.tensor([tok.encode("What does len do?")])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits[..., :tok.vocab_size], model(ids), atol=1e-4, rtol=1e-4)
