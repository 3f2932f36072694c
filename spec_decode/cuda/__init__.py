"""The CUDA route of the batch-invariant mode, designed and tested under the Triton interpreter; not wired in yet.

``invariant_linear``: a Triton matmul whose tiles are fixed constants, never picked by the row count,
with no split-K, so an output row's bits depend on its own inputs only. ``invariant_attention``: one
program per query row, keys in fixed blocks aligned to cache row 0, masked keys exact zeros. Neither is
called by ``Linear`` or ``Attention`` yet: ``batch_invariant=True`` on CUDA is a ValueError until both
are measured on a GPU (docs/spec_decode.md#batch-invariance). triton is imported only when one of the
two modules is.
"""
