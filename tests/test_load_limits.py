"""Untrusted model directories: every size a config claims is bounded, checked against the tensors
the directory holds and estimated against the machine's memory before anything is built or
allocated, with an error that names the file, the field and the value; PEFT adapters likewise.
Each attack that would allocate runs in a child process under an address-space cap (_bounded), so
a regression fails the test instead of the shared machine; a hang fails it too (timeout)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from _bounded import last_line, run_bounded
from safetensors.torch import load_file, save_file
from test_load_errors import CONFIG, cli_error, edit_json, generate, hf_dir, model_dir, shard, tiny

from logitlab.cli.main import main
from logitlab.io import checkpoint as ck
from logitlab.io import hf
from logitlab.io import tensors as tensor_files
from logitlab.model import memory
from logitlab.model.config import SIZE_LIMITS, ModelConfig
from logitlab.model.hf_config import HF_SIZES, config_from_hf

# Every attack on the loaders, as (name, how to spoil a good directory). One capped child process
# loads them all (the refusals must come before anything is allocated, so it is quick).
ROPE_BOMB = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 10**12}
HF_ATTACKS = {
    "layers": {"num_hidden_layers": 1_000_000}, "context": {"max_position_embeddings": 10**12},
    "context-1e9": {"max_position_embeddings": 10**9}, "vocab": {"vocab_size": 10**10},
    "ffn": {"intermediate_size": 2**40}, "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 1e300}},
    "original": {"rope_scaling": ROPE_BOMB}, "unbacked": {"num_hidden_layers": 9000},
    "unbacked-sharded": {"num_hidden_layers": 9000},
    "tb-vocab": {"vocab_size": 2**24, "hidden_size": 2**14},                  # within bounds, 1.1 TB
    "tb-layers": {"hidden_size": 2**16, "intermediate_size": 2**20, "head_dim": 16},
}
OWN_ATTACKS = {"own-layers": {"n_layers": 1_000_000}, "own-context": {"context_length": 10**9},
               "own-padding": {"vocab_pad_multiple": 2**40}}

CHILD = """
import json, sys
from logitlab.io import hf
from logitlab.model.config import ModelConfig
from logitlab.model.transformer import Transformer
from logitlab.train.lora_peft import load_peft_adapter
out = {}
for name, d in json.loads(sys.argv[1]).items():
    try:
        if name.startswith("adapter"):
            load_peft_adapter(Transformer(ModelConfig(**json.loads(sys.argv[2]))), d)
            out[name] = "loaded"
        else:
            out[name] = "loaded %d" % sum(p.numel() for p in hf.load_pretrained(d).parameters())
    except ValueError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """name -> (directory, the message its load was refused with) for every attack, each loaded in
    one child process capped at 4 GiB of address space: a regression that allocates what a file
    asks for dies there ("tried to allocate") and fails the tests, never the machine."""
    root, dirs = tmp_path_factory.mktemp("attacks"), {}
    for name, edit in HF_ATTACKS.items():
        dirs[name] = hf_dir(root / name)
        if name.endswith("sharded"):
            shard(dirs[name])
        edit_json(dirs[name] / "config.json", lambda p: p.update(edit))
    for name, edit in OWN_ATTACKS.items():
        dirs[name] = model_dir(root / name)
        edit_json(dirs[name] / ck.CONFIG_FILE, lambda p: p["model"].update(edit))
    for i, (edit, _) in enumerate(HOSTILE_ADAPTERS):
        dirs[f"adapter{i}"] = adapter_dir(root / f"adapter{i}")
        edit_json(dirs[f"adapter{i}"] / "adapter_config.json", lambda p: p.update(edit))
    proc = run_bounded(CHILD, json.dumps({k: str(v) for k, v in dirs.items()}), json.dumps(CONFIG))
    assert proc.returncode == 0, last_line(proc)
    return {name: (dirs[name], message) for name, message in json.loads(proc.stdout).items()}


# ---------------------------------------------------------------------------------------------
# Sizes: bounded before anything exists
# ---------------------------------------------------------------------------------------------

