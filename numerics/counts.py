"""NaN counts per request over the flat rows of a speculative-verification batch.

Glossary: a batch of verification logits is flat, ``[num_rows, V]``; request ``i``
owns rows ``cu_num_rows[i]:cu_num_rows[i+1]`` (its draft positions plus the bonus
position), possibly none. Rows outside every range (padding) are ignored.
"""

from __future__ import annotations

import torch

from .sanitize import _sanitize_reference, check_float_logits

BACKENDS = ("auto", "triton", "torch")


def _nan_counts_reference(
    logits: torch.Tensor, cu_num_rows: torch.Tensor, *, sanitize: bool = False
) -> torch.Tensor:
    """Pure-torch ``nan_counts_per_request``: same signature, same bits. No host sync.

    Shape:
        logits: [num_rows, V]; cu_num_rows: [num_reqs + 1]; returns int32 [num_reqs].
    """
    num_rows = logits.shape[0]
    num_reqs = cu_num_rows.shape[0] - 1
    row_nans = torch.isnan(logits).sum(dim=-1, dtype=torch.int32)  # [num_rows]
    rows = torch.arange(num_rows, device=logits.device, dtype=cu_num_rows.dtype)
    # Owner of row r: the last request i with cu[i] <= r (empty requests are skipped).
    owner = torch.searchsorted(cu_num_rows, rows, right=True) - 1  # [num_rows]
    # Rows before cu[0] (owner -1) or at/after cu[-1] (owner num_reqs) go to a dump bin.
    owner = torch.where(owner < 0, num_reqs, owner)
    counts = torch.zeros(num_reqs + 1, dtype=torch.int32, device=logits.device)
    counts.index_add_(0, owner, row_nans)
    if sanitize:
        _sanitize_reference(logits)
    return counts[:num_reqs]


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
    from . import _triton_counts

    return "triton" if _triton_counts.triton_available() else "torch"


def nan_counts_per_request(
    logits: torch.Tensor,
    cu_num_rows: torch.Tensor,
    *,
    sanitize: bool = False,
    backend: str = "auto",
    check_inputs: bool = False,
) -> torch.Tensor:
    """Count NaN logits per request, optionally sanitizing in the same pass. No host sync.

    Shape:
        logits: [num_rows, V], float16/bfloat16/float32/float64; may be a strided view
            (any row stride, any column stride).
        cu_num_rows: [num_reqs + 1], int32 or int64, same device, non-decreasing;
            request i owns rows ``cu_num_rows[i]:cu_num_rows[i+1]``.
        returns: int32 [num_reqs] on ``logits.device``.

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

    On NaN: counted (+Inf/-Inf are not counted, but they are sanitized).
    Rows outside every request are ignored; requests with no rows get 0.

    Examples
    --------
    >>> x = torch.tensor([[0.0, float("nan")], [1.0, 2.0], [float("nan")] * 2])
    >>> nan_counts_per_request(x, torch.tensor([0, 2, 2, 3]))
    tensor([1, 0, 2], dtype=torch.int32)
    """
    _check_counts_inputs(logits, cu_num_rows, backend)
    if check_inputs:
        _check_cu_values(cu_num_rows, logits.shape[0])
    if _pick_backend(backend, logits.device) == "torch":
        return _nan_counts_reference(logits, cu_num_rows, sanitize=sanitize)
    from . import _triton_counts

    return _triton_counts.nan_counts_triton(logits, cu_num_rows, sanitize=sanitize)
