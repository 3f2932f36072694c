"""NaN, Inf and dead-row counts per request over the flat rows of a speculative-verification batch.

NaN, Inf, non-finite and dead row are defined in the glossary of ``numerics.policy``. A batch
of verification logits is flat, ``[num_rows, V]``; request ``i`` owns rows
``cu_num_rows[i]:cu_num_rows[i+1]`` (its draft positions plus the bonus position), possibly
none. Rows outside every range (padding) are ignored.
"""

from __future__ import annotations

import torch

from .counts_result import NonfiniteCounts
from .sanitize import sanitize_reference, check_float_logits

BACKENDS = ("auto", "triton", "torch")
__all__ = ["BACKENDS", "NonfiniteCounts", "nan_counts_per_request", "nonfinite_counts_per_request"]


def _row_owner(cu_num_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request index owning each row; ``num_reqs`` (a dump bin) for rows outside every request.

    Shape: cu_num_rows [num_reqs + 1]; returns [num_rows], dtype of ``cu_num_rows``.
    """
    num_reqs = cu_num_rows.shape[0] - 1
    rows = torch.arange(num_rows, device=cu_num_rows.device, dtype=cu_num_rows.dtype)
    # Owner of row r: the last request i with cu[i] <= r (empty requests are skipped).
    owner = torch.searchsorted(cu_num_rows, rows, right=True) - 1  # [num_rows]
    # Rows before cu[0] (owner -1) or at/after cu[-1] (owner num_reqs) go to the dump bin.
    return torch.where(owner < 0, num_reqs, owner)


CPU_ROW_SUM_FILTER = True
"""CPU only: count entry by entry only the rows whose sum is not finite (tests turn it off to
check the every-row path that devices take)."""


def _row_counts(logits: torch.Tensor) -> torch.Tensor:
    """NaN entries, +-Inf entries and deadness of every row, entry by entry. No host sync.

    Shape: logits [n, V]; returns int32 [3, n] (rows: NaN count, Inf count, 1 if dead).
    """
    vocab = logits.shape[-1]
    out = torch.empty(3, logits.shape[0], dtype=torch.int32, device=logits.device)
    torch.sum(torch.isnan(logits), dim=-1, dtype=torch.int32, out=out[0])
    finite = torch.isfinite(logits).sum(dim=-1, dtype=torch.int32)
    # Every entry is exactly one of NaN, Inf, finite: Inf and deadness follow without another read.
    torch.sub(vocab - finite, out[0], out=out[1])
    if vocab:
        torch.eq(finite, 0, out=out[2])
    else:
        out[2].zero_()  # a row with V == 0 is not dead
    return out


def _rows_with_nonfinite_sum(logits: torch.Tensor) -> torch.Tensor:
    """Indices of the rows whose sum is not finite: the only rows that can hold NaN or +-Inf.

    A row with a NaN or an Inf has a NaN or Inf sum, so counting only these rows (plus finite
    rows whose sum overflowed) keeps the counts exact while reading each clean row once.
    ``nonzero`` gives a data-sized tensor: on CPU it reads host memory, no device sync, which is
    why only the CPU path filters. Shape: logits [n, V]; returns int64 [n_flagged].
    """
    return (~torch.isfinite(logits.sum(dim=-1))).nonzero().squeeze(1)


def _nonfinite_counts_reference(
    logits: torch.Tensor, cu_num_rows: torch.Tensor, *, sanitize: bool = False
) -> NonfiniteCounts:
    """Pure-torch ``nonfinite_counts_per_request``: same signature, same bits. No host sync.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [num_reqs + 1]; returns three int32 [num_reqs].
    """
    num_rows = logits.shape[0]
    num_reqs = cu_num_rows.shape[0] - 1
    counts = torch.zeros(3, num_reqs + 1, dtype=torch.int32, device=logits.device)
    if logits.device.type == "cpu" and CPU_ROW_SUM_FILTER:
        flagged = _rows_with_nonfinite_sum(logits)  # [n_flagged]
        if flagged.numel():
            owner = _row_owner(cu_num_rows, num_rows)  # [num_rows]
            counts.index_add_(1, owner.index_select(0, flagged), _row_counts(logits.index_select(0, flagged)))
    else:
        counts.index_add_(1, _row_owner(cu_num_rows, num_rows), _row_counts(logits))
    if sanitize:
        sanitize_reference(logits)
    return NonfiniteCounts(*counts[:, :num_reqs].unbind(0))   # one op for the three views, not six


def _nan_counts_reference(
    logits: torch.Tensor, cu_num_rows: torch.Tensor, *, sanitize: bool = False
) -> torch.Tensor:
    """Pure-torch ``nan_counts_per_request``: the ``nan`` field of the three counts.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [num_reqs + 1]; returns int32 [num_reqs].
    """
    return _nonfinite_counts_reference(logits, cu_num_rows, sanitize=sanitize).nan


def _check_counts_inputs(logits: torch.Tensor, cu_num_rows: torch.Tensor, backend: str) -> None:
    check_float_logits(logits)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected 2-D [num_rows, V], got shape {tuple(logits.shape)}")
    if not isinstance(cu_num_rows, torch.Tensor):
        raise ValueError(f"cu_num_rows: expected a torch.Tensor, got {type(cu_num_rows).__name__}")
    if cu_num_rows.dim() != 1 or cu_num_rows.shape[0] < 1:
        raise ValueError(
            "cu_num_rows: expected 1-D [num_reqs + 1] with at least one element, "
            f"got shape {tuple(cu_num_rows.shape)}"
        )
    if cu_num_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_num_rows: expected int32 or int64, got {cu_num_rows.dtype}")
    if cu_num_rows.device != logits.device:
        raise ValueError(
            f"cu_num_rows: expected device {logits.device} (same as logits), got {cu_num_rows.device}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def _check_cu_values(cu_num_rows: torch.Tensor, num_rows: int) -> None:
    # Host sync: opt-in validation only (check_inputs=True).
    cu = cu_num_rows.tolist()
    if cu[0] < 0 or cu[-1] > num_rows:
        raise ValueError(f"cu_num_rows: values must lie in [0, num_rows={num_rows}], got {cu}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_num_rows: must be non-decreasing, got {cu}")


def _pick_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    from . import triton_counts

    return "triton" if triton_counts.triton_available() else "torch"


def nonfinite_counts_per_request(
    logits: torch.Tensor,
    cu_num_rows: torch.Tensor,
    *,
    sanitize: bool = False,
    backend: str = "auto",
    check_inputs: bool = False,
) -> NonfiniteCounts:
    """Count NaN entries, +-Inf entries and dead rows per request, in one pass. No host sync.

    Shape:
        logits: [num_rows, V], float16/bfloat16/float32/float64; may be a strided view
            (any row stride, any column stride).
        cu_num_rows: [num_reqs + 1], int32 or int64, same device, non-decreasing;
            request i owns rows ``cu_num_rows[i]:cu_num_rows[i+1]``.
        returns: ``NonfiniteCounts(nan, inf, dead_rows)``, each int32 [num_reqs] on
            ``logits.device`` (views of one int32 [3, num_reqs + 1] buffer).

    Parameters
    ----------
    sanitize : bool
        Also apply ``sanitize_nan_logits`` (without its warning) to *every* row of
        ``logits`` in place, rows outside all requests included. Counts are taken
        before sanitizing.
    backend : {"auto", "triton", "torch"}
        "auto": the Triton kernel on CUDA tensors when triton imports, else torch.
        "triton" on CPU tensors needs ``TRITON_INTERPRET=1`` set before triton is
        imported. Both backends give identical counts and identical sanitized bits.
    check_inputs : bool
        Also check that ``cu_num_rows`` is non-decreasing and within [0, num_rows].
        This reads ``cu_num_rows`` on the host: one sync, so it is off by default
        and results for invalid offsets are undefined.

    On NaN: counted in ``nan``; +-Inf in ``inf``; a row with no finite entry (a dead
    row, V >= 1) adds 1 to ``dead_rows``. Rows outside every request are ignored;
    requests with no rows get 0 everywhere.

    Examples
    --------
    >>> x = torch.tensor([[0.0, float("nan")], [float("inf"), 2.0], [float("nan"), -float("inf")]])
    >>> nonfinite_counts_per_request(x, torch.tensor([0, 2, 2, 3]))
    NonfiniteCounts(nan=tensor([1, 0, 1], dtype=torch.int32), inf=tensor([1, 0, 1], dtype=torch.int32), \
dead_rows=tensor([0, 0, 1], dtype=torch.int32))
    """
    _check_counts_inputs(logits, cu_num_rows, backend)
    if check_inputs:
        _check_cu_values(cu_num_rows, logits.shape[0])
    if _pick_backend(backend, logits.device) == "torch":
        return _nonfinite_counts_reference(logits, cu_num_rows, sanitize=sanitize)
    from . import triton_counts

    return triton_counts.nonfinite_counts_triton(logits, cu_num_rows, sanitize=sanitize)


def nan_counts_per_request(
    logits: torch.Tensor,
    cu_num_rows: torch.Tensor,
    *,
    sanitize: bool = False,
    backend: str = "auto",
    check_inputs: bool = False,
    return_dead_rows: bool = False,
) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """Count NaN logits per request, optionally sanitizing in the same pass. No host sync.

    The ``nan`` (and, with ``return_dead_rows=True``, ``dead_rows``) field of
    ``nonfinite_counts_per_request``, which does the work: same pass, same arguments.

    Shape:
        logits: [num_rows, V], float16/bfloat16/float32/float64; may be a strided view
            (any row stride, any column stride).
        cu_num_rows: [num_reqs + 1], int32 or int64, same device, non-decreasing;
            request i owns rows ``cu_num_rows[i]:cu_num_rows[i+1]``.
        returns: int32 [num_reqs] on ``logits.device``; with ``return_dead_rows=True``
            the tuple ``(nan_counts, dead_rows)``, both int32 [num_reqs].

    Parameters
    ----------
    sanitize, backend, check_inputs
        As in ``nonfinite_counts_per_request``.
    return_dead_rows : bool
        Also return, per request, the number of rows with no finite value.

    On NaN: counted (+Inf/-Inf are not counted, but they are sanitized).
    Rows outside every request are ignored; requests with no rows get 0.

    Examples
    --------
    >>> x = torch.tensor([[0.0, float("nan")], [1.0, 2.0], [float("nan")] * 2])
    >>> nan_counts_per_request(x, torch.tensor([0, 2, 2, 3]))
    tensor([1, 0, 2], dtype=torch.int32)
    """
    counts = nonfinite_counts_per_request(
        logits, cu_num_rows, sanitize=sanitize, backend=backend, check_inputs=check_inputs
    )
    if return_dead_rows:
        return counts.nan, counts.dead_rows
    return counts.nan
