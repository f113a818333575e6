"""The single-process parts of logitlab.parallel's N-D layouts: the fused projections split for
tensor parallelism, the layout checks, activation checkpointing, pipeline stages run in one
process, N-D gradient clipping, and sharded checkpoints' atomic writes and export."""

from __future__ import annotations

import _dist_nd as nd
import pytest
import torch
import torch.nn.functional as F

from logitlab import parallel
from logitlab.model.transformer import ModelConfig, Transformer
from logitlab.parallel import activation, pipeline, sharded, tensor
from logitlab.parallel.apply import clip_grad_norm_nd, parallelize
from logitlab.parallel.mesh import ParallelPlan


def _ids(B=2, T=16, seed=0):
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["tied", "qknorm"])
def test_split_projections_compute_the_same_and_join_back(kind):
    fused, split = nd.tiny_model(kind), tensor.split_fused_projections(nd.tiny_model(kind))
    x = _ids()
    torch.testing.assert_close(split(x), fused(x), atol=1e-6, rtol=1e-5)
    keys = set(split.state_dict())
    assert {"blocks.0.attn.q_proj.weight", "blocks.0.attn.v_proj.weight", "blocks.0.mlp.up_proj.weight"} <= keys
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys)
    joined = tensor.join_fused_state(split.state_dict())
    assert set(joined) == set(fused.state_dict())
    for k, v in fused.state_dict().items():
        assert torch.equal(joined[k], v), k
    from logitlab.io.model_dir import upgrade_legacy_state  # the legacy loader reads the same layout

    assert all(torch.equal(upgrade_legacy_state(split.state_dict())[k], v) for k, v in joined.items())


def test_tensor_parallel_checks_name_the_field():
    config = nd.tiny_model("tied").config
    tensor.check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match=r"n_kv_heads \(2\) must be divisible by tp \(4\)"):
        tensor.check_tensor_parallel(config, 4)
    hybrid = ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, d_ff=48, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False,
                         layer_types=("linear_attention", "full_attention"), linear_n_k_heads=2,
                         linear_n_v_heads=4, linear_k_head_dim=8, linear_v_head_dim=6)
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        tensor.check_tensor_parallel(hybrid, 2)
    learned = ModelConfig(**{**config.to_dict(), "positions": "learned"})
    with pytest.raises(ValueError, match="sequence parallel needs positions"):
        tensor.check_tensor_parallel(learned, 2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"seq_len \(15\) must be divisible by tp \(2\)"):
        tensor.check_tensor_parallel(config, 2, sequence_parallel=True, seq_len=15)


def test_plan_product_is_checked_naming_the_flags():
    assert ParallelPlan(tp=2, pp=2).resolve(8).dp_shard == 2
    with pytest.raises(ValueError, match=r"--pp 2 x --dp-replicate 1 x --dp-shard 2 x --tp 2 = 8, but the "
                                         r"world size is 4"):
        ParallelPlan(tp=2, pp=2, dp_shard=2).resolve(4)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by --pp 1 x --dp-replicate 1 x --tp 4"):
        ParallelPlan(tp=4).resolve(6)
    with pytest.raises(ValueError, match=r"tp \(--tp\) must be a positive integer"):
        ParallelPlan(tp=0)
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        ParallelPlan(sequence_parallel=True)
    with pytest.raises(ValueError, match="use 'fsdp' or 'zero2'"):
        ParallelPlan(parallel="zero1", tp=2).resolve(4)
    with pytest.raises(ValueError, match="interleaved schedule needs virtual_stages >= 2"):
        ParallelPlan(pp=2, pp_schedule="interleaved_1f1b")


