"""Fast paths installed into a model from outside, each beside the reference it must equal.

- cpu_bf16: bf16 products on CPU through float32 GEMMs; install(model, mode) -> handle (route,
  timings, remove()). Reference: F.linear under bf16 autocast.
- compiled: formulas written for torch.compile (CrossEntropy). Reference: F.cross_entropy.
- graph_passes: inductor graph passes for a training step (TiedEmbeddingGrad, training_options;
  imported only by a compile that uses them). Reference: the graph as traced.
- decode: the compiled decode step. Reference: generate.loop.decode_step.
- allocator: keep_freed_memory, a process-wide allocator setting applied by an explicit call.
- Triton (GPU; tested on CPU through Triton's interpreter), in the order they are taught:
  triton_basics (vector add, fused softmax, RMSNorm forward), triton_attention_steps (naive and
  tiled attention with the online softmax), triton_flash_fwd / triton_flash_bwd (FlashAttention:
  causal block skipping, GQA, the backward from the saved log-sum-exp), triton_attention (its
  differentiable custom operator), triton_norm, triton_swiglu and triton_cross_entropy (fused
  training kernels; each a custom operator too, so torch.compile(fullgraph=True) keeps it as one
  op), triton_install (install(model) -> handle with remove()), triton_common and triton_io
  (shared helpers and the memory-traffic counts). Reference: model.attention.eager_attention,
  the norms, the MLP and train.loss.
"""

__all__ = ["allocator", "compiled", "cpu_bf16", "decode", "graph_passes", "triton_attention",
           "triton_attention_steps", "triton_basics", "triton_common", "triton_cross_entropy", "triton_flash_bwd",
           "triton_flash_fwd", "triton_install", "triton_io", "triton_norm", "triton_swiglu"]
