"""checkpoint.py: model directories, run checkpoints (round trip, pruning, best, inference
loading) and atomic saves under kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from logitlab.io import checkpoint as ck
from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.tokenizer.core import Tokenizer
from logitlab.train import runtime
from logitlab.train.optim import build_adamw

ROOT = Path(__file__).resolve().parents[1]


def tiny(seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=257, context_length=16, d_model=32, n_layers=2, n_heads=4))


def one_step(model, opt):
    ids = torch.randint(0, 257, (2, 8))
    model(ids).float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()


def test_model_dir_round_trip(tmp_path):
    model = tiny()
    ck.save_model(model, tmp_path / "m")
    assert ck.is_logitlab_dir(tmp_path / "m")
    loaded = ck.load_model(tmp_path / "m")
    ids = torch.randint(0, 257, (1, 8))
    assert torch.equal(model(ids), loaded(ids))


def test_model_dir_loads_in_a_dtype_tensor_by_tensor(tmp_path, monkeypatch):
    """load_model(dtype=bf16) equals loading then casting, bit for bit, and casts each tensor as
    it is read: no float32 copy of the model is ever handed to the module."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=257, context_length=16, d_model=32, n_layers=2, n_heads=4,
                                    n_kv_heads=2, norm="rmsnorm", mlp="swiglu", positions="rope",
                                    bias=False, tie_embeddings=True))
    ck.save_model(model, tmp_path / "m")
    seen = []
    original = torch.nn.Module.load_state_dict

    def spy(self, state, *args, **kwargs):
        seen.extend(t.dtype for t in state.values())
        return original(self, state, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", spy)
    half = ck.load_model(tmp_path / "m", dtype=torch.bfloat16)
    assert seen and set(seen) == {torch.bfloat16}
    assert half.lm_head.weight is half.tok_emb.weight
    ids = torch.randint(0, 257, (2, 8))
    with torch.no_grad():
        assert torch.equal(half(ids), model.to(torch.bfloat16)(ids))


def test_model_dir_with_separate_projection_keys_still_loads(tmp_path):
    """A model directory written before q/k/v and gate/up were fused (separate keys) loads."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=257, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=True)
    model = Transformer(cfg)
    ck.save_model(model, tmp_path / "m")
    old = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        if ".qkv_proj." in key:
            for name, rows in zip(("q_proj", "k_proj", "v_proj"), t.split((32, 16, 16))):
                old[key.replace("qkv_proj", name)] = rows.contiguous()
        elif ".gate_up_proj." in key:
            for name, rows in zip(("gate_proj", "up_proj"), t.chunk(2)):
                old[key.replace("gate_up_proj", name)] = rows.contiguous()
        else:
            old[key] = t.contiguous()
    save_file(old, str(tmp_path / "m" / ck.WEIGHTS_FILE))
    ids = torch.randint(0, 257, (1, 8))
    with torch.no_grad():
        assert torch.equal(ck.load_model(tmp_path / "m")(ids), model(ids))
    with pytest.raises(ValueError, match="before q/k/v and gate/up became one projection"):
        ck.load_model_state(tmp_path / "m")          # exact resume: the optimizer state cannot follow
    del old["blocks.1.attn.v_proj.weight"]
    save_file(old, str(tmp_path / "m" / ck.WEIGHTS_FILE))
    with pytest.raises(ValueError, match="blocks.1.attn"):
        ck.load_model(tmp_path / "m")


def test_run_checkpoint_round_trip_restores_everything(tmp_path):
    model = tiny()
    opt = build_adamw(model, lr=1e-3)
    one_step(model, opt)
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])
    runtime.seed_everything(11)
    rng = runtime.capture_rng_state()
    expected_draw = torch.rand(3)
    path = ck.save_checkpoint(tmp_path, 7, model, opt, state={"sampler": {"index": 7}, "val_loss": 2.5},
                              rng=rng, tokenizer=tok, metrics=[{"step": 7, "loss": 3.0}])
    assert path.name == "ckpt-000007"
    assert ck.latest_checkpoint(tmp_path) == path
    other = tiny(seed=1)
    opt2 = build_adamw(other, lr=1e-3)
    loaded = ck.load_checkpoint(path, other, opt2)
    assert loaded["state"]["step"] == 7 and loaded["state"]["sampler"] == {"index": 7}
    assert loaded["metrics"] == [{"step": 7, "loss": 3.0}]
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    runtime.restore_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(3), expected_draw)
    # nothing in the directory needs unpickling of code
    torch.load(path / ck.OPTIMIZER_FILE, weights_only=True)
    torch.load(path / ck.RNG_FILE, weights_only=True)
    m, t = ck.load_for_inference(tmp_path)
    assert t is not None and t.fingerprint() == tok.fingerprint() and not m.training
    m2, _ = ck.load_for_inference(path)
    ids = torch.randint(0, 257, (1, 8))
    assert torch.equal(m(ids), m2(ids))


def test_keep_last_k_plus_best(tmp_path):
    model = tiny()
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: 2.7}
    for step, loss in losses.items():
        ck.save_checkpoint(tmp_path, step, model, state={"val_loss": loss}, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["ckpt-000002", "ckpt-000004", "ckpt-000005"]
    assert ck.best_checkpoint(tmp_path).name == "ckpt-000002"
    assert ck.resolve_model_dir(tmp_path, "best").name == "ckpt-000002"
    assert ck.resolve_model_dir(tmp_path).name == "ckpt-000005"


def test_missing_and_half_written_are_ignored_or_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.load_for_inference(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such"):
        ck.load_for_inference(tmp_path / "nope")
    (tmp_path / ".ckpt-000009.tmp-abc").mkdir()
    (tmp_path / "ckpt-000010").mkdir()  # no state.json: not complete
    assert ck.latest_checkpoint(tmp_path) is None


@pytest.mark.slow
def test_atomic_save_survives_kill_9(tmp_path):
    """A process saving checkpoints in a loop is killed at an arbitrary instant; every checkpoint
    directory that exists afterwards loads completely."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from logitlab.io.checkpoint import save_checkpoint
        from logitlab.model.transformer import ModelConfig, Transformer
        from logitlab.train.optim import build_adamw
        m = Transformer(ModelConfig(vocab_size=257, context_length=16, d_model=64, n_layers=4, n_heads=4))
        opt = build_adamw(m, 1e-3)
        step = 0
        while True:
            step += 1
            with torch.no_grad():
                for p in m.parameters():
                    p.fill_(float(step))
            save_checkpoint({str(tmp_path)!r}, step, m, opt, state={{"val_loss": 1.0 / step}}, keep_last=2)
            print(step, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # a few saves done, then kill at an arbitrary instant
            proc.stdout.readline()
        time.sleep(0.037)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
        proc.stdout.close()
    ckpts = ck.list_checkpoints(tmp_path)
    assert len(ckpts) >= 2
    for c in ckpts:
        step = ck.read_state(c)["step"]
        model = ck.load_model(c)
        assert all(torch.all(p == step) for p in model.parameters()), c
        ck.load_checkpoint(c, model, build_adamw(model, 1e-3))


def test_model_dir_loads_with_a_safetensors_that_has_no_pread_backend(tmp_path, monkeypatch):
    """open_safetensors falls back to the memory-mapped reader where safe_open has no `backend`."""
    import safetensors

    model = tiny()
    ck.save_model(model, tmp_path / "m")
    original = safetensors.safe_open

    def old_safe_open(path, framework, device="cpu", **kwargs):
        if kwargs:
            raise TypeError(f"safe_open() got an unexpected keyword argument {next(iter(kwargs))!r}")
        return original(path, framework=framework, device=device)

    monkeypatch.setattr(safetensors, "safe_open", old_safe_open)
    ids = torch.randint(0, 257, (1, 8))
    assert torch.equal(ck.load_model(tmp_path / "m")(ids), model(ids))


def test_a_sharded_run_is_refused_with_the_export_command(tmp_path):
    """A tensor-parallel run holds dcp-STEP checkpoints that no single process loads directly: the
    error names the command that makes a model directory of one."""
    from logitlab.io.checkpoint import load_for_inference

    (tmp_path / "dcp-000004").mkdir()
    for path in (tmp_path, tmp_path / "dcp-000004"):
        with pytest.raises(FileNotFoundError, match="logitlab export"):
            load_for_inference(path)


def test_the_best_checkpoint_is_one_of_the_latest_model_shape(tmp_path):
    """After an extension of the context, a lower loss measured at the old length does not make its
    checkpoint the best: only checkpoints of the latest model config compete."""
    import dataclasses

    short = tiny()
    long = Transformer(dataclasses.replace(short.config, context_length=short.config.context_length * 2))
    ck.save_checkpoint(tmp_path, 2, short, state={"val_loss": 1.0}, keep_last=None)
    ck.save_checkpoint(tmp_path, 4, long, state={"val_loss": 3.0}, keep_last=None)
    ck.save_checkpoint(tmp_path, 6, long, state={"val_loss": 2.5}, keep_last=None)
    assert ck.best_checkpoint(tmp_path).name == "ckpt-000006"
    ck.save_checkpoint(tmp_path / "plain", 2, short, state={"val_loss": 1.0}, keep_last=None)
    ck.save_checkpoint(tmp_path / "plain", 4, short, state={"val_loss": 3.0}, keep_last=None)
    assert ck.best_checkpoint(tmp_path / "plain").name == "ckpt-000002"
