"""Loading with mmap=True (the default): tensors kept as stored are private, copy-on-write
mappings of the file. The model equals the one read into its own memory (mmap=False) bit for bit,
writes to it never reach the file, NaN is still refused by tensor and file, and mmap=False holds
no mapping at all."""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_load_errors import CONFIG, HF_Q, shard, tokenizer

from logitlab.io import checkpoint as ck
from logitlab.io import hf
from logitlab.io import tensors as tensor_files
from logitlab.model import ModelConfig, Transformer

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mappings in /proc/self/maps")
LLAMA = {**CONFIG, "tie_embeddings": False}
GPT2 = dict(vocab_size=300, context_length=64, d_model=64, n_layers=2, n_heads=4, d_ff=256, norm="layernorm",
            mlp="gelu", positions="learned", bias=True, qkv_bias=True, tie_embeddings=True)


@pytest.fixture(autouse=True)
def map_every_tensor(monkeypatch):
    """Tiny tensors are mapped too (by default only those of MAP_MIN_BYTES and more are)."""
    monkeypatch.setattr(tensor_files, "MAP_MIN_BYTES", 1)


def hf_dir(path: Path, config: dict = LLAMA, dtype=torch.float32) -> Path:
    torch.manual_seed(0)
    hf.save_pretrained(Transformer(ModelConfig(**config)).to(dtype), path, tokenizer())
    return path


def mapped_files(under: Path) -> list[str]:
    """The files under `under` that this process has mapped with the private, writable mappings
    that mmap=True makes (models other tests left alive map their own files)."""
    return [line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if line.split()[1] == "rw-p" and line.rstrip().endswith(".safetensors")
            and line.split(maxsplit=5)[5].strip().startswith(str(under))]


def resident_kib_of(tensor: torch.Tensor) -> int:
    """The resident KiB of the mappings (/proc/self/smaps) that hold `tensor`'s bytes."""
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:                     # a mapping's first line
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and b > lo
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))}