def test_training_flags_choose_the_data_parallel_method_and_the_virtual_stages():
    """--parallel auto (the default): sharded data parallel as soon as the layout shards or cuts the
    model, so parallelism.md's `--tp 2 --pp 2 --dp-shard 2` needs no second flag; interleaved 1F1B
    gets 2 virtual stages unless told otherwise."""
    from logitlab.train.config import TrainConfig

    assert TrainConfig().parallel == "auto" and TrainConfig().parallel_plan().parallel == "ddp"
    assert TrainConfig(dp_shard=2).data_parallel == "fsdp" and TrainConfig(dp_replicate=2).data_parallel == "fsdp"
    three_d = TrainConfig(tp=2, pp=2, dp_shard=2).parallel_plan().resolve(8)
    assert (three_d.shape, three_d.parallel) == ((2, 1, 2, 2), "fsdp")
    assert TrainConfig(tp=2).parallel_plan().resolve(4).parallel == "fsdp"
    assert TrainConfig(parallel="zero2", dp_shard=2).data_parallel == "zero2"   # a method named is kept
    with pytest.raises(ValueError, match="plain data parallelism over every rank"):
        TrainConfig(parallel="ddp", tp=2, pp=2, dp_shard=2).parallel_plan().resolve(8)
    interleaved = TrainConfig(pp=2, pp_schedule="interleaved_1f1b").parallel_plan()
    assert (interleaved.virtual_stages, interleaved.microbatches()) == (2, 8)
    assert TrainConfig(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=3).parallel_plan().virtual_stages == 3
    assert TrainConfig(pp=2).parallel_plan().virtual_stages == 1
    with pytest.raises(ValueError, match=r"virtual_stages \(2\) must be >= 2 with pp_schedule interleaved_1f1b "
                                         r"and 1 with '1f1b'"):
        TrainConfig(pp=2, virtual_stages=2)
    with pytest.raises(ValueError, match=r"virtual_stages \(1\) must be >= 2"):
        TrainConfig(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=1)
    with pytest.raises(ValueError, match="dist_timeout must be > 0, got 0"):
        TrainConfig(dist_timeout=0)
    with pytest.raises(ValueError, match="parallel must be one of auto, none, ddp, zero1, zero2, fsdp, got 'hsdp'"):
        TrainConfig(parallel="hsdp")
    from logitlab.train.sharded_run import NDLayout

    cfg = TrainConfig(batch_size=8, pp=2, pp_schedule="interleaved_1f1b")   # 8 micro-batches per replica
    assert NDLayout(cfg, cfg.parallel_plan(), parallel.DistInfo(world_size=2)).plan.dp == 1
    with pytest.raises(ValueError, match=r"--pp 2: each of the 2 data-parallel replicas gets 4 rows of --batch-size 8, "
                                         r"which do not cut into 8 equal pipeline micro-batches .* multiple of 16"):
        NDLayout(cfg, cfg.parallel_plan(), parallel.DistInfo(world_size=4))


def _loss_and_grads(model, x):
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_keeps_values_and_saves_memory():
    x = _ids(B=4)
    results = {}
    for mode in activation.AC_MODES:
        model = activation.apply_activation_checkpointing(nd.tiny_model("untied"), mode)
        (loss, kept) = activation.saved_activation_bytes(
            lambda m=model: F.cross_entropy(m(x).flatten(0, 1), x.flatten()))
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept)
    ref_loss, ref_grads, _ = results["none"]
    for mode in ("selective", "full"):
        loss, grads, _ = results[mode]
        torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5)
    assert results["full"][2] < results["selective"][2] < results["none"][2]
    model = activation.apply_activation_checkpointing(nd.tiny_model("untied"), "full")
    assert set(model.state_dict()) == set(nd.tiny_model("untied").state_dict())   # keys unchanged
    with pytest.raises(ValueError, match="already applied"):
        activation.apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="activation_checkpointing must be one of"):
        activation.apply_activation_checkpointing(model, "some")


def test_pipeline_stages_chained_in_one_process_equal_the_model():
    model = tensor.split_fused_projections(nd.tiny_model("untied"))
    x = _ids()
    expected = model(x)
    stages = [m for _, m in pipeline.build_stages(model, 0, 1, virtual_stages=3)]
    assert [sorted(int(i) for i in s.blocks) for s in stages] == [[0, 1], [2], [3]]
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, expected, atol=0, rtol=0)
    assert pipeline.split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        pipeline.split_layers(2, 3)
    with pytest.raises(ValueError, match="tie_embeddings=True is not supported"):
        pipeline.build_stages(nd.tiny_model("tied"), 0, 2)


