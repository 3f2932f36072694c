"""Triton kernel for ``nonfinite_counts_per_request``: one read of the logits, counts on device.

Three layers: ``_nonfinite_counts_kernel`` (private), ``nonfinite_counts_triton`` (host
launcher, checks the backend can run), and the public ``numerics.nonfinite_counts_per_request``
(``nan_counts_per_request`` returns fields of the same result).
triton is imported only when this module is imported, i.e. when the backend is used.

Design of the dead-row count. A row of V = 151936 is split over ``num_chunks`` programs
(4096 columns each), so no program alone knows whether its row has a finite value. Each
program makes one 64-bit ``atomic_add`` on a per-row state word (zeroed scratch, [num_rows]
int64): ``1 + (saw_finite << 32)``. The low half counts finished programs, the high half
programs that saw a finite value. ``atomic_add`` returns the old word, so exactly one program
per row, the one that finds ``num_chunks - 1`` finished before it, is last; the old word plus
its own contribution is the whole row, and if no chunk saw a finite value it adds 1 to the
request's dead-row count. One atomic carries both facts, so this needs no memory fence, no
second launch and no extra read of the logits (the alternative, per-row finite counts then a
second pass over [num_rows], costs a launch and a [num_rows] round trip). The NaN and Inf
counts are summed per program and added to the request's slot with one atomic each, skipped
when zero (the common case), as the NaN count always was.
"""

from __future__ import annotations

import os

import torch

from .triton_import import triton, tl, triton_available


if triton is not None:

    @triton.jit
    def _nonfinite_counts_kernel(
        logits_ptr,  # [num_rows, V], any strides; sanitized in place if SANITIZE
        cu_num_rows_ptr,  # [num_reqs + 1] int32/int64, non-decreasing
        counts_ptr,  # [3, num_reqs + 1] int32 zeros: NaN, Inf, dead rows; accumulated with atomics
        row_state_ptr,  # [num_rows] int64 zeros: (chunks that saw a finite value << 32) + chunks done
        bound_ptr,  # [1] compute dtype: the sanitize magnitude c
        num_reqs,
        V,
        stride_row,
        stride_col,
        num_chunks,  # programs per row (grid axis 1)
        BLOCK_V: tl.constexpr,
        BLOCKS_PER_PROGRAM: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,  # >= ceil(log2(num_reqs + 1))
        SANITIZE: tl.constexpr,
        COMPUTE_DTYPE: tl.constexpr,  # float32, or float64 for float64 logits
    ):
        # Grid: (num_rows, num_chunks). Each program scans BLOCKS_PER_PROGRAM blocks of one row.
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
        num_infs = tl.zeros((), dtype=tl.int32)
        num_finite = tl.zeros((), dtype=tl.int32)
        for b in tl.static_range(BLOCKS_PER_PROGRAM):
            cols = (chunk * BLOCKS_PER_PROGRAM + b) * BLOCK_V + offs
            in_row = cols < V
            ptrs = row_ptr + cols.to(tl.int64) * stride_col
            x = tl.load(ptrs, mask=in_row, other=0.0)
            # Compare in fp32/fp64: bf16 comparisons are wrong under the interpreter.
            xf = x.to(COMPUTE_DTYPE)
            is_nan = xf != xf
            is_inf = tl.abs(xf) == float("inf")
            num_nans += tl.sum((is_nan & in_row).to(tl.int32), axis=0)
            num_infs += tl.sum((is_inf & in_row).to(tl.int32), axis=0)
            num_finite += tl.sum((in_row & ~is_nan & ~is_inf).to(tl.int32), axis=0)
            if SANITIZE:
                fix = in_row & (is_nan | (xf > bound) | (xf < -bound))
                # NaN > bound is False, so NaN and -Inf both get -bound. The bound is exact
                # in the logits dtype, so the cast back cannot round (nor truncate).
                y = tl.where(xf > bound, bound, -bound)
                tl.store(ptrs, y.to(x.dtype), mask=fix)
        counts_stride = num_reqs + 1
        tl.atomic_add(counts_ptr + lo, num_nans, mask=owned & (num_nans > 0))
        tl.atomic_add(counts_ptr + counts_stride + lo, num_infs, mask=owned & (num_infs > 0))
        # Dead row = no program of the row saw a finite value. One atomic per program carries
        # both facts, packed: +1 (this chunk is done) and +2**32 if it saw a finite value. The
        # program whose returned old value shows num_chunks - 1 chunks done is the row's last;
        # old + its own contribution is the complete row state, so no further ordering is needed.
        has_finite = (num_finite > 0).to(tl.int64)
        old = tl.atomic_add(row_state_ptr + row, 1 + (has_finite << 32), mask=owned)
        done_before = old & 0xFFFFFFFF
        finite_chunks = (old >> 32) + has_finite
        dead = owned & (done_before == num_chunks - 1) & (finite_chunks == 0)
        tl.atomic_add(counts_ptr + 2 * counts_stride + lo, 1, mask=dead)


