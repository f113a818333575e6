"""Fast paths installed into a model from outside, each beside the reference it must equal.

- cpu_bf16: bf16 products on CPU through float32 GEMMs; install(model, mode) -> handle (route,
  timings, remove()). Reference: F.linear under bf16 autocast.
- compiled: formulas written for torch.compile (CrossEntropy). Reference: F.cross_entropy.
- decode: the compiled decode step. Reference: generate.loop.decode_step.
- allocator: keep_freed_memory, a process-wide allocator setting applied by an explicit call.
"""

__all__ = ["allocator", "compiled", "cpu_bf16", "decode"]
