"""The training CLI: prepare, train (TOML + flags, resume, config errors), plot, demo --quick,
generate from the run, export to Hugging Face with identical logits."""

from __future__ import annotations

import json
from pathlib import Path

import _dist
import pytest
import torch

from logitlab import cli
from logitlab.io.checkpoint import latest_checkpoint, load_for_inference
from logitlab.train.config import TrainConfig

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    # the plain recipe: the Llama layout, which the export test below loads in transformers
    out = tmp_path_factory.mktemp("demo") / "run"
    assert cli.main(["demo", "--quick", "--out", str(out), "--progress", "false", "--workers", "1",
                     "--recipe", "none"]) == 0
    return out


def test_demo_quick_writes_a_run_with_plot_and_falling_loss(demo_run):
    summary = json.loads((demo_run / "demo.json").read_text())["result"]
    assert summary["val_loss"] < summary["ln_V"] - 0.5  # clearly below a uniform guess
    assert (demo_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = json.loads((latest_checkpoint(demo_run) / "state.json").read_text())
    assert state["train_config"]["keep_freed_memory"] == "on"   # a timed run: steps as fast as they go
    # running it again replaces the demo directory; a non-demo directory is refused
    assert cli.main(["demo", "--out", str(demo_run.parent)]) == 2


def test_plot_and_generate_from_the_run(demo_run, tmp_path, capsys):
    png = tmp_path / "p.png"
    assert cli.main(["plot", str(demo_run), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert cli.main(["generate", str(demo_run), "def f(", "--max-new-tokens", "8",
                     "--seed", "0", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.strip()


def test_export_loads_in_transformers_with_the_same_logits(demo_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert cli.main(["export", str(demo_run), "--out", str(out)]) == 0
    model, tok = load_for_inference(demo_run)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "import os\nfor name in os.listdir('.'):\n    print(name)  # ünïcode"
    ids = tok.encode_ordinary(text)
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == text
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == tok.eot_id
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, theirs = model(x), hf_model(x).logits
    torch.testing.assert_close(theirs[..., :ours.shape[-1]], ours, rtol=1e-4, atol=1e-4)


def _train_args(tmp_path, *extra):
    return ["train", "--data", str(tmp_path / "code.txt"), "--tokenizer-vocab", "300",
            "--context-length", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
            "--d-ff", "64", "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "2", "--eval-tokens", "256",
            "--val-fraction", "0.2", "--workers", "1", "--progress", "false", "--device", "cpu", *extra]


def test_train_toml_flags_resume_and_errors(tmp_path, capsys):
    (tmp_path / "code.txt").write_text(TEXT)
    (tmp_path / "c.toml").write_text('[train]\nsteps = 4\nlr = 0.01\nseed = 3\n[model]\nnorm = "rmsnorm"\n')
    run = tmp_path / "run"
    # the file's lr, a flag's steps; config errors come before any work
    assert cli.main(_train_args(tmp_path, "--config", str(tmp_path / "c.toml"), "--steps", "0",
                                "--out-dir", str(run))) == 2
    assert "steps must be a positive integer" in capsys.readouterr().err
    assert not run.exists()
    (tmp_path / "bad.toml").write_text("[train]\nstepz = 4\n")
    assert cli.main(_train_args(tmp_path, "--config", str(tmp_path / "bad.toml"), "--out-dir", str(run))) == 2
    assert "stepz" in capsys.readouterr().err
    assert cli.main(_train_args(tmp_path, "--config", str(tmp_path / "c.toml"), "--steps", "3",
                                "--out-dir", str(run))) == 0
    saved = json.loads((run / "run.json").read_text())
    assert saved["train"]["steps"] == 3 and saved["train"]["lr"] == 0.01 and saved["train"]["seed"] == 3
    # the library leaves the process's malloc alone unless asked; the command asks for "auto"
    assert saved["train"]["keep_freed_memory"] == "auto" and TrainConfig().keep_freed_memory == "off"
    assert saved["model"]["norm"] == "rmsnorm" and saved["model"]["d_model"] == 32
    assert saved["model"]["vocab_size"] == saved["data"]["vocab_size"]
    assert latest_checkpoint(run).name == "ckpt-000003"
    assert cli.main(["train", "--resume", str(run), "--steps", "5", "--progress", "false"]) == 0
    assert latest_checkpoint(run).name == "ckpt-000005"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # one document: validation is the tail of its token stream, so there is a step-0 record
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5] and "val_loss" in records[0]
    # a second run into the same directory is refused; prepare + --data-dir reuses the data
    assert cli.main(_train_args(tmp_path, "--out-dir", str(run))) == 2
    data_dir = tmp_path / "prep"
    assert cli.main(["prepare", "--data", str(tmp_path / "code.txt"), "--tokenizer",
                     str(run / "tokenizer.logitlab.json"), "--out", str(data_dir), "--workers", "1"]) == 0
    assert cli.main(_train_args(tmp_path, "--data-dir", str(data_dir), "--steps", "2",
                                "--out-dir", str(tmp_path / "run2"))) == 0
    model, tok = load_for_inference(tmp_path / "run2")
    assert tok is not None and model.config.n_layers == 1


def test_model_config_and_missing_data_errors_come_before_any_work(tmp_path, capsys):
    (tmp_path / "code.txt").write_text(TEXT)
    run = tmp_path / "run"
    assert cli.main(_train_args(tmp_path, "--n-kv-heads", "3", "--out-dir", str(run))) == 2
    assert "n_kv_heads" in capsys.readouterr().err and not run.exists()
    assert cli.main(["train", "--data", str(tmp_path / "absent.txt"), "--out-dir", str(run)]) == 2
    assert "absent.txt" in capsys.readouterr().err and not run.exists()
    assert cli.main(["train", "--resume", str(tmp_path)]) == 2
    assert "run.json" in capsys.readouterr().err


def test_triton_attention_kernel_on_a_cpu_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import logitlab.kernels.triton_install as triton_install

    monkeypatch.setattr(triton_install, "INTERPRET", False)
    (tmp_path / "code.txt").write_text(TEXT)
    args = _train_args(tmp_path, "--steps", "1", "--attention-kernel", "triton", "--out-dir", str(tmp_path / "run"))
    assert cli.main(args) == 2
    assert "runs on a CUDA device" in capsys.readouterr().err


def test_train_on_jsonl_trains_the_tokenizer_on_the_text_field(tmp_path):
    rows = [{"id": i, "body": f"def f{i}(x):\n    return x + {i}\n"} for i in range(200)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = _train_args(tmp_path, "--steps", "2", "--out-dir", str(tmp_path / "run"))
    args[args.index("--data") + 1] = str(tmp_path / "code.jsonl")
    assert cli.main(args + ["--text-field", "body"]) == 0
    _, tok = load_for_inference(tmp_path / "run")
    pieces = {tok.decode([i]) for i in range(tok.vocab_size)}
    assert not any('"body"' in p or '{"id' in p for p in pieces)  # learned from the text, not the JSON
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert manifest["documents"] == 200 and manifest["splits"]["val"]["documents"] == 40


def _losses(run: Path) -> list[float]:
    """The training losses of a run's metrics.jsonl (the step-0 record holds only val_loss)."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process(tmp_path):
    """`torchrun -m logitlab train` with 2 CPU ranks (gloo, FSDP2) gives the loss sequence of one
    process with the same global batch."""
    (tmp_path / "code.txt").write_text(TEXT)
    common = _train_args(tmp_path, "--steps", "3", "--precision", "fp32", "--eval-every", "0")
    assert cli.main(common + ["--out-dir", str(tmp_path / "one")]) == 0
    _dist.torchrun(2, "-m", "logitlab", *common, "--parallel", "fsdp", "--out-dir", str(tmp_path / "two"))
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), abs=1e-5)
    assert latest_checkpoint(tmp_path / "two").name == "ckpt-000003"


@pytest.mark.slow
def test_torchrun_tensor_parallel_matches_one_process_and_exports(tmp_path):
    """`logitlab train --tp 2` on 2 CPU ranks: the losses of one process, sharded checkpoints, and
    `logitlab export` of the sharded checkpoint loads with the same weights."""
    from logitlab.io.hf import load_pretrained

    (tmp_path / "code.txt").write_text(TEXT)
    common = _train_args(tmp_path, "--steps", "3", "--precision", "fp32", "--eval-every", "0", "--n-kv-heads", "2",
                         "--vocab-pad-multiple", "1")
    assert cli.main(common + ["--out-dir", str(tmp_path / "one")]) == 0
    _dist.torchrun(2, "-m", "logitlab", *common, "--tp", "2", "--out-dir", str(tmp_path / "tp"))
    tp = _losses(tmp_path / "tp")                    # the main loop, its data order, over a TP mesh
    assert tp == pytest.approx(_losses(tmp_path / "one"), abs=1e-5)
    ckpt = sorted((tmp_path / "tp").glob("dcp-*"))[-1]     # sharded checkpoints (train.sharded_run)
    assert cli.main(["export", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    exported = load_pretrained(tmp_path / "hf")
    one, _ = load_for_inference(tmp_path / "one")   # the same shapes as the one-process model
    assert {k: v.shape for k, v in exported.state_dict().items()} == {k: v.shape for k, v in one.state_dict().items()}
    ids = torch.randint(0, exported.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.isfinite(exported(ids)).all()


def test_demo_output_shows_sample_and_next_token_table(tmp_path, capsys):
    out = tmp_path / "d"
    assert cli.main(["demo", "--quick", "--out", str(out), "--progress", "false", "--workers", "1",
                     "--prompt", "import "]) == 0
    text = capsys.readouterr().out
    assert "sample" in text and "next-token probabilities" in text and "ln V" in text
    summary = json.loads((out / "demo.json").read_text())["result"]
    assert summary["val_loss_start"] > summary["val_loss"]
    # the default is the speedrun recipe, which has no Hugging Face class: no export is suggested
    state = json.loads((latest_checkpoint(out) / "state.json").read_text())
    assert state["train_config"]["optimizer"] == "muon" and state["train_config"]["lr_schedule"] == "wsd"
    model, _ = load_for_inference(out)
    assert (model.config.mlp, model.config.value_embeddings, model.config.d_ff) == ("relu2", "alternate", 256)
    # the commands to copy are whole lines, however narrow the console (80 columns here)
    assert f"next: logitlab generate {out} 'def '" in text.splitlines()
    assert f"      logitlab inspect {out} 'import os' --position 0 --lens" in text.splitlines()
    assert f"logitlab export {out}" not in text
    assert cli.main(["inspect", str(out), "import os", "--position", "0", "--lens"]) == 0   # the suggestion works


def test_the_plain_demo_suggests_export(demo_run, capsys):
    from logitlab.cli.demo import _next_commands

    assert _next_commands(demo_run, "none")[1] == f"      logitlab export {demo_run} --out {demo_run}/hf"
    model, _ = load_for_inference(demo_run)
    assert (model.config.mlp, model.config.value_embeddings) == ("swiglu", "none")


def test_demo_compares_its_result_with_the_reference_run():
    from logitlab.cli.demo import REFERENCE, REFERENCES, _against_reference

    line = _against_reference(1200, 3.71, fixed=False, recipe="none")
    assert line == f"reference: {REFERENCE['steps']:,} steps -> 3.63 on an idle 2-core machine; this run fitted " \
                   "1,200 steps -> 3.71"
    short = _against_reference(243, 4.97, fixed=False, recipe="none")
    assert "Only 243 steps fitted the time budget" in short and "`logitlab demo --steps 1016 --recipe none`" in short
    assert "Only" not in _against_reference(100, 5.0, fixed=True) and "took 100 steps" in \
        _against_reference(100, 5.0, fixed=True)
    # the default recipe's own reference: its steps in the same 240 s, and the loss they reach
    ref = REFERENCES["speedrun"]
    assert ref["steps"] < REFERENCE["steps"] and ref["val_loss"] < REFERENCE["val_loss"]
    short = _against_reference(243, 4.97, fixed=False)
    assert f"reference: {ref['steps']:,} steps -> {ref['val_loss']:.2f}" in short
    assert f"`logitlab demo --steps {ref['steps']}` does" in short


def test_train_on_one_file_says_how_validation_was_made(tmp_path, capsys):
    (tmp_path / "code.txt").write_text(TEXT)
    run = tmp_path / "run"
    assert cli.main(_train_args(tmp_path, "--val-fraction", "0.01", "--steps", "2", "--out-dir", str(run))) == 0
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if line.startswith("validation:")]
    assert len(note) == 1 and "last" in note[0] and "tokens of the token stream" in note[0]
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    assert manifest["val_rule"] == "tail of the token stream"
    assert manifest["splits"]["val"]["tokens"] >= 33  # at least one window (T=32, +1)
    assert "val loss" in out.split("done:")[-1]
    assert cli.main(_train_args(tmp_path, "--val-fraction", "0", "--steps", "1",
                                "--out-dir", str(tmp_path / "none"))) == 0
    out = capsys.readouterr().out
    assert "validation: none (val_fraction 0)" in out and "val loss" not in out


def test_train_help_shows_the_tiny_presets_defaults_once_each(capsys, monkeypatch):
    import re

    from logitlab.model.families import get_preset

    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    flags = dict(re.findall(r"^  (--[a-z0-9-]+)[^\n]*?\s{2,}(\S[^\n]*)$", text, re.M))
    tiny = get_preset("tiny")
    assert f"(default: {tiny.d_model})" in flags["--d-model"] and f"(default: {tiny.n_layers})" in flags["--n-layers"]
    assert "(default: 4096)" in flags["--tokenizer-vocab"] and "default" in flags["--tokenizer-bytes"]
    assert "768" not in flags["--d-model"] and "layernorm)" not in flags["--norm"]
    assert not re.search(r"\(default: ([^)]*)\)[^\n]*\(default: \1\)", text)
    assert not re.search(r"default[^\n]*\(default: ", text)  # each default said once
    assert "examples:" in text
    for sub in ("prepare", "plot", "export"):
        with pytest.raises(SystemExit):
            cli.main([sub, "--help"])
        assert re.search(r"examples?:", capsys.readouterr().out)


def test_progress_names_the_bf16_routes_and_the_times_that_chose_them():
    """A bf16 run on a CPU says which kernels its products and attention run on (the start record
    of train.loop: kernels.cpu_bf16's choice and measurements); an fp32 run says nothing of it."""
    from rich.console import Console

    from logitlab.cli.progress import LiveProgress

    start = {"step": 0, "steps": 2, "tokens_per_step": 128, "device": "cpu", "amp": "torch.bfloat16",
             "run_dir": "runs/x", "bf16_route": "fp32", "bf16_route_timings_s": {"native": 2.5, "fp32": 0.5},
             "bf16_attention_route": "native", "bf16_attention_timings_s": {"native": 0.008, "fp32": 0.0095}}
    con = Console(record=True, width=300, force_terminal=False)
    LiveProgress(con, True)("start", start)
    text = con.export_text()
    assert "training on cpu (bf16 autocast)" in text
    assert ("bf16 on the CPU: products on float32 kernels (measured: float32 500.0 ms, bf16 2,500.0 ms); "
            "attention on bf16 kernels (measured: float32 9.5 ms, bf16 8.0 ms)") in text
    con = Console(record=True, width=300, force_terminal=False)
    LiveProgress(con, True)("start", dict(start, amp="None", bf16_route=None, bf16_route_timings_s=None))
    assert "bf16 on the CPU" not in con.export_text()


def test_live_progress_keeps_every_evaluation_line_above_the_bar():
    from rich.console import Console

    from logitlab.cli.progress import LiveProgress

    con = Console(record=True, force_terminal=True, width=100)
    live = LiveProgress(con, True)
    live("start", dict(device="cpu", amp="None", tokens_per_step=1024, run_dir="runs/x", steps=30, step=0))
    for step in (10, 20, 30):
        live("step", dict(step=step, loss=3.0, tokens_per_s=1000.0))
        live("eval", dict(step=step, loss=3.0, val_loss=3.5 - step / 100, val_ppl=30.0, tokens_per_s=1000.0))
    live("end", {})
    text = con.export_text()
    for step in (10, 20, 30):
        assert f"step {step}: loss 3.0000, val {3.5 - step / 100:.4f}" in text
