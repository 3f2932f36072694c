"""In-place NaN/Inf sanitizing of logits, and a per-row non-finite mask.

Why +-1e30 and not the dtype's min/max: samplers divide logits by a temperature
before the softmax. ``torch.finfo(float32).max / 1e-6`` overflows back to Inf and
the softmax returns NaN again, whereas ``1e30 / 1e-6 = 1e36`` stays finite in
float32 (max ~3.4e38). That is also why *finite* values beyond +-1e30 are clamped
to +-1e30: a finite 1e38 would overflow under the same division. Finite values
with ``|x| <= 1e30`` are left bit-identical (``-0.0`` stays ``-0.0``).

Exact constants (the value of the dtype closest to 1e30):

=========  ============================  ==============
dtype      bound ``c``                   bits of ``+c``
=========  ============================  ==============
float64    1e30                          0x46293E5939A08CEA
float32    1.0000000150474662e30         0x7149F2CA
bfloat16   1.0002555517425873e30         0x714A
float16    65504 (largest finite)        0x7BFF
=========  ============================  ==============

float16 cannot hold 1e30, so it uses its largest finite magnitude. The softmax
invariant still holds after ``.float()``: ``65504 / 1e-6 = 6.6e10`` is finite.
"""

from __future__ import annotations

import torch

from .warner import maybe_warn_nan

SANITIZE_MAX: float = 1e30
"""Magnitude that NaN/+-Inf (and finite values beyond it) are mapped to."""

# Each bound is exactly representable in its dtype, so torch, the GPU compiler and
# the Triton interpreter (which truncates fp32 -> bf16 casts) all store the same bits.
_SANITIZE_BOUND: dict[torch.dtype, float] = {
    torch.float64: 1e30,
    torch.float32: 1.0000000150474662e30,  # fp32 nearest 1e30, bits 0x7149F2CA
    torch.bfloat16: 1.0002555517425873e30,  # bf16 nearest 1e30, bits 0x714A
    torch.float16: 65504.0,  # float16 max, bits 0x7BFF
}


def sanitize_bound(dtype: torch.dtype) -> float:
    """Return the sanitize magnitude ``c`` for ``dtype`` (NaN -> -c, +Inf -> +c, -Inf -> -c).

    Raises ``ValueError`` for dtypes that are not float16/bfloat16/float32/float64.
    """
    try:
        return _SANITIZE_BOUND[dtype]
    except KeyError:
        raise ValueError(
            f"logits: dtype {dtype} is not supported; expected one of "
            "float16, bfloat16, float32, float64"
        ) from None


def check_float_logits(logits: torch.Tensor, name: str = "logits") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``logits`` is a supported float tensor."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in _SANITIZE_BOUND:
        raise ValueError(
            f"{name}: dtype {logits.dtype} is not supported; expected one of "
            "float16, bfloat16, float32, float64"
        )


def distinct_elements(x: torch.Tensor) -> torch.Tensor:
    """``x`` without its broadcast dimensions (stride 0, size > 1): each memory location once.

    In-place ops refuse an expanded view ("more than one element of the written-to tensor
    refers to a single memory location"); an elementwise op on this narrower view writes the
    same memory, so every element of ``x`` sees the result.
    """
    for dim in range(x.dim()):
        if x.stride(dim) == 0 and x.shape[dim] > 1:
            x = x.narrow(dim, 0, 1)
    return x


def sanitize_reference(logits: torch.Tensor) -> torch.Tensor:
    """Pure-torch in-place sanitize; no warning, no validation, no host sync. Returns ``logits``."""
    c = _SANITIZE_BOUND[logits.dtype]
    distinct = distinct_elements(logits)
    torch.nan_to_num_(distinct, nan=-c, posinf=c, neginf=-c)
    # Finite values beyond +-c would overflow after division by a small temperature.
    distinct.clamp_(-c, c)
    return logits


def sanitize_nan_logits(logits: torch.Tensor, msg: str = "", *, warn: bool = True) -> torch.Tensor:
    """Replace NaN/Inf in ``logits`` in place with large finite values and return it.

    NaN -> -c, +Inf -> +c, -Inf -> -c, and finite values beyond +-c clamp to +-c,
    where c = 1e30 (float32/bfloat16/float64: the dtype value nearest 1e30) or
    65504 (float16). Finite values within +-c stay bit-identical. Never syncs the host.

    Invariant: afterwards ``torch.softmax(logits.float() / t, -1)`` is finite and
    sums to 1 for any temperature t in [1e-6, 1e6], whole-NaN rows included
    (such a row becomes uniform).

    Shape:
        logits: any shape, float16/bfloat16/float32/float64, any device, may be a view,
            including an expanded (stride-0) view: each memory location it shares is
            sanitized once, and every element that refers to it reads the result (the base
            tensor changes, as with any in-place op on a view).
        returns: the same tensor object.

    Parameters
    ----------
    logits : Tensor
        Modified in place.
    msg : str
        Call-site name used by the one-shot NaN warning (``maybe_warn_nan``).
    warn : bool
        If True (default), feed ``logits`` to the process-wide one-shot
        ``AsyncNanWarner`` before sanitizing (async on CUDA, no host sync).

    On NaN: replaced by -c, so a NaN token is never sampled unless its whole row
    is NaN, in which case the row is uniform after softmax.

    Examples
    --------
    >>> x = torch.tensor([[0.5, float("nan"), float("inf")]])
    >>> sanitize_nan_logits(x, warn=False)
    tensor([[ 5.0000e-01, -1.0000e+30,  1.0000e+30]])
    """
    check_float_logits(logits)
    if warn:
        maybe_warn_nan(logits, msg or "sanitize_nan_logits")
    return sanitize_reference(logits)


def _nan_where_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """``x * 0``: 0 (or -0) where ``x`` is finite, NaN where it is NaN or +-Inf. [..., V] -> [..., V].

    The row masks below are built from this, a sum and a min, not from ``isfinite`` and
    ``all``/``any``: on CPU torch vectorises its arithmetic and float reductions but not its
    elementwise compares, so the compares dominate a sampler's step over a real vocabulary.
    """
    return x * 0


def _check_rows(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating point tensor, got dtype {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension [..., V], got a 0-d tensor")


def nonfinite_row_mask(x: torch.Tensor) -> torch.Tensor:
    """Return True for each row of ``x`` that holds any NaN or +-Inf. No host sync.

    Shape:
        x: [..., V] floating point.
        returns: bool [...] (``x.shape[:-1]``).

    A row with V == 0 is finite (False).
    """
    _check_rows(x)
    return torch.isnan(_nan_where_nonfinite(x).sum(-1))


def dead_row_mask(x: torch.Tensor) -> torch.Tensor:
    """Return True for each *dead row* of ``x``: no finite value (all NaN or +-Inf). No host sync.

    Shape:
        x: [..., V] floating point.
        returns: bool [...] (``x.shape[:-1]``).

    A row with V == 0 is not dead (False). Sanitizing turns a dead row into a uniform
    (or Inf-peaked) distribution that carries no information; ``NanPolicy.GUARD``
    finishes the request instead.
    """
    _check_rows(x)
    if x.shape[-1] == 0:
        return torch.zeros(x.shape[:-1], dtype=torch.bool, device=x.device)
    # 1 where x is not finite, 0 where it is: the row is dead when its minimum is 1
    return _nan_where_nonfinite(x).nan_to_num_(nan=1.0).amin(-1) == 1
