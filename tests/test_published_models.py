"""Public checkpoints, by hub id, from their published config.json (tests/_published_configs.py).

For each supported checkpoint, transformers builds the model from exactly its published config
(every width, head count, vocabulary, RoPE setting and tie flag) but with 2 layers, with seeded
random weights; its safetensors and the published config.json go into a hub cache on disk, and
`logitlab.load_pretrained(ORG/NAME)` loads it by id, offline. Every hidden state and the logits must
agree with transformers' within logitlab's verify tolerance (float32), and greedy decoding must give
transformers' generate tokens. Unsupported checkpoints fail with the error docs/models.md gives.

The large vocabularies make most of these memory-heavy (Llama-3.2-1B: 128256 x 2048; Mistral-7B
with 2 layers: 0.7 B parameters), so only the two smallest run by default; `pytest -m slow` runs
the whole table, and a check skips, saying so, where the machine has too little memory free.
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import pytest
import torch

from logitlab.generate import SampleConfig, generate
from logitlab.io import hf
from logitlab.model.families import PRESETS, config_from_hf
from tests._hub import add_snapshot, use_cache
from tests._published_configs import BY_ID, PUBLISHED, published_config, two_layer_config

pytest.importorskip("huggingface_hub")
ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = [p for p in PUBLISHED if p.refused is None]
REFUSED = [p for p in PUBLISHED if p.refused is not None]
# The presets that state the same published shapes (families.py)
PRESET_OF = {"gpt2": "gpt2", "Qwen/Qwen3-0.6B": "qwen3-0.6b", "meta-llama/Llama-3.2-1B": "llama3.2-1b",
             "Qwen/Qwen3.5-0.8B": "qwen3.5-0.8b"}


def _parity_params():
    return [pytest.param(p.repo_id, id=p.repo_id, marks=() if p.fast else pytest.mark.slow) for p in SUPPORTED]


# -------------------- the published configs themselves (no weights)

@pytest.mark.parametrize("published", SUPPORTED, ids=lambda p: p.repo_id)
def test_published_config_reads_with_its_shapes(published):
    config = config_from_hf(published_config(published.repo_id))
    hf_config = published.config.get("text_config", published.config)
    width = hf_config.get("hidden_size", hf_config.get("n_embd"))
    layers = hf_config.get("num_hidden_layers", hf_config.get("n_layer"))
    assert (config.vocab_size, config.d_model, config.n_layers) == (hf_config["vocab_size"], width, layers)
    tied = published.config.get("tie_word_embeddings", published.architecture == "GPT2LMHeadModel")
    assert config.tie_embeddings == tied
    if published.repo_id in PRESET_OF:
        assert config == PRESETS[PRESET_OF[published.repo_id]]


@pytest.mark.parametrize("published", REFUSED, ids=lambda p: p.repo_id)
def test_unsupported_configs_say_why(published):
    with pytest.raises(ValueError, match=published.refused):
        config_from_hf(published_config(published.repo_id))


def test_params_by_hub_id_reads_config_json_only(tmp_path, monkeypatch, capsys):
    """`logitlab params ORG/NAME` with only config.json in the cache: the published shapes for a
    supported checkpoint, the one-line reason for an unsupported one."""
    from logitlab.cli.main import main

    cache = tmp_path / "hub"
    for p in PUBLISHED:
        d = tmp_path / p.repo_id.replace("/", "--")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(p.config))
        add_snapshot(cache, p.repo_id, d)
    use_cache(monkeypatch, cache)
    assert main(["params", "Qwen/Qwen3-0.6B", "--json", "--tflops", "100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["d_model"] == 1024 and report["config"]["n_layers"] == 28
    assert report["exact"]["total"] == 596_049_920         # Qwen3-0.6B's published count, tied head once
    for p in (p for p in PUBLISHED if p.totals):       # mixtures of experts: total against active
        assert main(["params", p.repo_id, "--json", "--tflops", "100"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["exact"]["total"], report["exact"]["active"]) == p.totals, p.repo_id
    for p in REFUSED:
        assert main(["params", p.repo_id, "--tflops", "100"]) == 2
        err = capsys.readouterr().err
        assert re.search(p.refused, err) and "Traceback" not in err and len(err.strip().splitlines()) == 1


# -------------------- logits and greedy tokens against transformers, by hub id

def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def _reference_model(repo_id: str, config: dict):
    """transformers' model of the 2-layer published config, seeded random weights with the 1-D
    parameters (norm scales, biases, decays) moved off their initial values."""
    import transformers

    torch.manual_seed(0)
    if "text_config" in config:   # Qwen3.5: the causal LM of the image-text checkpoint's text_config
        text = {k: v for k, v in config["text_config"].items() if k != "model_type"}
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    else:
        hf_config = transformers.AutoConfig.for_model(**config)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _write_checkpoint(model, config: dict, directory: Path) -> None:
    """The weights as transformers saves them (Qwen3.5 renamed as its image-text checkpoint stores
    its language model), under the published config.json (2 layers)."""
    from safetensors.torch import save_file

    if "text_config" in config:
        tied = config["text_config"]["tie_word_embeddings"]
        state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
                 for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        directory.mkdir(parents=True)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2))


@torch.no_grad()
def _reference_outputs(model, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    out = model(input_ids=ids, output_hidden_states=True)
    prompt = ids[:1, :8]
    model.generation_config.eos_token_id = None      # the full length: logitlab's loop is given no end id
    model.generation_config.pad_token_id = 0
    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, 8:].tolist()
    return {"ids": ids, "hidden": [h.float() for h in out.hidden_states], "logits": out.logits.float(),
            "prompt": prompt[0].tolist(), "tokens": tokens}


def _need_memory(config: dict) -> None:
    text = config.get("text_config", config)
    vocab = text["vocab_size"]
    width = text.get("hidden_size", text.get("n_embd"))
    ff = text.get("intermediate_size", 4 * width)
    experts = text.get("num_experts", text.get("num_local_experts", 1))
    ff = experts * text.get("moe_intermediate_size", ff)
    tables = 1 if text.get("tie_word_embeddings", True) else 2
    params = tables * vocab * width + 2 * (4 * width * width + 3 * width * ff)
    need = int(params * 4 * 2.5)                       # one model, its file, the other model, activations
    if _available_bytes() < need:
        pytest.skip(f"needs about {need / 2**30:.1f} GiB free for two float32 copies, "
                    f"{_available_bytes() / 2**30:.1f} GiB available")


def _close(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, what verify allows: hf.TOLERANCE[float32] x max(1, max |want|))."""
    return float((got - want).abs().max()), hf.TOLERANCE[torch.float32] * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("repo_id", _parity_params())
