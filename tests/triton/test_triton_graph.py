"""The Triton kernels as custom operators inside a torch.compile graph (kernels.triton_attention,
triton_norm, triton_swiglu, triton_cross_entropy, triton_grouped_gemm).

- Each operator's fake implementation gives the real outputs' shapes, dtypes and strides
  (FakeTensorMode), and torch.library.opcheck passes (schema, autograd registration, fake
  tensors, AOT dispatch with dynamic shapes).
- A Transformer with the Triton attention installed, compiled with fullgraph=True, is one graph
  holding one flash-attention forward op per layer (and, through AOT autograd, one backward op per
  layer), and its logits and gradients equal the model with the eager reference attention. The
  fused RMSNorm, SwiGLU and LM-head loss likewise, against their references.

What runs where: under the interpreter (CPU), backend "eager" (dynamo's trace alone: the graph is
run op by op) and "aot_eager" (dynamo, then AOT autograd's forward and backward graphs, run op by
op) run by default, each custom op running its kernels in the interpreter; inductor (the graph
compiled to C++, the custom ops called from it as extern kernels) is marked slow (about 2 minutes
on a loaded 2-core machine). On a CUDA machine the same cases run with compiled kernels; the
bf16-autocast inductor training step on a GPU is bench/gpu_check.py's train part.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode

from logitlab.kernels import (
    triton_grouped_gemm,  # noqa: F401  (registers logitlab::grouped_mm_*)
    triton_install,
)
from logitlab.kernels.triton_cross_entropy import linear_cross_entropy
from logitlab.kernels.triton_norm import rms_norm
from logitlab.kernels.triton_swiglu import swiglu
from logitlab.model.config import ModelConfig
from logitlab.model.norms import RMSNorm
from logitlab.model.transformer import Transformer
from logitlab.train.loss import IGNORE_INDEX, cross_entropy, loss_fn

ops = torch.ops.logitlab


def rand(device, *shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(grad)


def attention_inputs(device, dtype, B=1, H=4, Hkv=2, T=5, S=7, Dh=16):
    q = rand(device, B, T, H, Dh, dtype=dtype, seed=1).transpose(1, 2)     # (B, H, T, Dh), not contiguous
    return q, rand(device, B, Hkv, S, Dh, dtype=dtype, seed=2), rand(device, B, Hkv, S, Dh, dtype=dtype, seed=3)


def op_cases(device, dtype):
    """(name, op, args) for every custom operator, on small inputs of `dtype`."""
    q, k, v = attention_inputs(device, dtype)
    out, lse2 = ops.flash_attention_forward(q, k, v, True, 0.25)
    x, w = rand(device, 6, 24, dtype=dtype, seed=4), rand(device, 24, seed=5)
    y, rstd = ops.rms_norm_forward(x, w, 1e-6)
    gu = rand(device, 6, 40, dtype=dtype, seed=6)
    h, head = rand(device, 6, 16, dtype=dtype, seed=7), rand(device, 11, 16, dtype=dtype, seed=8)
    targets = torch.tensor([1, 2, IGNORE_INDEX, 10, 0, 3], device=device)
    gx, gw = rand(device, 7, 16, dtype=dtype, seed=10), rand(device, 3, 12, 16, dtype=dtype, seed=11)
    counts = torch.tensor([4, 0, 3], device=device)
    return [
        ("flash_attention_forward", ops.flash_attention_forward.default, (q, k, v, True, 0.25)),
        ("flash_attention_backward", ops.flash_attention_backward.default,
         (torch.randn_like(out), q, k, v, out, lse2, True, 0.25)),
        ("rms_norm_forward", ops.rms_norm_forward.default, (x, w, 1e-6)),
        ("rms_norm_backward", ops.rms_norm_backward.default, (torch.randn_like(y), x, w, rstd)),
        ("swiglu_forward", ops.swiglu_forward.default, (gu,)),
        ("swiglu_backward", ops.swiglu_backward.default, (rand(device, 6, 20, dtype=dtype, seed=9), gu)),
        ("linear_cross_entropy", ops.linear_cross_entropy.default, (h, head, targets, IGNORE_INDEX, 4)),
        ("grouped_mm_forward", ops.grouped_mm_forward.default, (gx, gw, counts)),
        ("grouped_mm_backward", ops.grouped_mm_backward.default, (rand(device, 7, 12, dtype=dtype, seed=12), gx, gw,
                                                                  counts)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_implementations_give_the_real_shapes_dtypes_and_strides(device, dtype):
    for name, op, args in op_cases(device, dtype):
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = op(*fake_args)
        for i, (r, f) in enumerate(zip(real, fake) if isinstance(real, tuple) else [(real, fake)]):
            got, want = (f.shape, f.dtype, f.stride()), (r.shape, r.dtype, r.stride())
            assert got == want, f"{name} output {i}: fake {got}, real {want}"


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_opcheck_passes_for_every_operator(device, dtype):
    for name, op, args in op_cases(device, dtype):
        differentiable = not name.endswith("_backward")            # no double backward: no grad into those
        args = [a.detach().requires_grad_(differentiable and a.is_floating_point())
                if isinstance(a, torch.Tensor) else a for a in args]
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (name, result)


# ------------------------------------------------------------------------------------------
# Compiled graphs
# ------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each case compiles from scratch (no cache entry or recompile count from another case)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Graphs:
    """A torch.compile backend that records what it is given: dynamo's graphs ("eager": run as
    traced) or, with aot=True, AOT autograd's forward and backward graphs (run op by op)."""

    def __init__(self, aot: bool = False):
        self.dynamo, self.forward, self.backward = [], [], []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward), bw_compiler=self._keep(self.backward)) \
            if aot else self._dynamo

    def _dynamo(self, gm, example_inputs):
        self.dynamo.append(gm)
        return gm.forward

    def _keep(self, into):
        def compiler(gm, example_inputs):
            into.append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    @staticmethod
    def count(graphs, op) -> int:
        return sum(node.target is op for gm in graphs for node in gm.graph.nodes)


