"""Bad input on the read side: every broken config, weights or pickle file ends as one ValueError
naming the file and the field, key or value, and through the CLI as one `error:` line, exit 2."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import load_file, save_file

from logitlab.cli.main import main
from logitlab.io import checkpoint as ck
from logitlab.io import hf
from logitlab.model import families
from logitlab.model.transformer import ModelConfig, Transformer, check_field_types
from logitlab.tokenizer.core import Tokenizer
from logitlab.train import runtime
from logitlab.train.optim import build_adamw

CONFIG = dict(vocab_size=257, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              norm="rmsnorm", mlp="swiglu", positions="rope", bias=False)
QKV = "blocks.0.attn.qkv_proj.weight"
HF_Q = "model.layers.0.self_attn.q_proj.weight"


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**CONFIG))


def tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=["<|endoftext|>"])


def model_dir(path: Path) -> Path:
    """A logitlab model directory with its tokenizer (what `generate MODEL` reads)."""
    ck.save_model(tiny(), path)
    tokenizer().save(path / ck.TOKENIZER_FILE)
    return path


def hf_dir(path: Path) -> Path:
    hf.save_pretrained(tiny(), path, tokenizer())
    return path


def shard(d: Path) -> Path:
    """Split an HF directory's model.safetensors into two shards with an index; the second shard."""
    state = load_file(str(d / hf.SAFETENSORS))
    (d / hf.SAFETENSORS).unlink()
    keys = sorted(state)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:]), 1):
        name = f"model-0000{i}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(d / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (d / hf.SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d / "model-00002-of-00002.safetensors"


def edit_json(path: Path, edit) -> None:
    payload = json.loads(path.read_text())
    edit(payload)
    path.write_text(json.dumps(payload))


def cli_error(capsys, monkeypatch, *argv: str) -> str:
    """Run the CLI; it must exit 2 with exactly one `error:` line (no traceback): that line."""
    monkeypatch.setenv("COLUMNS", "1000")   # rich would wrap a long line at 80 columns
    assert main(list(argv)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def generate(kind: str, d: Path) -> tuple[str, ...]:
    return ("generate", str(d), "hi", "--max-new-tokens", "1")


def test_a_good_model_dir_still_generates(tmp_path, capsys):
    assert main(list(generate("checkpoint", model_dir(tmp_path / "m")))) == 0
    assert main(list(generate("hf", hf_dir(tmp_path / "h")))) == 0


# ---------------------------------------------------------------------------------------------
# config.json of a logitlab model directory: JSON types, finite floats
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("qk_norm", "false", "qk_norm: expected true or false, got 'false'"),
    ("tie_embeddings", "no", "tie_embeddings: expected true or false, got 'no'"),
    ("bias", 0, "bias: expected true or false, got 0"),
    ("n_kv_heads", "1", "n_kv_heads: expected an integer or null, got '1'"),
    ("n_kv_heads", 1.0, "n_kv_heads: expected an integer or null, got 1.0"),
    ("d_ff", "128", "d_ff: expected an integer or null, got '128'"),
    ("n_layers", True, "n_layers: expected an integer, got True"),
    ("norm_eps", "1e-5", "norm_eps: expected a finite number, got '1e-5'"),
    ("norm_eps", math.nan, "norm_eps: expected a finite number, got nan"),
    ("init_std", "0.02", "init_std: expected a finite number, got '0.02'"),
    ("init_std", math.inf, "init_std: expected a finite number, got inf"),
    ("dropout", "0", "dropout: expected a finite number, got '0'"),
    ("rope_theta", -math.inf, "rope_theta: expected a finite number, got -inf"),
    ("norm", "RMSNorm", "norm must be one of ('layernorm', 'rmsnorm'), got 'RMSNorm'"),
    ("rope_scaling", "yes", "rope_scaling: expected an object (factor, low_freq_factor, high_freq_factor, "
                            "original_context_length, rope_type, beta_fast, beta_slow, mscale, mscale_all_dim, "
                            "attention_factor, truncate, short_factor, long_factor) or null, got 'yes'"),
    ("rope_scaling", [8.0], "rope_scaling: expected an object"),
    ("rope_scaling", {"factor": 8.0, "scale": 2}, "unknown rope_scaling field(s) ['scale']"),
    ("rope_scaling", {"factor": "8"}, "rope_scaling.factor: expected a finite number, got '8'"),
    ("rope_scaling", {"original_context_length": 8.5}, "rope_scaling.original_context_length: expected an integer"),
])
def test_config_field_of_the_wrong_type_is_named(tmp_path, capsys, monkeypatch, field, value, message):
    d = model_dir(tmp_path / "m")
    edit_json(d / ck.CONFIG_FILE, lambda p: p["model"].__setitem__(field, value))
    with pytest.raises(ValueError) as info:
        ck.load_model(d)
    assert str(info.value).startswith(f"{d / ck.CONFIG_FILE}: {message}")
    line = cli_error(capsys, monkeypatch, *generate("checkpoint", d))
    assert message in line and str(d / ck.CONFIG_FILE) in line


