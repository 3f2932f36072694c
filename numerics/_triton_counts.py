"""Triton kernel for ``nan_counts_per_request``: one read of the logits, counts on device.

Three layers: ``_nan_counts_kernel`` (private), ``nan_counts_triton`` (host launcher,
checks the backend can run), and the public ``numerics.nan_counts_per_request``.
triton is imported only when this module is imported, i.e. when the backend is used.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional extra
    triton = None


def triton_available() -> bool:
    """True when triton imported (this says nothing about a usable GPU)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _nan_counts_kernel(
        logits_ptr,  # [num_rows, V], any strides; sanitized in place if SANITIZE
        cu_num_rows_ptr,  # [num_reqs + 1] int32/int64, non-decreasing
        counts_ptr,  # [num_reqs] int32, zero-initialised, accumulated with atomics
        bound_ptr,  # [1] compute dtype: the sanitize magnitude c
        num_reqs,
        V,
        stride_row,
        stride_col,
        BLOCK_V: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,  # >= ceil(log2(num_reqs + 1))
        SANITIZE: tl.constexpr,
        COMPUTE_DTYPE: tl.constexpr,  # float32, or float64 for float64 logits
    ):
        # Grid: (num_rows, vocab chunks). Each program scans BLOCKS_PER_PROGRAM blocks of one row.
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)

        # Binary search for the owner: the largest i in [0, num_reqs] with cu[i] <= row.
        lo = tl.zeros((), dtype=tl.int64)
        hi = lo + num_reqs
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            take = tl.load(cu_num_rows_ptr + mid).to(tl.int64) <= row
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        first = tl.load(cu_num_rows_ptr).to(tl.int64)
        # Rows before cu[0] or at/after cu[num_reqs] belong to no request.
        owned = (first <= row) & (lo < num_reqs)

        bound = tl.load(bound_ptr)
        row_ptr = logits_ptr + row * stride_row
        offs = tl.arange(0, BLOCK_V)
        num_nans = tl.zeros((), dtype=tl.int32)
        for b in tl.static_range(BLOCKS_PER_PROGRAM):
            cols = (chunk * BLOCKS_PER_PROGRAM + b) * BLOCK_V + offs
            in_row = cols < V
            ptrs = row_ptr + cols.to(tl.int64) * stride_col
            x = tl.load(ptrs, mask=in_row, other=0.0)
            # Compare in fp32/fp64: bf16 comparisons are wrong under the interpreter.
            xf = x.to(COMPUTE_DTYPE)
            is_nan = xf != xf
            num_nans += tl.sum((is_nan & in_row).to(tl.int32), axis=0)
            if SANITIZE:
                fix = in_row & (is_nan | (xf > bound) | (xf < -bound))
                # NaN > bound is False, so NaN and -Inf both get -bound. The bound is exact
                # in the logits dtype, so the cast back cannot round (nor truncate).
                y = tl.where(xf > bound, bound, -bound)
                tl.store(ptrs, y.to(x.dtype), mask=fix)
        tl.atomic_add(counts_ptr + lo, num_nans, mask=owned & (num_nans > 0))


BLOCK_V = 1024
BLOCKS_PER_PROGRAM = 4


def _interpreter_active() -> bool:
    return type(_nan_counts_kernel).__name__ == "InterpretedFunction"


def nan_counts_triton(
    logits: torch.Tensor, cu_num_rows: torch.Tensor, *, sanitize: bool = False
) -> torch.Tensor:
    """Host launcher for the Triton backend (inputs already validated). No host sync.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [num_reqs + 1]; returns int32 [num_reqs].
    """
    if triton is None:
        raise RuntimeError(
            'backend="triton" needs the optional triton package: pip install "safespec[triton]"'
        )
    if logits.device.type == "cpu" and not _interpreter_active():
        raise RuntimeError(
            'backend="triton" on CPU tensors needs the Triton interpreter: set '
            "TRITON_INTERPRET=1 before triton is first imported "
            f"(now TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}), or use backend=\"torch\""
        )
    from .sanitize import sanitize_bound

    num_rows, vocab = logits.shape
    num_reqs = cu_num_rows.shape[0] - 1
    # One spare slot so the kernel never receives the null pointer of an empty tensor.
    counts = torch.zeros(num_reqs + 1, dtype=torch.int32, device=logits.device)
    if num_rows == 0 or vocab == 0 or (num_reqs == 0 and not sanitize):
        return counts[:num_reqs]
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    # Filled on the device (no host-to-device copy); exact in the logits dtype.
    bound = torch.full((1,), sanitize_bound(logits.dtype), dtype=compute, device=logits.device)
    block_v = min(BLOCK_V, triton.next_power_of_2(vocab))
    blocks_per_program = min(BLOCKS_PER_PROGRAM, triton.cdiv(vocab, block_v))
    grid = (num_rows, triton.cdiv(vocab, block_v * blocks_per_program))
    _nan_counts_kernel[grid](
        logits,
        cu_num_rows,
        counts,
        bound,
        num_reqs,
        vocab,
        logits.stride(0),
        logits.stride(1),
        BLOCK_V=block_v,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        SEARCH_STEPS=max(1, num_reqs.bit_length()),
        SANITIZE=sanitize,
        COMPUTE_DTYPE=tl.float64 if compute == torch.float64 else tl.float32,
    )
    return counts[:num_reqs]