def tiny(device, **overrides):
    fields = dict(vocab_size=97, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  norm="rmsnorm", mlp="swiglu", positions="rope")
    fields.update(overrides)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**fields)).to(device)
    reference = Transformer(model.config, attn_impl="eager").to(device)
    reference.load_state_dict(model.state_dict())
    return model, reference


def loss_and_grads(loss_of, model, ids):
    loss = loss_of(ids[:, :-1], ids[:, 1:])
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def check_compiled_training_step(device, backend):
    model, reference = tiny(device)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    want, want_grads = loss_and_grads(loss_fn(reference), reference, ids)
    handle = triton_install.install(model)
    if isinstance(backend, str):                                   # as `train --compile` builds the step
        step = loss_fn(model, backend, fullgraph=True)
    else:
        step = torch.compile(loss_fn(model), backend=backend, fullgraph=True)
    got, got_grads = loss_and_grads(step, model, ids)
    handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_installed_attention_traces_as_one_graph_with_one_op_per_layer(device):
    graphs = Graphs()
    check_compiled_training_step(device, graphs.backend)
    assert len(graphs.dynamo) == 1                                 # fullgraph: one graph, no break
    assert Graphs.count(graphs.dynamo, ops.flash_attention_forward.default) == 2


def test_installed_attention_compiles_forward_and_backward_graphs(device):
    graphs = Graphs(aot=True)
    check_compiled_training_step(device, graphs.backend)
    assert (len(graphs.forward), len(graphs.backward)) == (1, 1)
    assert Graphs.count(graphs.forward, ops.flash_attention_forward.default) == 2
    assert Graphs.count(graphs.backward, ops.flash_attention_backward.default) == 2


@pytest.mark.slow  # about 2 minutes on a loaded 2-core CPU: inductor compiles both graphs to C++
def test_installed_attention_under_inductor(device):
    check_compiled_training_step(device, "inductor")


def test_installed_attention_compiles_for_a_cached_decode_step(device):
    model, reference = tiny(device)
    from logitlab.model.cache import KVCache

    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2)).to(device)

    def run(m, forward):
        cache = KVCache.for_model(m.config, batch_size=1, max_len=12)
        with torch.no_grad():
            m(ids[:, :8], cache=cache)                             # prefill, eager
            return forward(ids[:, 8:], cache=cache)                # one decode step: T = 1

    want = run(reference, reference)
    handle = triton_install.install(model)
    graphs = Graphs()
    got = run(model, torch.compile(model, backend=graphs.backend, fullgraph=True))
    handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert Graphs.count(graphs.dynamo, ops.flash_attention_forward.default) == 2


def fused_step(x, norm_w, gate_up_w, down_w, head, targets):
    """RMSNorm -> gate/up -> SwiGLU -> down -> LM head loss, by the fused kernels."""
    a = swiglu(rms_norm(x, norm_w, 1e-6) @ gate_up_w.t())          # (B, T, F)
    return linear_cross_entropy(a @ down_w.t(), head, targets, chunk_rows=5)


def reference_step(x, norm_w, gate_up_w, down_w, head, targets):
    norm = RMSNorm(x.shape[-1], eps=1e-6).to(x.device)
    normed = torch.func.functional_call(norm, {"weight": norm_w}, (x,))     # RMSNorm with norm_w as its weight
    gate, up = (normed @ gate_up_w.t()).chunk(2, dim=-1)
    return cross_entropy((F.silu(gate) * up) @ down_w.t() @ head.t(), targets)


def test_fused_norm_swiglu_and_loss_compile_as_one_graph(device):
    D, Fh, V = 16, 24, 50
    params = [rand(device, D, seed=1, grad=True), rand(device, 2 * Fh, D, seed=2, grad=True),
              rand(device, D, Fh, seed=3, grad=True), rand(device, V, D, seed=4, grad=True)]
    x = rand(device, 2, 7, D, seed=5, grad=True)
    targets = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(6)).to(device)
    targets[0, 2] = IGNORE_INDEX
    want = reference_step(x, *params, targets)
    want_grads = torch.autograd.grad(want, [x, *params])
    eager = fused_step(x, *params, targets)
    eager_grads = torch.autograd.grad(eager, [x, *params])
    graphs = Graphs(aot=True)
    got = torch.compile(fused_step, backend=graphs.backend, fullgraph=True)(x, *params, targets)
    got_grads = torch.autograd.grad(got, [x, *params])
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)   # the same kernels, compiled or not
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b, c in zip(got_grads, eager_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-4)     # float32, summed in another order
    assert (len(graphs.forward), len(graphs.backward)) == (1, 1)
    for op in (ops.rms_norm_forward, ops.swiglu_forward, ops.linear_cross_entropy):
        assert Graphs.count(graphs.forward, op.default) == 1, op
    for op in (ops.rms_norm_backward, ops.swiglu_backward):
        assert Graphs.count(graphs.backward, op.default) == 1, op


def test_a_bad_target_is_still_a_value_error_when_compiled(device):
    h, head = rand(device, 4, 16, grad=True), rand(device, 11, 16, seed=1)
    targets = torch.tensor([1, 2, 11, 0], device=device)           # 11 is past the vocabulary
    compiled = torch.compile(linear_cross_entropy, backend=Graphs().backend, fullgraph=True)
    with pytest.raises(ValueError, match=r"targets must be in \[0, 11\).*got 11"):
        compiled(h, head, targets)