@pytest.mark.parametrize("model", [None, [1, 2], "gpt2"])
def test_config_model_that_is_not_an_object_is_named(tmp_path, capsys, monkeypatch, model):
    d = model_dir(tmp_path / "m")
    edit_json(d / ck.CONFIG_FILE, lambda p: p.__setitem__("model", model))
    with pytest.raises(ValueError, match='"model" must be an object of ModelConfig fields, got '):
        ck.read_model_config(d)
    assert f'"model" must be an object of ModelConfig fields, got {json.dumps(model)}' in cli_error(
        capsys, monkeypatch, *generate("checkpoint", d))


def test_params_and_inspect_name_the_bad_field_too(tmp_path, capsys, monkeypatch):
    d = model_dir(tmp_path / "m")
    edit_json(d / ck.CONFIG_FILE, lambda p: p["model"].__setitem__("qk_norm", "false"))
    for argv in (("params", str(d)), ("inspect", str(d), "hi")):
        assert "qk_norm: expected true or false" in cli_error(capsys, monkeypatch, *argv)


@dataclass(frozen=True)
class _Typed:
    kinds: tuple[Literal["full", "window"], ...] = ("full",)
    pair: tuple[int, float] = (1, 2.0)
    window: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self)


def test_field_type_check_reads_any_dataclass_annotations():
    """Tuples (lists in JSON), Literals inside them, fixed-length tuples and optionals."""
    assert _Typed(kinds=["full", "window"], pair=[3, 4]) == _Typed(kinds=("full", "window"), pair=(3, 4.0))
    for kwargs, message in ((dict(kinds=("full", "sliding")), "kinds: expected a list of items each one of "),
                            (dict(kinds="full"), "kinds: expected a list"),
                            (dict(pair=(1,)), r"pair: expected a list of 2 items \(an integer, a finite number\)"),
                            (dict(window=2.0), "window: expected an integer or null, got 2.0")):
        with pytest.raises(ValueError, match=message):
            _Typed(**kwargs)


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json
# ---------------------------------------------------------------------------------------------

def _rope(payload: dict, **entries) -> None:
    payload["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8)
    payload["rope_scaling"].update(entries)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.__setitem__("num_key_value_heads", "2"),
     "'num_key_value_heads' in {path}: expected an integer, got '2'"),
    (lambda p: p.__setitem__("eos_token_id", "256"),
     "'eos_token_id' in {path}: expected an integer or a list of integers, got '256'"),
    (lambda p: p.__setitem__("eos_token_id", [256, "1"]), "'eos_token_id' in {path}: expected"),
    (lambda p: p.__setitem__("rope_scaling", "yes"), "'rope_scaling' in {path}: expected an object, got 'yes'"),
    (lambda p: p.__setitem__("tie_word_embeddings", "false"),
     "'tie_word_embeddings' in {path}: expected true or false, got 'false'"),
    (lambda p: p.__setitem__("attention_bias", "false"), "'attention_bias' in {path}: expected true or false"),
    (lambda p: p.__setitem__("hidden_size", 32.0), "'hidden_size' in {path}: expected an integer, got 32.0"),
    (lambda p: p.__setitem__("rms_norm_eps", "1e-6"), "'rms_norm_eps' in {path}: expected a finite number"),
    (lambda p: p.__setitem__("rope_theta", math.nan), "'rope_theta' in {path}: expected a finite number, got nan"),
    (lambda p: p.__setitem__("architectures", "LlamaForCausalLM"), "'architectures' in {path}: expected a list"),
    (lambda p: _rope(p, factor="8"), "'rope_scaling.factor' in {path}: expected a finite number, got '8'"),
    (lambda p: (_rope(p), p["rope_scaling"].pop("low_freq_factor")),
     "{path}: rope_scaling of rope_type 'llama3' lacks low_freq_factor"),
    (lambda p: p.__setitem__("num_attention_heads", 0), "{path}: n_heads must be a positive integer, got 0"),
])
def test_hf_config_key_of_the_wrong_type_is_named(tmp_path, capsys, monkeypatch, edit, message):
    d = hf_dir(tmp_path / "h")
    edit_json(d / "config.json", edit)
    message = message.format(path=d / "config.json")
    with pytest.raises(ValueError) as info:
        hf.load_pretrained(d)
    assert message in str(info.value)
    assert message in cli_error(capsys, monkeypatch, *generate("hf", d))
    assert message in cli_error(capsys, monkeypatch, "convert", str(d))