def test_nd_clip_equals_torch_clip_on_plain_gradients():
    a, b = nd.tiny_model("untied"), nd.tiny_model("untied")
    x = _ids()
    _loss_and_grads(a, x), _loss_and_grads(b, x)
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    got = clip_grad_norm_nd(list(b.parameters()), 0.1)
    assert got == pytest.approx(float(expected), rel=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-7, rtol=1e-5)
    assert clip_grad_norm_nd([], 1.0) == 0.0


def _one_process(kind="untied"):
    info = parallel.init_distributed()
    par = parallelize(nd.tiny_model(kind), ParallelPlan(), info)
    return par, par.build_optimizer(lr=1e-3)


def test_sharded_save_is_atomic_and_refuses_an_existing_directory(tmp_path, monkeypatch):
    par, opt = _one_process()
    target = tmp_path / "ckpt"
    import torch.distributed.checkpoint as dcp

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", broken)
    with pytest.raises(OSError, match="No space left"):
        sharded.save_sharded(target, par, opt, step=1)
    assert list(tmp_path.iterdir()) == []          # neither the target nor a temporary directory
    monkeypatch.undo()
    sharded.save_sharded(target, par, opt, step=1, state={"note": "x"})
    assert sharded.read_meta(target)["state"] == {"note": "x"}
    with pytest.raises(ValueError, match="already exists"):
        sharded.save_sharded(target, par, opt, step=2)
    with pytest.raises(ValueError, match="is not a logitlab sharded checkpoint"):
        sharded.read_meta(tmp_path)


def test_sharded_resume_in_one_process_restores_weights_and_moments(tmp_path):
    par, opt = _one_process()
    x = _ids()
    par.forward_backward(x, x)
    opt.step()
    sharded.save_sharded(tmp_path / "c", par, opt, step=1)
    other, opt2 = _one_process()
    sharded.load_sharded(tmp_path / "c", other, opt2)
    for (n, p), q in zip(par.model.named_parameters(), other.model.parameters()):
        assert torch.equal(p, q), n
    moments = [s["exp_avg"] for s in opt.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, opt2.state.values()))
    meta, state = sharded.read_model_state(tmp_path / "c")
    fresh = nd.tiny_model("untied")
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), par.model(x), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        sharded.save_sharded(tmp_path / "w", par, None)
        sharded.load_sharded(tmp_path / "w", other, opt2)


def test_tp_needs_whole_heads_before_any_mesh():
    model = Transformer(ModelConfig(vocab_size=64, context_length=16, d_model=48, n_layers=1, n_heads=6,
                                    n_kv_heads=3, d_ff=64, norm="rmsnorm", mlp="swiglu", positions="rope"))
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be divisible by tp \(4\)"):
        tensor.check_tensor_parallel(model.config, 4)


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_sharded_checkpoint_exports_to_a_hugging_face_directory(tmp_path, kind):
    from logitlab.io.hf import load_pretrained
    from logitlab.train.parallel_run import export_sharded_to_hf

    par, opt = _one_process(kind)
    sharded.save_sharded(tmp_path / "c", par, opt, step=3)
    out = export_sharded_to_hf(tmp_path / "c", tmp_path / "hf")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = load_pretrained(out)
    x = _ids()
    torch.testing.assert_close(loaded(x), par.model(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        export_sharded_to_hf(tmp_path / "c", tmp_path / "hf")          # not over a non-empty output


def test_a_sharded_checkpoint_of_the_speedrun_recipes_model_is_refused_before_any_read_or_write(tmp_path,
                                                                                               monkeypatch):
    import re

    from logitlab.train.parallel_run import export_sharded_to_hf
    from logitlab.train.recipes import SPEEDRUN

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SPEEDRUN.model, "vocab_size": 64, "context_length": 16, "d_model": 32,
                                       "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}))
    par = parallelize(model, ParallelPlan(), parallel.init_distributed())
    sharded.save_sharded(tmp_path / "c", par, step=1)
    monkeypatch.setattr(sharded, "read_model_state", None)                 # the weights are never read
    with pytest.raises(ValueError, match=f"cannot export {re.escape(str(tmp_path / 'c'))} to Hugging Face: its "
                                         f"model has value embeddings .*--recipe none"):
        export_sharded_to_hf(tmp_path / "c", tmp_path / "out" / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
