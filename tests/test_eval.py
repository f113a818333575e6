"""Evaluation: scoring against the one-pair-at-a-time reference, rolling windows as lm-evaluation-
harness defines them, bits per byte against a hand computation, the standard-library multiple
choice, and the `eval` CLI. Tiny random models, a hand-made tokenizer, no downloads."""

from __future__ import annotations

import json
import math

import pytest
import torch

from logitlab.eval import (
    bits_per_byte,
    encode_pair,
    evaluate_bpb,
    loglikelihood_rolling,
    nats_and_bytes,
    rolling_windows,
    score,
    score_ids,
    token_byte_lengths,
)
from logitlab.eval.scoring import score_ids_reference
from logitlab.eval.stdlib_mc import MCTask, evaluate_mc, stdlib_next_line_tasks
from logitlab.model import ModelConfig, Transformer
from logitlab.tokenizer.core import Tokenizer

EOT = "<|endoftext|>"


def tiny_tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"t", b"h"), (b"th", b"e"), (b" ", b"the"), (b"e", b"r"), (b" ", b"a")]
    for k, (a, b) in enumerate(merges):
        vocab[256 + k] = a + b
    return Tokenizer(vocab, merges, special_tokens={EOT: 256 + len(merges)})


def tiny_model(tok: Tokenizer, context: int = 16, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=context, d_model=32, n_layers=2, n_heads=4,
                      norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok)