@pytest.mark.parametrize("text", ["[1, 2]", '"LlamaForCausalLM"', "null"])
def test_config_json_that_is_not_an_object_is_named(tmp_path, capsys, monkeypatch, text):
    d = hf_dir(tmp_path / "h")
    (d / "config.json").write_text(text)
    message = f"{d / 'config.json'}: expected a JSON object {{...}} at the top level, got {text}"
    for load in (hf.load_pretrained, hf.read_hf_config, ck.is_logitlab_dir, ck.resolve_model_dir):
        with pytest.raises(ValueError, match="expected a JSON object"):
            load(d)
    assert message in cli_error(capsys, monkeypatch, *generate("hf", d))
    assert message in cli_error(capsys, monkeypatch, *generate("checkpoint", d))
    with pytest.raises(ValueError, match="expected a JSON object at the top level, got a list"):
        families.config_from_hf([1, 2])


# ---------------------------------------------------------------------------------------------
# JSON that does not parse: reported with file, line and column, never as "no checkpoint"
# ---------------------------------------------------------------------------------------------

BROKEN = '{"format": "logitlab",\n  "model": {,}}'


def test_unparsable_config_json_is_reported_not_taken_for_no_checkpoint(tmp_path, capsys, monkeypatch):
    d = model_dir(tmp_path / "m")
    (d / ck.CONFIG_FILE).write_text(BROKEN)
    where = (f"{d / ck.CONFIG_FILE}: not valid JSON (Expecting property name enclosed in double quotes at "
             "line 2, column 13)")
    for read in (ck.is_logitlab_dir, ck.resolve_model_dir, ck.read_model_config, ck.load_model,
                 ck.load_for_inference, hf.load_pretrained, hf.read_hf_config):
        with pytest.raises(ValueError) as info:
            read(d)
        assert where in str(info.value), read
    assert where in cli_error(capsys, monkeypatch, *generate("checkpoint", d))
    assert where in cli_error(capsys, monkeypatch, *generate("hf", d))
    assert where in cli_error(capsys, monkeypatch, "params", str(d))


