"""lm-evaluation-harness: the `logitlab` model type on local YAML tasks over jsonl files this test
writes (multiple choice, rolling log-likelihood, generation), equal to the harness's own `hf` type
on the Hugging Face export of the same tiny random model. No downloads."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

from lm_eval.api.instance import Instance  # noqa: E402

from logitlab.eval.harness import LogitlabLM  # noqa: E402
from logitlab.eval.scoring import encode_pair, rolling_windows, score_ids  # noqa: E402
from logitlab.model import ModelConfig, Transformer  # noqa: E402
from logitlab.tokenizer.core import Tokenizer  # noqa: E402

EOT = "<|endoftext|>"
QUESTIONS = [
    ("the cat sat on the", [" mat", " other", " theme", " rather"], 0),
    ("a rather", [" thin", " the", " answer", " there"], 1),
    ("there is the", [" end", " start", " other", " a"], 2),
    ("the other", [" one", " theme", " rather", " them"], 3),
    ("a", [" b", " the", " ab", " ba"], 0),
]
DOCS = ["the other theme there " * 6, "a rather short one", "the the the " * 9]


def _tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"t", b"h"), (b"th", b"e"), (b" ", b"the"), (b"e", b"r"), (b" ", b"a")]
    for k, (a, b) in enumerate(merges):
        vocab[256 + k] = a + b
    return Tokenizer(vocab, merges, special_tokens={EOT: 256 + len(merges)})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from logitlab.io import checkpoint, hf

    root = tmp_path_factory.mktemp("harness")
    tok = _tokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=24, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
    model = Transformer(cfg).eval()
    native = root / "native"
    checkpoint.save_model(model, native)
    tok.save(native / checkpoint.TOKENIZER_FILE)
    exported = hf.save_pretrained(model, root / "hf", tok)
    with (root / "mc.jsonl").open("w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps(dict(question=q, choices=choices, answer=answer)) + "\n")
    with (root / "docs.jsonl").open("w") as f:
        for d in DOCS:
            f.write(json.dumps(dict(text=d)) + "\n")
    common = """
        dataset_path: json
        test_split: train
    """
    tasks = {
        "ll_tiny_mc": f"""
            output_type: multiple_choice
            dataset_kwargs: {{data_files: {{train: {root / 'mc.jsonl'}}}, cache_dir: {root / 'cache'}}}
            doc_to_text: "{{{{question}}}}"
            doc_to_choice: "{{{{choices}}}}"
            doc_to_target: "{{{{answer}}}}"
            metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
        """,
        "ll_tiny_rolling": f"""
            output_type: loglikelihood_rolling
            dataset_kwargs: {{data_files: {{train: {root / 'docs.jsonl'}}}, cache_dir: {root / 'cache'}}}
            doc_to_text: ""
            doc_to_target: "{{{{text}}}}"
            metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
        """,
        "ll_tiny_gen": f"""
            output_type: generate_until
            dataset_kwargs: {{data_files: {{train: {root / 'mc.jsonl'}}}, cache_dir: {root / 'cache'}}}
            doc_to_text: "{{{{question}}}}"
            doc_to_target: "{{{{choices[0]}}}}"
            generation_kwargs: {{until: ["\\n", " a"], max_gen_toks: 6, do_sample: false}}
            metric_list: [{{metric: exact_match}}]
        """,
    }
    task_dir = root / "tasks"
    task_dir.mkdir()
    for name, body in tasks.items():
        (task_dir / f"{name}.yaml").write_text(f"task: {name}\n" + textwrap.dedent(common) + textwrap.dedent(body))
    return dict(tok=tok, model=model, native=native, hf=exported, tasks=task_dir)


def _evaluate(setup, model_type: str, model_args: str, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from logitlab.cli.eval import register_harness_model

    register_harness_model()
    return simple_evaluate(model=model_type, model_args=model_args, tasks=tasks, batch_size=4, device="cpu",
                           task_manager=TaskManager(include_path=str(setup["tasks"])), log_samples=True)


def _responses(result: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
def test_logitlab_model_type_equals_the_hf_type_on_local_tasks(setup):
    tasks = ["ll_tiny_mc", "ll_tiny_rolling", "ll_tiny_gen"]
    ours = _evaluate(setup, "logitlab", f"path={setup['native']}", tasks)
    theirs = _evaluate(setup, "hf", f"pretrained={setup['hf']},dtype=float32", tasks)
    for task in tasks:
        for metric, value in theirs["results"][task].items():
            if metric.endswith("stderr,none") or not isinstance(value, float):
                continue
            assert ours["results"][task][metric] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, metric)
    for task in ("ll_tiny_mc", "ll_tiny_rolling"):
        for a, b in zip(_responses(ours, task), _responses(theirs, task)):
            flat_a = [x[0] if isinstance(x, (list, tuple)) else x for x in a]
            flat_b = [x[0] if isinstance(x, (list, tuple)) else x for x in b]
            assert flat_a == pytest.approx(flat_b, abs=1e-4)
    assert _responses(ours, "ll_tiny_gen") == _responses(theirs, "ll_tiny_gen")


def _instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_adapter_answers_each_request_type_through_the_scoring_api(setup):
    tok, model = setup["tok"], setup["model"]
    lm = LogitlabLM(model, tok, batch_size=2)
    pairs = [(q, c) for q, choices, _ in QUESTIONS[:2] for c in choices]
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    want = score_ids(model, [encode_pair(tok, q, c) for q, c in pairs])
    assert [g for _, g in got] == [s.greedy for s in want]
    assert [lp for lp, _ in got] == pytest.approx([s.logprob for s in want], abs=1e-6)
    rolling = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(d,) for d in DOCS]))
    for doc, value in zip(DOCS, rolling):
        windows = rolling_windows(tok.encode(doc), tok.eot_id, 24)
        assert value == pytest.approx(sum(s.logprob for s in score_ids(model, windows)))
    text = lm.generate_until(_instances("generate_until", [("the", {"until": ["zzz"], "max_gen_toks": 4})]))[0]
    from logitlab.generate import SampleConfig, generate

    ids = generate(model, tok.encode("the"), SampleConfig(max_new_tokens=4, temperature=0), eot_id=tok.eot_id).tokens[0]
    assert text == tok.decode([i for i in ids if i != tok.eot_id]).split("zzz")[0]
    with pytest.raises(ValueError, match="max_gen_toks \\(30\\) must be less"):
        lm.generate_until(_instances("generate_until", [("the", {"until": [], "max_gen_toks": 30})]))


def test_registered_type_loads_from_a_path_and_rejects_unknown_args(setup):
    from lm_eval.api.registry import get_model

    from logitlab.cli.eval import register_harness_model

    cls = register_harness_model()
    assert register_harness_model() is cls and get_model("logitlab") is cls
    assert get_model("hf") is not None  # the harness's own types are still there
    lm = cls.create_from_arg_string(f"path={setup['native']},batch_size=3", {"device": "cpu", "batch_size": None})
    assert lm.batch_size == 3 and lm.max_length == 24
    with pytest.raises(ValueError, match="unknown --model_args for logitlab: colour"):
        cls.create_from_arg_string(f"path={setup['native']},colour=red")
    with pytest.raises(ValueError, match="needs --model_args path="):
        cls()


@pytest.mark.slow
def test_cli_runs_the_harness_command_line_with_the_logitlab_type(setup, tmp_path, capsys):
    from logitlab.cli.main import main

    code = main(["eval", "harness", "--model", "logitlab", "--model_args", f"path={setup['native']}",
                 "--tasks", "ll_tiny_mc", "--include_path", str(setup["tasks"]), "--output_path", str(tmp_path)])
    assert code == 0
    written = list(tmp_path.rglob("results_*.json"))
    assert len(written) == 1
    results = json.loads(written[0].read_text())["results"]["ll_tiny_mc"]
    lm = LogitlabLM(setup["model"], setup["tok"])
    picks = []
    for q, choices, answer in QUESTIONS:
        scores = [lp for lp, _ in lm._loglikelihood_tokens([(None, *encode_pair(setup["tok"], q, c)) for c in choices])]
        picks.append(max(range(len(choices)), key=scores.__getitem__) == answer)
    assert results["acc,none"] == pytest.approx(sum(picks) / len(picks))


def test_a_shorter_max_length_narrows_the_window(setup):
    tok, model = setup["tok"], setup["model"]
    lm = LogitlabLM(model, tok, max_length=8)
    doc = DOCS[0]
    got = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(doc,)]))[0]
    windows = rolling_windows(tok.encode(doc), tok.eot_id, 8)
    assert all(len(c) + len(k) - 1 <= 8 for c, k in windows)
    assert got == pytest.approx(sum(s.logprob for s in score_ids(model, windows)))
    assert got != pytest.approx(LogitlabLM(model, tok).loglikelihood_rolling(
        _instances("loglikelihood_rolling", [(doc,)]))[0])
    with pytest.raises(ValueError, match="batch_size must be an integer"):
        LogitlabLM(model, tok, batch_size="many")