def assert_same(a: Transformer, b: Transformer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@linux
@pytest.mark.parametrize("config, dtype", [(LLAMA, torch.float32), (LLAMA, torch.bfloat16), (GPT2, torch.float32)],
                         ids=["llama-fp32", "llama-bf16", "gpt2"])
def test_a_mapped_load_equals_the_read_one_bit_for_bit(tmp_path, config, dtype):
    d = hf_dir(tmp_path / "h", config, dtype)
    read = hf.load_pretrained(d, mmap=False)
    assert not mapped_files(tmp_path)                                   # mmap=False holds no mapping
    mapped = hf.load_pretrained(d)                              # the default maps
    assert_same(read, mapped)
    assert mapped_files(tmp_path) and set(mapped_files(tmp_path)) == {str(d / hf.SAFETENSORS)}
    ids = torch.randint(0, config["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():    # the same weights; a BLAS kernel may round by an ulp on their alignment
        torch.testing.assert_close(read(ids), mapped(ids), rtol=0, atol=1e-6)
    del mapped
    gc.collect()
    assert not mapped_files(tmp_path)                                   # each mapping went with its tensor


def mapped_parameters(model: Transformer, name: str = hf.SAFETENSORS) -> set[str]:
    """The parameters of `model` whose memory lies in this process's mappings of files called `name`."""
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(name)]
    spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps]
    return {n for n, p in model.named_parameters() if any(a <= p.data_ptr() < b for a, b in spans)}


def file_bytes(tensor: torch.Tensor, name: str = hf.SAFETENSORS) -> int:
    """How many of `tensor`'s bytes lie on pages this process maps from files called `name`."""
    lo, hi, total = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(name):
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            total += max(0, min(b, hi) - max(a, lo))
    return total


@linux
def test_only_tensors_kept_as_stored_stay_mapped(tmp_path):
    """Tensors kept as stored and the fused projections' parts are pages of the file (gate/up, back
    to back in a sorted file, entirely); a cast reads every tensor."""
    d = hf_dir(tmp_path / "h")
    model = hf.load_pretrained(d, mmap=True)
    inside = mapped_parameters(model)
    assert "blocks.0.attn.o_proj.weight" in inside and "tok_emb.weight" in inside and "lm_head.weight" in inside
    assert all(file_bytes(b.mlp.gate_up_proj.weight) == b.mlp.gate_up_proj.weight.nbytes for b in model.blocks)
    # the untied token table, checked for NaN, is let go again: its pages count in the resident
    # memory from their first use on; the rest, read whole by any forward pass, stays
    assert resident_kib_of(model.tok_emb.weight) == 0 and resident_kib_of(model.lm_head.weight) > 0
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert resident_kib_of(model.tok_emb.weight) > 0
    del model
    gc.collect()
    cast = hf.load_pretrained(d, dtype="bf16", mmap=True)
    assert next(cast.parameters()).dtype == torch.bfloat16 and not mapped_files(tmp_path)
    assert_same(hf.load_pretrained(d, dtype="bf16", mmap=False), cast)     # sliced from the mapping, or read


def test_writes_to_a_mapped_model_never_reach_the_file(tmp_path):
    d = hf_dir(tmp_path / "h")
    before = digest(d)
    model = hf.load_pretrained(d, mmap=True).train()
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)                          # in place, on a mapped tensor
    original = hf.load_pretrained(d, mmap=False)
    assert torch.equal(model.tok_emb.weight, original.tok_emb.weight + 1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    optimizer.step()
    assert not torch.equal(model.blocks[0].attn.o_proj.weight, original.blocks[0].attn.o_proj.weight)
    assert digest(d) == before
    assert_same(hf.load_pretrained(d, mmap=True), original)


@linux
def test_a_replaced_file_leaves_a_mapped_model_as_it_was(tmp_path):
    """A file replaced by a rename (how logitlab, huggingface_hub and most tools write) keeps the
    old file's pages for the model that maps them; deleting it does too."""
    d = hf_dir(tmp_path / "h")
    model = hf.load_pretrained(d, mmap=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    state = load_file(str(d / hf.SAFETENSORS))
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, str(d / "new.safetensors"))
    (d / "new.safetensors").replace(d / hf.SAFETENSORS)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    (d / hf.SAFETENSORS).unlink()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_a_load_without_mmap_does_not_depend_on_the_file(tmp_path):
    """Truncating a file under a mapped model would kill the process (SIGBUS); under one loaded
    with mmap=False it changes nothing, since every tensor was copied."""
    d = hf_dir(tmp_path / "h")
    model = hf.load_pretrained(d, mmap=False)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with open(d / hf.SAFETENSORS, "r+b") as f:
        f.truncate(0)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nan_in_a_mapped_tensor_is_refused_by_tensor_and_file(tmp_path, bad):
    d = hf_dir(tmp_path / "h")
    state = load_file(str(d / hf.SAFETENSORS))
    # a mapped tensor, a fused projection's rows read, and its rows mapped (gate_proj then up_proj)
    for key in ("lm_head.weight", HF_Q, "model.layers.1.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        broken = dict(state)
        broken[key] = broken[key].clone()
        broken[key][2, 3] = bad
        save_file(broken, str(tmp_path / "new"), metadata={"format": "pt"})
        (tmp_path / "new").replace(d / hf.SAFETENSORS)
        for dtype in (None, "bf16"):                           # kept mapped, or cast from the mapping
            with pytest.raises(ValueError, match=rf"{d / hf.SAFETENSORS}: tensor {key} holds 1 NaN / inf values"):
                hf.load_pretrained(d, dtype=dtype, mmap=True)


def test_a_sharded_checkpoint_maps_each_shard(tmp_path):
    d = hf_dir(tmp_path / "h")
    shard(d)
    assert (d / hf.SAFETENSORS_INDEX).is_file() and len(list(d.glob("model-*.safetensors"))) == 2
    assert_same(hf.load_pretrained(d, mmap=False), hf.load_pretrained(d))
    if sys.platform.startswith("linux"):
        model = hf.load_pretrained(d, mmap=True)                # noqa: F841  (held while the maps are read)
        assert {Path(p).name for p in mapped_files(tmp_path)} == {p.name for p in d.glob("model-*.safetensors")}


def test_a_logitlab_directory_maps_too(tmp_path):
    torch.manual_seed(0)
    ck.save_model(Transformer(ModelConfig(**LLAMA)), tmp_path / "m")
    assert_same(hf.load_pretrained(tmp_path / "m", mmap=False), hf.load_pretrained(tmp_path / "m"))


@linux
def test_q_k_v_apart_in_the_file_are_mapped_but_where_they_meet(tmp_path):
    """With o_proj between k_proj and q_proj, each of q, k, v whose rows fill whole pages is mapped
    over the pages it alone covers; at most the pages where two parts meet are read. NaN in any of
    them (a read page or a mapped one) is still refused by tensor and file."""
    config = {**LLAMA, "d_model": 64, "d_ff": 128}                # q 16 KiB, k and v 8 KiB each in fp32
    d = hf_dir(tmp_path / "h", config)
    model = hf.load_pretrained(d)
    assert_same(hf.load_pretrained(d, mmap=False), model)
    for block in model.blocks:
        assert block.attn.qkv_proj.weight.nbytes - file_bytes(block.attn.qkv_proj.weight) <= 2 * 4096
    state = load_file(str(d / hf.SAFETENSORS))
    for key, row in (("model.layers.1.self_attn.k_proj.weight", 0), ("model.layers.0.self_attn.q_proj.weight", 9)):
        broken = {k: v.clone() for k, v in state.items()}
        broken[key][row, 1] = float("nan")
        save_file(broken, str(tmp_path / "new"), metadata={"format": "pt"})
        (tmp_path / "new").replace(d / hf.SAFETENSORS)
        with pytest.raises(ValueError, match=rf"tensor {key} holds 1 NaN / inf values"):
            hf.load_pretrained(d)


def write_in_order(path: Path, state: dict[str, torch.Tensor], order: list[str]) -> None:
    """A safetensors file whose tensors lie in the file in `order` (safetensors' own writer sorts
    them by name): what another tool may write."""
    header, data, at = {"__metadata__": {"format": "pt"}}, [], 0
    for key in order:
        raw = state[key].contiguous().view(torch.uint8).numpy().tobytes()
        dtype = {torch.float32: "F32", torch.bfloat16: "BF16"}[state[key].dtype]
        header[key] = {"dtype": dtype, "shape": list(state[key].shape), "data_offsets": [at, at + len(raw)]}
        data.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(data))


@linux
def test_fused_parts_in_another_order_or_in_two_shards_load_the_same_model(tmp_path):
    """up_proj before gate_proj (laid out from the pages of each), or gate_proj and up_proj in two
    shards (read into fresh memory part by part): the model is the same."""
    d = hf_dir(tmp_path / "h")
    reference = hf.load_pretrained(d, mmap=False)
    state = load_file(str(d / hf.SAFETENSORS))
    write_in_order(tmp_path / "new", state, sorted(state, key=lambda k: k.replace("up_proj", "a_up_proj")))
    (tmp_path / "new").replace(d / hf.SAFETENSORS)
    model = hf.load_pretrained(d, mmap=True)
    assert_same(reference, model)
    del model
    gc.collect()
    (d / hf.SAFETENSORS).unlink()                 # two shards: layer 1's up_proj alone in the second
    up = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != up}, str(d / "a.safetensors"))
    save_file({up: state[up]}, str(d / "b.safetensors"))
    weight_map = {k: "b.safetensors" if k == up else "a.safetensors" for k in state}
    (d / hf.SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = hf.load_pretrained(d, mmap=True)
    assert_same(reference, model)
    inside = mapped_parameters(model, ".safetensors")
    assert "blocks.0.mlp.gate_up_proj.weight" in inside and "blocks.1.mlp.gate_up_proj.weight" not in inside
    assert file_bytes(model.blocks[1].mlp.gate_up_proj.weight, ".safetensors") == 0


def test_a_tensor_that_cannot_be_mapped_is_read(tmp_path):
    """Data not aligned to its element size (a file written by another tool) is read instead."""
    values = torch.arange(6, dtype=torch.float32)
    header = {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)                         # the data starts 8-byte aligned: x does not
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\x07" + values.numpy().tobytes())
    with tensor_files.open_safetensors(path) as f:
        assert f.map_tensor("x", (2, 3), torch.float32) is None
        got = tensor_files.read_tensor(f, path, "x", (2, 3), torch.float32, finite=True, mapped=True)
    assert torch.equal(got, values.view(2, 3))


@linux
def test_the_mmap_flag_reaches_the_loader_and_gives_the_same_tokens(tmp_path, capsys, monkeypatch):
    from logitlab.cli.main import main
    from logitlab.io import loading
    from logitlab.io.loading import load_model_and_tokenizer

    d = hf_dir(tmp_path / "hf")
    loaded = load_model_and_tokenizer(d, mmap=True)
    assert any(f.endswith(hf.SAFETENSORS) for f in mapped_files(tmp_path))
    ids = torch.tensor([[5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), load_model_and_tokenizer(d, mmap=False).model(ids),
                                   rtol=0, atol=1e-6)
    del loaded
    gc.collect()
    asked = []
    monkeypatch.setattr(loading, "load_model_and_tokenizer",
                        lambda *a, **k: asked.append(k.get("mmap")) or load_model_and_tokenizer(*a, **k))
    outputs = []
    for flags in ([], ["--mmap"], ["--no-mmap"]):
        assert main(["generate", str(d), "ab", "--max-new-tokens", "4", "--temperature", "0", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert asked == [True, True, False]
    assert outputs[0] == outputs[2]
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_finite_checks_report_the_first_bad_tensor_in_the_order_queued():
    def job(name, bad):
        def run():
            if bad:
                raise ValueError(f"tensor {name} holds NaN")
        return run

    with pytest.raises(ValueError, match="tensor b holds NaN"):
        with tensor_files.FiniteChecks(workers=2) as finite:
            for name, bad in (("a", False), ("b", True), ("c", True)):
                finite.queue(job(name, bad))


def test_finite_checks_hold_at_most_queue_bytes_of_tensors(monkeypatch):
    """A job that holds a tensor the loader has done with waits for older ones first, so the
    tensors held for checking stay under QUEUE_BYTES; a mapping's job (held 0) never waits."""
    import threading

    monkeypatch.setattr(tensor_files.FiniteChecks, "QUEUE_BYTES", 100)
    release, done = threading.Event(), []
    with tensor_files.FiniteChecks(workers=2) as finite:
        finite.queue(lambda: (release.wait(), done.append("first")), held=60)
        finite.queue(lambda: done.append("mapped"), held=0)
        threading.Timer(0.05, release.set).start()
        finite.queue(lambda: done.append("second"), held=60)      # 120 > 100: waits for the first
        assert "first" in done
    assert sorted(done) == ["first", "mapped", "second"]


def test_finite_checks_on_one_worker_run_at_once_and_an_error_drops_the_queue():
    ran = []
    finite = tensor_files.FiniteChecks(workers=1)
    finite.queue(lambda: ran.append(1))
    assert ran == [1]
    with pytest.raises(KeyError):                       # the loader's own error is the one raised
        with tensor_files.FiniteChecks(workers=2) as finite:
            finite.queue(lambda: (_ for _ in ()).throw(ValueError("not this one")))
            raise KeyError("this one")


def test_nan_in_two_tensors_names_the_first_the_loader_reads(tmp_path):
    d = hf_dir(tmp_path / "h")
    state = load_file(str(d / hf.SAFETENSORS))
    broken = {k: v.clone() for k, v in state.items()}
    for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        broken[key][0, 0] = float("nan")
    save_file(broken, str(d / "new.safetensors"), metadata={"format": "pt"})
    (d / "new.safetensors").replace(d / hf.SAFETENSORS)
    for mmap in (False, True):
        with pytest.raises(ValueError, match=r"tensor model\.layers\.0\.self_attn\.o_proj\.weight holds 1"):
            hf.load_pretrained(d, mmap=mmap)


QWEN3_5 = dict(vocab_size=97, context_length=64, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
               d_ff=96, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, qkv_bias=False,
               linear_n_k_heads=2, linear_n_v_heads=4, linear_k_head_dim=8, linear_v_head_dim=6, qk_norm=True,
               norm_zero_centered=True, attn_gate="elementwise", partial_rotary_factor=0.25, tie_embeddings=False,
               layer_types=("linear_attention",) * 3 + ("full_attention",))


@linux
def test_a_gated_q_proj_is_laid_out_head_by_head_into_q_and_the_gate(tmp_path):
    """Qwen3.5's q_proj holds, head by head, Dh query rows then Dh gate rows: mapped, each head's
    query rows (32 KiB in fp32 here, whole pages) land in qkv_proj and its gate rows in gate_proj,
    pages of the file but where two pieces meet; read, they go straight into the same rows. Both
    equal the conversion of the whole tensors (state_dict_from_hf), and NaN among the gate rows
    still names q_proj. (k_proj is read: q_norm, 128 bytes between o_proj and q_proj in the file,
    puts it out of line with q_proj and v_proj within a page.)"""
    from logitlab.model import families

    d = hf_dir(tmp_path / "h", QWEN3_5)
    state = load_file(str(d / hf.SAFETENSORS))
    expected = families.state_dict_from_hf(state, ModelConfig(**QWEN3_5))
    for mmap in (True, False):
        model = hf.load_pretrained(d, mmap=mmap)
        got = model.state_dict()
        for key in ("blocks.3.attn.qkv_proj.weight", "blocks.3.attn.gate_proj.weight"):
            assert torch.equal(got[key], expected[key]), (mmap, key)
        assert_same(model, hf.load_pretrained(d, mmap=not mmap))
    cast = hf.load_pretrained(d, dtype="bf16").state_dict()            # read a slice of rows at a time, cast
    for key in ("blocks.3.attn.qkv_proj.weight", "blocks.3.attn.gate_proj.weight"):
        assert torch.equal(cast[key], expected[key].to(torch.bfloat16)), key
    model = hf.load_pretrained(d)
    qkv, gate, k_bytes = model.blocks[3].attn.qkv_proj.weight, model.blocks[3].attn.gate_proj.weight, 64 * 256 * 4
    assert qkv.nbytes - file_bytes(qkv) <= k_bytes + 6 * 4096 and gate.nbytes - file_bytes(gate) <= 4 * 4096
    del model, qkv, gate
    q = "model.layers.3.self_attn.q_proj.weight"
    broken = {k: v.clone() for k, v in state.items()}
    broken[q][3 * 32 + 5, 0] = float("inf")                     # head 1's gate rows: 32..63 of 64 per head
    save_file(broken, str(tmp_path / "new"), metadata={"format": "pt"})
    (tmp_path / "new").replace(d / hf.SAFETENSORS)
    for mmap in (True, False):
        with pytest.raises(ValueError, match=rf"tensor {q} holds 1 NaN / inf values"):
            hf.load_pretrained(d, mmap=mmap)