def _manual_logprob(model, ids: list[int], first: int) -> float:
    """Sum of log p(ids[t] | ids[:t]) for t >= first, from one full forward (no window)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
    return sum(float(lp[t - 1, ids[t]]) for t in range(first, len(ids)))


# -------------------- scoring

def test_batched_scores_equal_the_reference_with_padding_and_truncation(model):
    g = torch.Generator().manual_seed(3)
    lengths = [(1, 1), (3, 5), (20, 4), (9, 16), (2, 7), (30, 1), (5, 3)]  # some contexts pass the window of 16
    pairs = [(torch.randint(0, 250, (c,), generator=g).tolist(), torch.randint(0, 250, (k,), generator=g).tolist())
             for c, k in lengths]
    ref = score_ids_reference(model, pairs)
    for bs in (1, 3, 16):
        got = score_ids(model, pairs, batch_size=bs)
        for a, b in zip(got, ref):
            assert a.greedy == b.greedy and a.n_tokens == b.n_tokens
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-6)


def test_score_matches_a_full_forward_and_the_greedy_flag(model, tok):
    s = score(model, tok, "the cat", " sat")
    ctx, cont = encode_pair(tok, "the cat", " sat")
    assert s.logprob == pytest.approx(_manual_logprob(model, ctx + cont, len(ctx)), abs=1e-6)
    # the model's own greedy continuation is greedy; a different last token is not
    ids = list(ctx)
    for _ in range(3):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert score_ids(model, [(ctx, ids[len(ctx):])])[0].greedy
    other = ids[len(ctx):-1] + [(ids[-1] + 1) % 250]
    assert not score_ids(model, [(ctx, other)])[0].greedy
    many = score(model, tok, ["the cat", "a"], [" sat", " the"])
    assert isinstance(many, list) and many[0].greedy == s.greedy   # batched with padding: equal up to rounding
    assert many[0].logprob == pytest.approx(s.logprob, abs=1e-5)


def test_encode_pair_moves_trailing_space_and_empty_context_starts_from_eot(tok):
    ctx, cont = encode_pair(tok, "go the ", "ther")
    assert tok.decode(ctx) == "go the" and tok.decode(cont) == " ther"
    ctx, cont = encode_pair(tok, "", "the")
    assert ctx == [tok.eot_id] and tok.decode(cont) == "the"


def test_scoring_errors_name_the_problem(model, tok):
    with pytest.raises(ValueError, match="continuation has no tokens"):
        score_ids(model, [([1], [])])
    with pytest.raises(ValueError, match="context has no tokens"):
        score_ids(model, [([], [1])])
    with pytest.raises(ValueError, match="17 tokens, more than the model's context_length"):
        score_ids(model, [([1], [2] * 17)])
    with pytest.raises(ValueError, match="batch_size"):
        score_ids(model, [([1], [2])], batch_size=0)
    with pytest.raises(ValueError, match="token id 999"):
        score_ids(model, [([999], [2])])
    with pytest.raises(ValueError, match="encodes to no tokens"):
        score(model, tok, "abc", "")
    with pytest.raises(ValueError, match="both be strings"):
        score(model, tok, "abc", ["d"])


def test_nan_logits_are_an_error_not_a_score(tok):
    m = tiny_model(tok)
    with torch.no_grad():
        m.final_norm.weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="NaN"):
        score_ids(m, [([1, 2], [3])])
    with pytest.raises(RuntimeError, match="NaN"):
        bits_per_byte(float("nan"), 3)


# -------------------- rolling windows

def test_rolling_windows_worked_example_and_harness_definition():
    assert rolling_windows(list(range(10)), 99, 4) == [([99], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]),
                                                      ([5, 6, 7], [8, 9])]
    assert rolling_windows([], 99, 4) == []
    utils = pytest.importorskip("lm_eval.utils")
    for n in range(0, 23):
        for window in (1, 2, 5, 8):
            ids = list(range(100, 100 + n))
            theirs = [utils.make_disjoint_window(p) for p in utils.get_rolling_token_windows(ids, 7, window, 1)]
            assert rolling_windows(ids, 7, window) == [(list(a), list(b)) for a, b in theirs]


def test_rolling_windows_predict_every_token_once_with_a_full_window():
    ids = list(range(37))
    pairs = rolling_windows(ids, 99, 8)
    assert [t for _, cont in pairs for t in cont] == ids
    for ctx, cont in pairs[1:]:
        assert len(ctx) + len(cont) - 1 == 8  # every later input fills the window


def test_loglikelihood_rolling_short_document_is_the_plain_score(model, tok):
    text = "the other"
    ids = tok.encode(text)
    assert loglikelihood_rolling(model, tok, text) == pytest.approx(
        _manual_logprob(model, [tok.eot_id] + ids, 1), abs=1e-6)
    long = "the rather other theme " * 4
    assert len(tok.encode(long)) > 16
    total = loglikelihood_rolling(model, tok, long)
    windows = rolling_windows(tok.encode(long), tok.eot_id, 16)
    assert total == pytest.approx(sum(s.logprob for s in score_ids_reference(model, windows)), abs=1e-6)
    assert loglikelihood_rolling(model, tok, [text, long]) == pytest.approx([loglikelihood_rolling(model, tok, text),
                                                                              total])


# -------------------- bits per byte

def test_byte_lengths_mask_special_tokens(tok):
    lengths = token_byte_lengths(tok, vocab_size=tok.vocab_size + 3)
    assert lengths.shape == (tok.vocab_size + 3,)
    assert lengths[ord("a")] == 1 and lengths[tok.token_to_id(" the")] == 4
    assert lengths[tok.eot_id] == 0 and lengths[-1] == 0
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        token_byte_lengths(tok, vocab_size=10)


def test_nats_and_bytes_by_hand(tok):
    lengths = token_byte_lengths(tok)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, tok.vocab_size, generator=g)
    the = tok.token_to_id(" the")
    targets = torch.tensor([[ord("a"), the, tok.eot_id], [-100, ord("b"), the]])
    nats, nbytes = nats_and_bytes(logits, targets, lengths)
    lp = torch.log_softmax(logits.double(), -1)
    want = -(lp[0, 0, ord("a")] + lp[0, 1, the] + lp[1, 1, ord("b")] + lp[1, 2, the])
    assert int(nbytes) == 1 + 4 + 1 + 4
    assert float(nats) == pytest.approx(float(want), rel=1e-5)
    assert bits_per_byte(nats, nbytes) == pytest.approx(float(want) / (math.log(2) * 10), rel=1e-5)
    with pytest.raises(ValueError, match="targets must have shape"):
        nats_and_bytes(logits, targets[:, :2], lengths)
    with pytest.raises(ValueError, match="0 bytes"):
        bits_per_byte(1.0, 0)


def test_evaluate_bpb_counts_the_text_bytes_and_masks_specials(model, tok):
    docs = ["the other thing", "a rather long theme " * 3]
    r = evaluate_bpb(model, tok, docs, batch_size=2)
    assert r.documents == 2 and r.bytes == sum(len(d.encode()) for d in docs)
    want = -sum(loglikelihood_rolling(model, tok, docs))
    assert r.nats == pytest.approx(want, abs=1e-5)
    assert r.bits_per_byte == pytest.approx(want / (math.log(2) * r.bytes))
    joined = evaluate_bpb(model, tok, [docs[0] + EOT + docs[1]])
    assert joined.bytes == r.bytes  # the separator's 13 characters are not text
    with pytest.raises(ValueError, match="no bytes"):
        evaluate_bpb(model, tok, ["", EOT])


def test_bpb_is_the_same_text_measure_under_another_tokenizer(model):
    """Same bytes, same nats for a model whose tokenizer has no merges: bytes are counted from the text."""
    plain = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens={EOT: 256})
    m = tiny_model(plain)
    text = "the rather other"
    r = evaluate_bpb(m, plain, [text])
    assert r.bytes == len(text.encode()) == r.tokens


# -------------------- multiple choice

def test_stdlib_tasks_are_deterministic_and_well_formed():
    a = stdlib_next_line_tasks(12, seed=1)
    assert a == stdlib_next_line_tasks(12, seed=1) and a != stdlib_next_line_tasks(12, seed=2)
    for t in a:
        assert len(t.choices) == 4 and len(set(t.choices)) == 4 and 0 <= t.answer < 4
        assert t.context.endswith("\n") and all(c.endswith("\n") for c in t.choices)
        indents = {len(c) - len(c.lstrip()) for c in t.choices}
        assert len(indents) == 1  # indentation gives nothing away
    with pytest.raises(ValueError, match="n \\(how many questions\\)"):
        stdlib_next_line_tasks(0)


def test_evaluate_mc_centres_accuracy_and_picks_the_likeliest(model, tok):
    tasks = [MCTask("the", (" other\n", " the\n", " a\n", " rather\n"), 1),
             MCTask("a", (" b\n", " c\n", " d\n", " e\n"), 0)]
    r = evaluate_mc(model, tok, tasks)
    for task, pick in zip(tasks, r.predictions):
        scores = [score(model, tok, task.context, c).logprob for c in task.choices]
        assert pick == max(range(4), key=scores.__getitem__)
    acc = sum(p == t.answer for p, t in zip(r.predictions, tasks)) / 2
    assert r.accuracy == acc and r.centred_accuracy == pytest.approx((acc - 0.25) / 0.75)
    with pytest.raises(ValueError, match="same number"):
        evaluate_mc(model, tok, [tasks[0], MCTask("x", (" a\n", " b\n"), 0)])


# -------------------- CLI

def _model_dir(tmp_path, tok, model):
    from logitlab.io import checkpoint

    d = tmp_path / "model"
    checkpoint.save_model(model, d)
    tok.save(d / checkpoint.TOKENIZER_FILE)
    return d


def test_cli_eval_bpb_json_equals_the_library(tmp_path, capsys, model, tok):
    from logitlab.cli.main import main

    d = _model_dir(tmp_path, tok, model)
    (tmp_path / "a.txt").write_text("the other thing")
    (tmp_path / "b.txt").write_text("a rather long theme " * 3)
    assert main(["eval", "bpb", str(d), "--data", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = evaluate_bpb(model, tok, ["the other thing", "a rather long theme " * 3])
    assert out["bytes"] == want.bytes and out["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-6)
    assert main(["eval", "bpb", str(d), "--data", str(tmp_path / "a.txt")]) == 0
    assert "bits per byte" in capsys.readouterr().out
    assert main(["eval", "bpb", str(d), "--data", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    assert main(["eval", "bpb", str(d), "--data", str(tmp_path / "bad.txt")]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_cli_eval_bpb_on_a_hugging_face_export_equals_the_native_dir(tmp_path, capsys, model, tok):
    pytest.importorskip("transformers")
    from logitlab.cli.main import main
    from logitlab.io import hf

    native = _model_dir(tmp_path, tok, model)
    exported = hf.save_pretrained(model, tmp_path / "hf", tok)
    (tmp_path / "a.txt").write_text("the other thing, rather")
    results = []
    for d in (native, exported):
        assert main(["eval", "bpb", str(d), "--data", str(tmp_path / "a.txt"), "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["bytes"] == results[1]["bytes"]
    assert results[0]["bits_per_byte"] == pytest.approx(results[1]["bits_per_byte"], rel=1e-5)


def test_cli_eval_mc_json(tmp_path, capsys, model, tok):
    from logitlab.cli.main import main

    d = _model_dir(tmp_path, tok, tiny_model(tok, context=256))
    assert main(["eval", "mc", str(d), "--examples", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = evaluate_mc(tiny_model(tok, context=256), tok, stdlib_next_line_tasks(4, seed=0))
    assert out["examples"] == 4 and out["choices"] == 4
    assert out["accuracy"] == want.accuracy and out["centred_accuracy"] == pytest.approx(want.centred_accuracy)