def test_sizes_past_their_bounds_are_named_before_anything_is_built(refused):
    """Before: a million layers hung building modules, 10**12 positions died in the allocator
    ("tried to allocate 8000000000000 bytes", no file, no field), 10**9 took 8 GB of RoPE tables."""
    for name in ("layers", "context", "context-1e9", "vocab", "ffn"):
        d, message = refused[name]
        ((key, value),) = HF_ATTACKS[name].items()
        assert message.startswith(f"{d / 'config.json'}: {key} = {value} is beyond logitlab's bound of "
                                  f"{SIZE_LIMITS[HF_SIZES[key]]}"), message
    assert "dynamic RoPE's max_position_embeddings (16) x factor (1e+300)" in refused["dynamic"][1]
    assert "rope_scaling.original_max_position_embeddings = 1000000000000 is beyond" in refused["original"][1]
    for name, edit in OWN_ATTACKS.items():
        d, message = refused[name]
        ((field, value),) = edit.items()
        assert message.startswith(f"{d / ck.CONFIG_FILE}: {field} = {value} is beyond logitlab's bound of "
                                  f"{SIZE_LIMITS[field]}"), message
    with pytest.raises(ValueError, match="full_attention_interval must be a positive integer, got 0"):
        config_from_hf({"architectures": ["Qwen3_5ForCausalLM"], "full_attention_interval": 0})


def test_a_layer_count_no_tensor_backs_is_named(refused, capsys, monkeypatch):
    for name in ("unbacked", "unbacked-sharded"):
        d, message = refused[name]
        held = f"the 2 shards in {d}" if name.endswith("sharded") else d / hf.SAFETENSORS
        assert message == f"{d / 'config.json'}: num_hidden_layers = 9000, but {held} holds layers 0..1 only (2 layers)"
    d, message = refused["unbacked"]
    assert message in cli_error(capsys, monkeypatch, *generate("hf", d))


def test_a_logitlab_layer_count_no_tensor_backs_is_named(tmp_path, capsys, monkeypatch):
    d = model_dir(tmp_path / "m")
    edit_json(d / ck.CONFIG_FILE, lambda p: p["model"].__setitem__("n_layers", 3))
    message = f"{d / ck.CONFIG_FILE}: n_layers = 3, but {d / ck.WEIGHTS_FILE} holds layers 0..1 only"
    with pytest.raises(ValueError, match=re.escape(message)):
        ck.load_model(d)
    state = load_file(str(d / ck.WEIGHTS_FILE))
    save_file({k.replace("blocks.1.", "blocks.7."): v for k, v in state.items()}, str(d / ck.WEIGHTS_FILE))
    edit_json(d / ck.CONFIG_FILE, lambda p: p["model"].__setitem__("n_layers", 2))
    assert "holds the layers 0, 7, which are not 0..1" in cli_error(capsys, monkeypatch, *generate("checkpoint", d))


# ---------------------------------------------------------------------------------------------
# Memory: estimated from the config's numbers, refused with the field, value, estimate and a fit
# ---------------------------------------------------------------------------------------------

def test_a_config_larger_than_the_machine_is_refused_before_loading(refused):
    """Within every bound, but terabytes: refused from the estimate, naming what drives it."""
    drivers = {"tb-vocab": "vocab_size = 16777216 x hidden_size = 16384 makes the embedding table 1.10 TB",
               "tb-layers": "num_hidden_layers = 2 layers of 825 GB each (hidden_size = 65536, "
                            "intermediate_size = 1048576, num_attention_heads = 4)"}
    for name, driver in drivers.items():
        d, message = refused[name]
        assert message.startswith(f"{d / 'config.json'}: the model's weights need about ") and driver in message
        assert "is available on this machine" in message and "max_memory (--max-memory SIZE" in message


def test_learned_positions_can_drive_the_estimate(tmp_path):
    cfg = ModelConfig(vocab_size=257, context_length=2**24, d_model=2**14, n_layers=2, n_heads=4)
    with pytest.raises(ValueError, match=r"n_positions = 16777216 x n_embd = 16384 makes the learned position "
                                         r"table 1.10 TB"):
        memory.check_fits(cfg, 4, dtype="float32", names={"context_length": "n_positions", "d_model": "n_embd"})


