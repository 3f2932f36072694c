"""Argument checks shared by the samplers: tensors, per-row parameters, generators.

Every check here looks only at shapes, dtypes, devices and Python scalars, so none of
them syncs with the device. Value checks on tensors (ids in range, per-row parameters in
range) need a sync; they live in the ``check_*_values`` helpers and run only when a
public function is called with ``check_inputs=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def check_float_tensor(x: object, name: str, ndim: int) -> torch.Tensor:
    """Raise ValueError unless ``x`` is a floating tensor with ``ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16/bfloat16/float32/float64, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_int_tensor(x: object, name: str, ndim: int) -> torch.Tensor:
    """Raise ValueError unless ``x`` is an integer tensor with ``ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_shape(x: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the logits/probs are on {device}")


def check_vocab(vocab: int, name: str) -> None:
    if vocab < 1:
        raise ValueError(f"{name} has an empty vocabulary dimension")


def check_generator(generator: object, device: torch.device) -> None:
    """A generator must be a ``torch.Generator`` on the same device type as the tensors."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but the tensors are on {device}")


@dataclass(frozen=True)
class _Spec:
    lo: float
    hi: float
    lo_open: bool
    integer: bool
    text: str


_SPECS = {
    "temperature": _Spec(0.0, math.inf, False, False, ">= 0"),
    "top_k": _Spec(0, math.inf, False, True, ">= 0 (0 disables top-k)"),
    "top_p": _Spec(0.0, 1.0, True, False, "in (0, 1]"),
    "min_p": _Spec(0.0, 1.0, False, False, "in [0, 1]"),
}


def _scalar_ok(value: float, spec: _Spec) -> bool:
    if math.isnan(value):
        return False
    if spec.lo_open:
        return spec.lo < value <= spec.hi
    return spec.lo <= value <= spec.hi


def row_param(
    value: object, name: str, batch: int, device: torch.device
) -> torch.Tensor | None:
    """Turn a scalar-or-[B] parameter into a tensor [B] on ``device`` (None stays None).

    Shape:
        value: a Python number, a 0-d tensor, or a tensor [B].
        returns: float32 [B] (int64 [B] for ``top_k``), or None when disabled.

    Scalars (and 0-d tensors, which cost one host read, made only here at argument
    parsing) are range-checked at once; tensors [B] only by ``check_row_param_values``.
    """
    spec = _SPECS[name]
    if value is None:
        return None
    dtype = torch.int64 if spec.integer else torch.float32
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.device.type == "cpu":
            value = value.item()  # CPU scalar: no device sync
        else:
            if value.dim() != 1 or value.shape[0] != batch:
                raise ValueError(f"{name} must be a scalar or a tensor of shape ({batch},), got {tuple(value.shape)}")
            if value.device != device:
                raise ValueError(f"{name} is on {value.device} but the logits are on {device}")
            if spec.integer and value.dtype not in INT_DTYPES:
                raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
            if not spec.integer and value.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be a floating tensor, got {value.dtype}")
            return value.to(dtype)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number or a tensor [B], got {type(value).__name__}")
    if spec.integer and not isinstance(value, Integral) and not float(value).is_integer():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not _scalar_ok(float(value), spec):
        raise ValueError(f"{name} must be {spec.text}, got {value!r}")
    return torch.full((batch,), value, dtype=dtype, device=device)


def check_row_param_values(value: torch.Tensor | None, name: str) -> None:
    """Range-check a per-row parameter tensor. Syncs with the device (check_inputs only)."""
    if value is None:
        return
    spec = _SPECS[name]
    v = value.double()
    ok = ~torch.isnan(v) & (v > spec.lo if spec.lo_open else v >= spec.lo) & (v <= spec.hi)
    bad = (~ok).nonzero().flatten().tolist()  # host sync: check_inputs=True only
    if bad:
        raise ValueError(f"{name} must be {spec.text}; rows {bad[:8]} are not")


def check_ids_in_range(ids: torch.Tensor, name: str, vocab: int) -> None:
    """Raise ValueError if any id lies outside [0, vocab). Syncs (check_inputs only)."""
    bad = ((ids < 0) | (ids >= vocab)).nonzero().tolist()  # host sync: check_inputs=True only
    if bad:
        raise ValueError(f"{name} holds ids outside [0, {vocab}) at {bad[:8]}")
