"""The optional Triton import, guarded once for every package: ``triton`` and ``tl`` are None without it.

Kernel modules (``numerics.triton_counts``, ``samplers.triton_coupled``, ``spec_decode.cuda``) take
``triton`` and ``tl`` from here and define their kernels only when it is not None. Importing this
module imports triton, so the kernel modules import it lazily, on their first launch.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = tl = None


def triton_available() -> bool:
    """True when triton imported (this says nothing about a usable GPU)."""
    return triton is not None