def test_published_model_by_hub_id_matches_transformers(repo_id, tmp_path, monkeypatch):
    config = two_layer_config(repo_id)
    _need_memory(config)
    theirs = _reference_model(repo_id, config)
    vocab = config.get("text_config", config)["vocab_size"]
    want = _reference_outputs(theirs, vocab)
    _write_checkpoint(theirs, config, tmp_path / "src")
    del theirs
    gc.collect()
    add_snapshot(tmp_path / "hub", repo_id, tmp_path / "src")
    use_cache(monkeypatch, tmp_path / "hub")

    import logitlab

    ours = logitlab.load_pretrained(repo_id)               # by id, through huggingface_hub's cache, offline
    assert next(ours.parameters()).dtype == torch.float32 and ours.config.n_layers == 2
    with torch.no_grad():
        logits, hidden = ours.forward_with_hidden(want["ids"])
    assert len(hidden) == len(want["hidden"]) == 3
    for i, (a, b) in enumerate(zip(hidden, want["hidden"])):
        diff, allowed = _close(a.float(), b)
        assert diff <= allowed, f"hidden state {i}: max |diff| {diff:.2e} > {allowed:.2e}"
    diff, allowed = _close(logits.float(), want["logits"][..., :vocab])
    assert diff <= allowed, f"logits: max |diff| {diff:.2e} > {allowed:.2e}"
    got = generate(ours, want["prompt"], SampleConfig(max_new_tokens=8, temperature=0)).tokens[0]
    assert got == want["tokens"]


def test_every_checkpoint_is_in_the_docs_table():
    """docs/models.md names every checkpoint checked here, and the tests that check them."""
    page = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    for p in PUBLISHED:
        assert f"`{p.repo_id}`" in page, p.repo_id
    for name in ("test_published_model_by_hub_id_matches_transformers", "test_unsupported_configs_say_why",
                 "test_params_by_hub_id_reads_config_json_only"):
        assert name in page and name in globals()
    assert set(BY_ID) == {p.repo_id for p in PUBLISHED}