def test_max_memory_refuses_or_allows_and_names_what_fits(tmp_path, capsys, monkeypatch):
    d = hf_dir(tmp_path / "h")                                  # float32 weights
    need = memory.parameter_count(tiny().config) * 4
    with pytest.raises(ValueError) as info:
        hf.load_pretrained(d, max_memory=need // 2 + 1)
    message = str(info.value)
    assert (f"the model's weights need about {memory.format_bytes(need)} in float32, but "
            f"{memory.format_bytes(need // 2 + 1)} is allowed by max_memory") in message
    assert f"in bf16 it would take {memory.format_bytes(need // 2)} (load with dtype='bf16', --dtype bf16)" in message
    half = hf.load_pretrained(d, dtype="bf16", max_memory=need // 2 + 1)
    assert next(half.parameters()).dtype == torch.bfloat16
    assert hf.load_pretrained(d, max_memory="1GiB") is not None
    with pytest.raises(ValueError, match="which does not fit either"):
        hf.load_pretrained(d, max_memory=need // 4)
    line = cli_error(capsys, monkeypatch, *generate("hf", d), "--max-memory", "1KB")
    assert "is allowed by max_memory" in line and "1.00 KB" in line
    line = cli_error(capsys, monkeypatch, *generate("checkpoint", model_dir(tmp_path / "m")), "--max-memory", "lots")
    assert "max_memory: expected a size such as 8GB, 512MiB or a number of bytes, got 'lots'" in line
    assert main(list(generate("checkpoint", tmp_path / "m")) + ["--max-memory", "1GB"]) == 0


def test_sizes_parse_and_the_machine_reports_its_memory():
    assert memory.parse_size("8GB") == 8 * 10**9 and memory.parse_size("8GiB") == memory.parse_size("8g") == 8 * 2**30
    assert memory.parse_size(" 1.5 MiB ") == 3 * 2**19 and memory.parse_size(4096) == 4096
    for bad in ("", "-1GB", "8 parsecs", "0", True, 1.5, None):
        with pytest.raises(ValueError, match="max_memory: expected a size"):
            memory.parse_size(bad)
    available = memory.available_memory()
    assert available is None or available > 0
    assert memory.available_memory("meta") is None


# ---------------------------------------------------------------------------------------------
# Lean loading: a cast reads slices of rows into the final tensor
# ---------------------------------------------------------------------------------------------

def test_a_sliced_cast_equals_the_whole_cast_and_still_finds_nan(tmp_path, monkeypatch):
    d = hf_dir(tmp_path / "h")
    whole = hf.load_pretrained(d, dtype="bf16")
    monkeypatch.setattr(tensor_files, "SLICE_BYTES", 100)       # every matrix in slices of a row or so
    sliced = hf.load_pretrained(d, dtype="bf16")
    for (name, a), b in zip(whole.state_dict().items(), sliced.state_dict().values()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name
    state = load_file(str(d / hf.SAFETENSORS))
    state["model.embed_tokens.weight"][200, 3] = float("nan")   # in a late slice
    save_file(state, str(d / hf.SAFETENSORS))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model.embed_tokens.weight holds 1 NaN"):
        hf.load_pretrained(d, dtype="fp16")


# ---------------------------------------------------------------------------------------------
# PEFT adapters: adapter_config.json and every tensor's shape checked before anything is built
# ---------------------------------------------------------------------------------------------

def adapter_dir(path: Path, r: int = 4) -> Path:
    from logitlab.train.lora import LoRAConfig, apply_lora
    from logitlab.train.lora_peft import save_peft_adapter

    model = tiny()
    apply_lora(model, LoRAConfig(r=r, targets=("q_proj", "v_proj", "down_proj")))
    return save_peft_adapter(model, path)


HOSTILE_ADAPTERS = [
    ({"r": 10**9}, "{path}: r = 1000000000 exceeds the width of v_proj (16 x 32)"),
    ({"r": 33}, "{path}: r = 33 exceeds the width of v_proj (16 x 32)"),
    ({"r": "four"}, "'r' in {path}: expected an integer, got 'four'"),
    ({"r": 0}, "{path}: LoRA rank r must be a positive integer, got 0"),
    ({"r": True}, "'r' in {path}: expected an integer, got True"),
    ({"lora_alpha": "16"}, "'lora_alpha' in {path}: expected a finite number, got '16'"),
    ({"lora_alpha": -1}, "{path}: LoRA alpha must be > 0, got -1.0"),
    ({"lora_dropout": 1.5}, "{path}: LoRA dropout must be in [0, 1), got 1.5"),
    ({"target_modules": ["q_proj", "wq"]}, "{path}: LoRA targets ['wq'] are not among"),
    ({"target_modules": 7}, "'target_modules' in {path}: expected a list of strings or a string, got 7"),
    ({"use_dora": True}, "{path}: use_dora = True is not supported"),
    ({"rank_pattern": {"q_proj": 64}}, '{path}: rank_pattern = {"q_proj": 64} is not supported'),
    ({"peft_type": "IA3"}, "{path}: not a PEFT LoRA config (peft_type must be 'LORA', got 'IA3')"),
    ({}, "loaded"),
]


def test_a_hostile_adapter_config_is_named_before_anything_is_built(refused):
    """Before: r = 10**9 built the adapters first and tried to allocate 256 GB; "four" gave
    "invalid literal for int()"."""
    for i, (_, message) in enumerate(HOSTILE_ADAPTERS):
        d, got = refused[f"adapter{i}"]
        assert message.replace("{path}", str(d / "adapter_config.json")) in got, got


def test_an_adapter_tensor_of_the_wrong_shape_or_name_is_named(tmp_path):
    from logitlab.train.lora_peft import load_peft_adapter

    d = adapter_dir(tmp_path / "a")
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    state = load_file(str(d / "adapter_model.safetensors"))
    good = dict(state)
    state[key] = torch.zeros(32, 10**4)                         # its r would be 10,000
    save_file(state, str(d / "adapter_model.safetensors"))
    model = tiny()
    with pytest.raises(ValueError, match=rf"adapter_model.safetensors: tensor {re.escape(key)} has shape "
                                         r"\(32, 10000\), the model with r = 4 expects \(32, 4\)"):
        load_peft_adapter(model, d)
    assert not any("lora" in name for name, _ in model.named_parameters())   # nothing was built
    state = dict(good, **{"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)})
    save_file(state, str(d / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected \['base_model.model.model.layers.5.self_attn.q_proj"):
        load_peft_adapter(model, d)
    save_file(good, str(d / "adapter_model.safetensors"))
    assert load_peft_adapter(model, d) == ["blocks.0.attn.qkv_proj", "blocks.0.mlp.down_proj",
                                           "blocks.1.attn.qkv_proj", "blocks.1.mlp.down_proj"]
    assert json.loads((d / "adapter_config.json").read_text())["r"] == 4


# ---------------------------------------------------------------------------------------------
# Every way in: quantized directories, MoE configs, and each command's MODEL --max-memory
# ---------------------------------------------------------------------------------------------

def test_a_quantized_directory_is_counted_by_its_own_bytes_and_still_checked(tmp_path):
    """The estimate of a quantized directory is its int8 values and bf16 scales (quant.apply's
    weight_bytes), not the dense weights the config's numbers describe; NaN in a quantized
    layer's scales and a truncated file are still named."""
    from logitlab.quant.apply import quantize_model, weight_bytes
    from logitlab.quant.linear import QuantConfig

    model = tiny().to(torch.bfloat16).eval()
    quantize_model(model, QuantConfig("int8"))
    ck.save_model(model, tmp_path / "q")
    dense, own = memory.parameter_count(model.config) * 2, weight_bytes(model.config, QuantConfig("int8"))
    assert own < dense
    loaded = ck.load_model(tmp_path / "q", max_memory=(own + dense) // 2).eval()   # the dense estimate would not fit
    ids = torch.randint(0, 257, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    with pytest.raises(ValueError) as info:
        ck.load_model(tmp_path / "q", max_memory=own - 1)
    assert f"need about {memory.format_bytes(own)} in bfloat16, but" in str(info.value)
    assert "is allowed by max_memory: n_layers = 2 layers of" in str(info.value)
    path, key = tmp_path / "q" / ck.WEIGHTS_FILE, "blocks.1.mlp.down_proj.scales"
    state = load_file(str(path))
    state[key][3] = float("nan")
    save_file(state, str(path), metadata={"format": ck.MODEL_FORMAT})
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: tensor {key} holds 1 NaN / inf values"):
        ck.load_model(tmp_path / "q")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: not a valid safetensors file"):
        ck.load_model(tmp_path / "q")


def test_an_moe_config_is_bounded_and_its_estimate_names_the_experts():
    from logitlab.model.families import config_to_hf, get_preset
    from logitlab.model.hf_config_moe import config_from_hf, hf_field_names

    for preset, experts, width in (("qwen3-30b-a3b", "num_experts = 128", "moe_intermediate_size = 768"),
                                   ("mixtral-8x7b", "num_local_experts = 8", "intermediate_size = 14336")):
        raw = config_to_hf(get_preset(preset), dtype="bfloat16")
        config = config_from_hf(raw)
        assert memory.parameter_count(config) == memory.parameter_count(get_preset(preset))
        with pytest.raises(ValueError) as info:
            memory.check_fits(config, 2, dtype="bfloat16", names=hf_field_names(raw), max_memory="1GB")
        assert f"num_hidden_layers = {config.n_layers} layers of" in str(info.value), info.value
        assert f"(hidden_size = {config.d_model}, {experts}, {width}, num_attention_heads" in str(info.value)
        key = "num_experts" if "num_experts =" in experts else "num_local_experts"
        with pytest.raises(ValueError, match=rf"config.json: {key} = 1000000000 is beyond logitlab's bound of "
                                             rf"{SIZE_LIMITS['n_experts']}"):
            config_from_hf({**raw, key: 10**9})
    assert {"num_experts", "num_local_experts", "moe_intermediate_size"} <= set(HF_SIZES)


def test_a_latent_attention_config_is_bounded_by_name():
    """DeepSeek-V3's latent widths are sizes too: a hostile one is refused, named, before anything
    is built."""
    from logitlab.model.families import config_to_hf, get_preset
    from logitlab.model.hf_config_moe import config_from_hf

    raw = config_to_hf(get_preset("deepseek-v3"), dtype="bfloat16")
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        with pytest.raises(ValueError, match=rf"{key} = 1000000000 is beyond logitlab's bound of {SIZE_LIMITS[key]}"):
            config_from_hf({**raw, key: 10**9})


LOADING_COMMANDS = [   # every command that loads weights, with what it needs besides MODEL
    ("generate", "hi"), ("chat",), ("inspect", "hi"), ("convert", "--out", "{tmp}/out"),
    ("convert", "--out", "{tmp}/q", "--quantize", "int8"), ("convert", "--out", "{tmp}/m.gguf", "--gguf", "Q8_0"),
    ("eval bpb", "--data", "{tmp}/t.txt"), ("eval mc",), ("eval long", "--data", "{tmp}/t.txt"), ("serve",),
    ("sft", "--data", "{tmp}/c.jsonl", "--out", "{tmp}/sft"),
]


def test_every_command_that_loads_weights_takes_max_memory(tmp_path, capsys, monkeypatch):
    """MODEL --max-memory SIZE on each command reaches the loader (a refusal naming max_memory);
    params reads a config alone and has no such flag."""
    d = model_dir(tmp_path / "m")
    (tmp_path / "t.txt").write_text("some text\n")
    (tmp_path / "c.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    for command, *extra in LOADING_COMMANDS:
        argv = [*command.split(), str(d), *(a.format(tmp=tmp_path) for a in extra), "--max-memory", "1KB"]
        line = cli_error(capsys, monkeypatch, *argv)
        assert "1.00 KB is allowed by max_memory" in line, (argv, line)
    with pytest.raises(SystemExit):
        main(["params", str(d), "--max-memory", "1KB"])
    assert "unrecognized arguments: --max-memory" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_an_expert_count_no_tensor_backs_is_named_before_a_name_is_made(tmp_path, layout):
    """num_local_experts = 16000 over a file of 8 experts took 8 s to build 192,000 expected names
    and then named a missing tensor; now the count is compared with the experts the file holds
    (per expert: experts.{j}.*; fused: the first dimension of experts.gate_up_proj) and named."""
    from logitlab.model.families import get_preset, state_dict_to_hf
    from logitlab.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(get_preset("moe-tiny")).eval()
    d = hf.save_pretrained(model, tmp_path / "moe")
    if layout == "fused":
        save_file(state_dict_to_hf(model.state_dict(), model.config, expert_layout="fused"), str(d / hf.SAFETENSORS))
    ids = torch.randint(0, 200, (1, 6))
    with torch.no_grad():      # read into aligned memory: the same kernels as the model's, bit for bit
        assert torch.equal(hf.load_pretrained(d, mmap=False)(ids), model(ids))
    for experts, held in ((16000, "experts 0..7 only (8 experts)"), (4, "experts 0..7 (8 experts)")):
        edit_json(d / "config.json", lambda p: p.update(num_local_experts=experts))
        with pytest.raises(ValueError) as info:
            hf.load_pretrained(d)
        assert str(info.value) == (f"{d / 'config.json'}: num_local_experts = {experts}, but "
                                   f"{d / hf.SAFETENSORS} holds {held}")


def test_a_hub_model_that_cannot_load_is_refused_before_its_weights_download(tmp_path, monkeypatch):
    """A hub id's config.json comes first and is checked (bounds, memory in the dtype asked for or
    the one it declares); its weights are fetched only when it passes."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from _hub import add_snapshot, use_cache

    from logitlab.io.loading import load_model_and_tokenizer

    cache = tmp_path / "cache"
    use_cache(monkeypatch, cache)
    add_snapshot(cache, "org/small", hf_dir(tmp_path / "small"))
    big = hf_dir(tmp_path / "big")
    edit_json(big / "config.json", lambda p: p.update(vocab_size=2**24, hidden_size=2**14, torch_dtype="bfloat16"))
    add_snapshot(cache, "org/big", big)
    asked, fetch = [], huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: asked.append(k.get("allow_patterns")) or fetch(*a, **k))
    with pytest.raises(ValueError) as info:
        hf.load_pretrained("org/big")
    assert "config.json: the model's weights need about " in str(info.value) and " in bfloat16, but" in str(info.value)
    assert "vocab_size = 16777216 x hidden_size = 16384" in str(info.value)
    assert asked == [["config.json"]]                                   # no weights were fetched
    asked.clear()
    with pytest.raises(ValueError, match="1.00 KB is allowed by max_memory"):
        load_model_and_tokenizer("org/small", max_memory="1KB")
    assert asked == [["config.json"]]
    asked.clear()
    loaded = load_model_and_tokenizer("org/small", dtype="bf16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16 and len(asked) == 2 and asked[0] == ["config.json"]


def test_an_moe_adapter_is_checked_before_anything_is_built(tmp_path):
    """PEFT's target_parameters (an MoE's stacked experts) go through the same checks: names,
    the rank against the experts' widths, every tensor's shape (A is (E * r, in), B (out, r * E))."""
    from logitlab.model.families import get_preset
    from logitlab.model.transformer import Transformer
    from logitlab.train.lora import LoRAConfig, apply_lora
    from logitlab.train.lora_peft import load_peft_adapter, save_peft_adapter

    torch.manual_seed(0)
    cfg = get_preset("moe-tiny")
    trained = Transformer(cfg)
    apply_lora(trained, LoRAConfig(r=4, targets=("q_proj", "experts.gate_up_proj", "experts.down_proj")))
    d = save_peft_adapter(trained, tmp_path / "a")
    config, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    good_config, good = json.loads(config.read_text()), load_file(str(weights))
    for edit, message in (({"target_parameters": ["mlp.experts.w9"]}, "target_parameters ['mlp.experts.w9'] are "
                                                                        "not among ['mlp.experts.gate_up_proj'"),
                          ({"r": 10**9}, "r = 1000000000 exceeds the width of")):
        config.write_text(json.dumps({**good_config, **edit}))
        with pytest.raises(ValueError, match=re.escape(f"{config}: {message}")):
            load_peft_adapter(Transformer(cfg), d)
    config.write_text(json.dumps(good_config))
    key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"
    save_file({**good, key: torch.zeros(cfg.n_experts * 4 + 1, cfg.d_model)}, str(weights))
    model = Transformer(cfg)
    with pytest.raises(ValueError, match=rf"tensor {re.escape(key)} has shape \({cfg.n_experts * 4 + 1}, "):
        load_peft_adapter(model, d)
    assert not any("lora" in name for name, _ in model.named_parameters())   # nothing was built
    save_file(good, str(weights))
    assert "blocks.1.mlp.experts" in load_peft_adapter(model, d)