BLOCK_V = 1024
BLOCKS_PER_PROGRAM = 4


def interpreter_active() -> bool:
    """Whether the kernel runs under the Triton interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return type(_nonfinite_counts_kernel).__name__ == "InterpretedFunction"


def nonfinite_counts_triton(logits: torch.Tensor, cu_num_rows: torch.Tensor, *, sanitize: bool = False):
    """Host launcher for the Triton backend (inputs already validated). No host sync.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [num_reqs + 1];
        returns ``NonfiniteCounts`` of three int32 [num_reqs] (views of one [3, num_reqs + 1]).
    """
    from .counts_result import NonfiniteCounts
    from .sanitize import distinct_elements, sanitize_reference, sanitize_bound

    if triton is None:
        raise RuntimeError(
            'backend="triton" needs the optional triton package: pip install "safespec[triton]"'
        )
    if logits.device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            'backend="triton" on CPU tensors needs the Triton interpreter: set '
            "TRITON_INTERPRET=1 before triton is first imported "
            f"(now TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}), or use backend=\"torch\""
        )
    if sanitize and distinct_elements(logits).shape != logits.shape:
        # An expanded (stride-0) view: programs would sanitize memory that other rows still
        # have to count. Count first, then sanitize each shared element once (rare: 2 passes).
        counts = nonfinite_counts_triton(logits, cu_num_rows, sanitize=False)
        sanitize_reference(logits)
        return counts
    num_rows, vocab = logits.shape
    num_reqs = cu_num_rows.shape[0] - 1
    # One spare column per count (the dump bin) so the kernel never gets an empty tensor.
    counts = torch.zeros(3, num_reqs + 1, dtype=torch.int32, device=logits.device)
    result = NonfiniteCounts(counts[0, :num_reqs], counts[1, :num_reqs], counts[2, :num_reqs])
    if num_rows == 0 or vocab == 0 or (num_reqs == 0 and not sanitize):
        return result
    row_state = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    # Filled on the device (no host-to-device copy); exact in the logits dtype.
    bound = torch.full((1,), sanitize_bound(logits.dtype), dtype=compute, device=logits.device)
    block_v = min(BLOCK_V, triton.next_power_of_2(vocab))
    blocks_per_program = min(BLOCKS_PER_PROGRAM, triton.cdiv(vocab, block_v))
    num_chunks = triton.cdiv(vocab, block_v * blocks_per_program)
    _nonfinite_counts_kernel[(num_rows, num_chunks)](
        logits,
        cu_num_rows,
        counts,
        row_state,
        bound,
        num_reqs,
        vocab,
        logits.stride(0),
        logits.stride(1),
        num_chunks,
        BLOCK_V=block_v,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        SEARCH_STEPS=max(1, num_reqs.bit_length()),
        SANITIZE=sanitize,
        COMPUTE_DTYPE=tl.float64 if compute == torch.float64 else tl.float32,
    )
    return result