def test_unparsable_json_of_a_run_checkpoint_is_named(tmp_path):
    model = tiny()
    c = ck.save_checkpoint(tmp_path / "run", 1, model, build_adamw(model, 1e-3), metrics=[{"step": 1}])
    (c / ck.CONFIG_FILE).write_text(BROKEN)
    with pytest.raises(ValueError, match=rf"{re.escape(str(c / ck.CONFIG_FILE))}: not valid JSON .*line 2, column 13"):
        ck.load_for_inference(tmp_path / "run")
    (c / ck.METRICS_FILE).write_text('{"step": 1}\n{"step": \n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(c / ck.METRICS_FILE))}: line 2 is not valid JSON"):
        ck.load_checkpoint(c)
    state = re.escape(str(c / ck.STATE_FILE))
    (c / ck.STATE_FILE).write_text('{"step": 1,}')
    with pytest.raises(ValueError, match=rf"{state}: not valid JSON .*line 1, column 12"):
        ck.read_state(c)
    with pytest.raises(ValueError, match=rf"{state}: not valid JSON"):
        ck.resolve_model_dir(tmp_path / "run", "best")
    (c / ck.STATE_FILE).write_text("[1]")
    with pytest.raises(ValueError, match=rf"{state}: expected a JSON object"):
        ck.load_checkpoint(c)


def test_unparsable_or_wrong_shard_index_is_named(tmp_path, capsys, monkeypatch):
    d = hf_dir(tmp_path / "h")
    shard(d)
    index = d / hf.SAFETENSORS_INDEX
    index.write_text('{"weight_map": {"a": }}')
    assert f"{index}: not valid JSON" in cli_error(capsys, monkeypatch, *generate("hf", d))
    index.write_text('{"weight_map": {"a": 1}}')
    with pytest.raises(ValueError, match="has no weight_map"):
        hf.load_pretrained(d)


# ---------------------------------------------------------------------------------------------
# Corrupt safetensors: our model directories, HF single files and HF shards
# ---------------------------------------------------------------------------------------------

def _bad_header(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    return data[:8] + b"#" * n + data[8 + n:]


CORRUPTIONS = {
    "truncated": (lambda data: data[: len(data) // 2], "incomplete metadata, file not fully covered"),
    "empty": (lambda data: b"", "header too small"),
    "garbage appended": (lambda data: data + b"garbage!", "incomplete metadata, file not fully covered"),
    "bad header": (_bad_header, "invalid JSON in header"),
}


def _corrupt(path: Path, how: str) -> str:
    damage, reason = CORRUPTIONS[how]
    path.write_bytes(damage(path.read_bytes()))
    return f"{path}: not a valid safetensors file ({reason}"


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_model_safetensors_is_named(tmp_path, capsys, monkeypatch, how):
    model = tiny()
    c = ck.save_checkpoint(tmp_path / "run", 1, model, build_adamw(model, 1e-3))
    tokenizer().save(c / ck.TOKENIZER_FILE)
    message = _corrupt(c / ck.WEIGHTS_FILE, how)
    for read in (ck.load_model, ck.load_model_state, hf.load_pretrained, lambda d: ck.load_checkpoint(d, tiny())):
        with pytest.raises(ValueError) as info:
            read(c)
        assert message in str(info.value)
    assert message in cli_error(capsys, monkeypatch, *generate("checkpoint", tmp_path / "run"))
    assert message in cli_error(capsys, monkeypatch, "convert", str(c), "--out", str(tmp_path / "x"))


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_hf_safetensors_is_named(tmp_path, capsys, monkeypatch, how, sharded):
    d = hf_dir(tmp_path / "h")
    message = _corrupt(shard(d) if sharded else d / hf.SAFETENSORS, how)
    for read in (hf.load_pretrained, hf.read_hf_weights):
        with pytest.raises(ValueError) as info:
            read(d)
        assert message in str(info.value)
    assert message in cli_error(capsys, monkeypatch, *generate("hf", d))
    assert message in cli_error(capsys, monkeypatch, "convert", str(d))


class _CutShort:
    """A safe_open handle whose file was cut after its header was read."""

    def get_tensor(self, key):
        from safetensors import SafetensorError

        raise SafetensorError("Error while deserializing header: data cut short")


def test_a_tensor_read_error_names_the_file(tmp_path, monkeypatch):
    d = model_dir(tmp_path / "m")
    with ck.open_safetensors(d / ck.WEIGHTS_FILE) as f:
        monkeypatch.setattr(f, "_file", _CutShort())
        with pytest.raises(ValueError, match=rf"{re.escape(str(d / ck.WEIGHTS_FILE))}: not a valid safetensors "
                                             r"file \(data cut short\)"):
            f.get_tensor(QKV)
        monkeypatch.undo()


# ---------------------------------------------------------------------------------------------
# Pickles: code is refused by name, never run; unreadable torch files are named
# ---------------------------------------------------------------------------------------------

class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


REFUSED = "refusing to unpickle code in {path} (only tensors and plain containers are loaded; it calls "


@pytest.fixture
def run_checkpoint(tmp_path) -> Path:
    model = tiny()
    return ck.save_checkpoint(tmp_path / "run", 1, model, build_adamw(model, 1e-3), rng=runtime.capture_rng_state())


@pytest.mark.parametrize("name", [ck.OPTIMIZER_FILE, ck.RNG_FILE])
def test_pickle_that_would_run_code_is_refused_by_name(run_checkpoint, capfd, name):
    c = run_checkpoint
    torch.save({"state": {0: Evil()}, "param_groups": []}, c / name)
    model = tiny()
    message = REFUSED.format(path=c / name)
    loads = [lambda: ck.load_checkpoint(c, model, build_adamw(model, 1e-3))]
    if name == ck.OPTIMIZER_FILE:
        loads.append(lambda: ck.load_optimizer_state(c))
    for load in loads:
        with pytest.raises(ValueError) as info:
            load()
        assert str(info.value).startswith(message), info.value
        assert "\n" not in str(info.value)
    assert "pwned" not in capfd.readouterr().out


def test_hf_bin_that_would_run_code_is_refused_by_name(tmp_path, capfd, monkeypatch):
    d = hf_dir(tmp_path / "h")
    state = load_file(str(d / hf.SAFETENSORS))
    (d / hf.SAFETENSORS).unlink()
    torch.save({**state, HF_Q: Evil()}, d / hf.TORCH_BIN)
    message = REFUSED.format(path=d / hf.TORCH_BIN)
    for read in (hf.load_pretrained, hf.read_hf_weights):
        with pytest.raises(ValueError, match="refusing to unpickle code"):
            read(d)
    assert message in cli_error(capfd, monkeypatch, "convert", str(d))
    assert "pwned" not in capfd.readouterr().out


@pytest.mark.parametrize("damage, reason", [
    (lambda data: b"", "the file ends early"),
    (lambda data: data[: len(data) // 2], "PytorchStreamReader failed reading zip archive"),
    (lambda data: b"not a pickle at all", "Unsupported operand"),
])
def test_unreadable_torch_file_is_named(run_checkpoint, damage, reason):
    path = run_checkpoint / ck.OPTIMIZER_FILE
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not a readable torch file \(.*{reason}"):
        ck.load_optimizer_state(run_checkpoint)


def test_optimizer_state_of_another_model_is_named(run_checkpoint):
    other = Transformer(ModelConfig(**{**CONFIG, "n_layers": 1}))
    path = re.escape(str(run_checkpoint / ck.OPTIMIZER_FILE))
    with pytest.raises(ValueError, match=rf"{path} does not match the optimizer"):
        ck.load_checkpoint(run_checkpoint, optimizer=build_adamw(other, 1e-3))


# ---------------------------------------------------------------------------------------------
# NaN / inf weights are refused when a model is loaded for inference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_weight_in_a_model_dir_is_named(tmp_path, capsys, monkeypatch, bad):
    d = model_dir(tmp_path / "m")
    state = load_file(str(d / ck.WEIGHTS_FILE))
    state[QKV][0, :3] = bad
    save_file(state, str(d / ck.WEIGHTS_FILE), metadata={"format": "logitlab"})
    message = f"{d / ck.WEIGHTS_FILE}: tensor {QKV} holds 3 NaN / inf values"
    for load in (ck.load_model, lambda d: ck.load_model(d, dtype=torch.bfloat16), ck.load_for_inference,
                 hf.load_pretrained):
        with pytest.raises(ValueError) as info:
            load(d)
        assert str(info.value) == message
    assert message in cli_error(capsys, monkeypatch, *generate("checkpoint", d))


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "bin"])
def test_non_finite_weight_in_an_hf_dir_is_named(tmp_path, capsys, monkeypatch, layout):
    d = hf_dir(tmp_path / "h")
    state = load_file(str(d / hf.SAFETENSORS))
    state[HF_Q][1, 1] = math.nan
    if layout == "bin":
        (d / hf.SAFETENSORS).unlink()
        torch.save(state, d / hf.TORCH_BIN)
        path = d / hf.TORCH_BIN
    else:
        save_file(state, str(d / hf.SAFETENSORS), metadata={"format": "pt"})
        path = d / hf.SAFETENSORS
        if layout == "sharded":
            shard(d)
            path = d / json.loads((d / hf.SAFETENSORS_INDEX).read_text())["weight_map"][HF_Q]
    message = f"{path}: tensor {HF_Q} holds 1 NaN / inf values"
    with pytest.raises(ValueError) as info:
        hf.load_pretrained(d, dtype="bf16")
    assert str(info.value) == message
    assert message in cli_error(capsys, monkeypatch, *generate("hf", d))
    assert torch.isnan(hf.read_hf_weights(d)[HF_Q]).any()    # the raw reader hands tensors over as stored


def test_finite_check_covers_every_float_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn):
        t = torch.zeros(5, 7, dtype=dtype)
        ck.require_finite("f", "k", t)
        ck.require_finite("f", "k", t[:, :0])
        t[2, 3] = math.nan
        with pytest.raises(ValueError, match="f: tensor k holds 1 NaN / inf values"):
            ck.require_finite("f", "k", t.t())
    ck.require_finite("f", "ids", torch.tensor([1, 2]))

