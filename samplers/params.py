"""Argument checks shared by the samplers, and ``SamplingParams``, the one parser of
per-row sampling parameters (the samplers' own functions and ``spec_decode`` use it).

Every check here looks only at shapes, dtypes, devices and Python values, so none of
them syncs with the device. Value checks on tensors (ids in range, per-row parameters in
range) need a sync; they live in the ``check_*_values`` helpers and run only when a
public function is called with ``check_inputs=True``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    check_not_meta(x, name)
    return x


def check_int_tensor(x: object, name: str, ndim: int) -> torch.Tensor:
    """Raise ValueError unless ``x`` is an integer tensor with ``ndim`` dimensions."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    check_not_meta(x, name)
    return x


def check_not_meta(x: torch.Tensor, name: str) -> None:
    """A meta tensor has a shape but no values: nothing can be sampled from it."""
    if x.is_meta:
        raise ValueError(f"{name} is a meta tensor (a shape without values); give a tensor on cpu or cuda")


def float32_value(x: float) -> float:
    """``x`` as a float32 tensor holds it: rounded to nearest, +-inf past float32's range. A positive
    temperature below float32's smallest subnormal becomes 0 (greedy), as it would in a tensor."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def check_shape(x: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the logits/probs are on {device}")


def check_vocab(vocab: int, name: str) -> None:
    if vocab < 1:
        raise ValueError(f"{name} has an empty vocabulary dimension")


def check_generator(generator: object, device: torch.device, rows: int | None = None) -> None:
    """A generator is None, a ``torch.Generator``, or a sequence of them, one per batch row.

    Each must be on the same device type as the tensors; a sequence must have ``rows``
    entries (``rows=None``: any length).
    """
    if generator is None:
        return
    if isinstance(generator, torch.Generator):
        gens, where = [generator], "generator"
    elif isinstance(generator, Sequence) and not isinstance(generator, (str, bytes)):
        if rows is not None and len(generator) != rows:
            raise ValueError(f"generator has {len(generator)} entries for {rows} batch rows; give one per row")
        gens, where = generator, "generator[{}]"
    else:
        raise ValueError(
            f"generator must be a torch.Generator or a sequence of them (one per row), got {type(generator).__name__}"
        )
    for i, g in enumerate(gens):
        name = where.format(i)
        if not isinstance(g, torch.Generator):
            raise ValueError(f"{name} must be a torch.Generator, got {type(g).__name__}")
        if g.device.type != device.type:
            raise ValueError(f"{name} is on {g.device} but the tensors are on {device}")


# ----------------------------------------------------------------------------- per-row parameters


@dataclass(frozen=True)
class _Spec:
    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    integer: bool
    off: float  # the value that None stands for
    text: str


_SPECS = {
    # temperature: None means no scaling (1.0); inf is rejected (it would revive masked tokens).
    "temperature": _Spec(0.0, math.inf, False, True, False, 1.0, "a finite number >= 0 in float32"),
    "top_k": _Spec(0, 2**63, False, True, True, 0, "an int in [0, 2**63) (0 or None disables top-k)"),
    "top_p": _Spec(0.0, 1.0, True, False, False, 1.0, "in (0, 1] (1 or None disables top-p)"),
    "min_p": _Spec(0.0, 1.0, False, False, False, 0.0, "in [0, 1] (0 or None disables min-p)"),
}


def _host_value(value: object, name: str) -> float | int:
    """Validate one host value (a number or None) of parameter ``name``; None -> its off value.

    Every value is checked as the tensor entry it becomes: top_k as an int64 (exactly, so 2**63 is
    too large), the others as their float32 (so 1e-46 is a temperature of 0, greedy, and 1e300 is
    inf, rejected).
    """
    spec = _SPECS[name]
    if value is None:
        return spec.off
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"must be a number or None, got {type(value).__name__}")
    if spec.integer:
        x = _host_int(value, spec)
    else:
        try:
            x = float32_value(float(value))
        except OverflowError:   # an int beyond float64
            raise ValueError(f"must be {spec.text}, got {shown_value(value)}") from None
    nan = isinstance(x, float) and math.isnan(x)   # an int may be past float64: math.isnan would overflow
    ok = not nan and (spec.lo < x if spec.lo_open else spec.lo <= x) and (x < spec.hi if spec.hi_open else x <= spec.hi)
    if not ok:
        raise ValueError(f"must be {spec.text}, got {shown_value(value)}")
    return x


def _host_int(value: Real, spec: _Spec) -> int:
    """An integral number as an exact int (a float must be integral); out-of-range values are left to the caller."""
    if isinstance(value, Integral):
        return int(value)
    x = float(value)
    if not x.is_integer():
        raise ValueError(f"must be an integer, got {value!r}" if math.isfinite(x) else f"must be {spec.text}, got {value!r}")
    return int(x)


def shown_value(value: object) -> str:
    """``repr(value)``, or its size for an int too long to print (Python refuses str() past 4300 digits)."""
    if isinstance(value, Integral) and abs(int(value)).bit_length() > 128:
        return f"an int of {abs(int(value)).bit_length()} bits"
    return repr(value)


def _tensor_value(value: torch.Tensor, name: str, batch: int, device: torch.device) -> torch.Tensor:
    """Shape/dtype/device checks of a per-row tensor [B]. Values are checked here on CPU, and on
    other devices only by ``check_inputs`` (reading them there is a host sync)."""
    spec = _SPECS[name]
    if value.dim() != 1 or value.shape[0] != batch:
        raise ValueError(f"{name} must be a scalar, a list or a tensor of shape ({batch},), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but the logits are on {device}")
    if spec.integer and value.dtype not in INT_DTYPES:
        raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
    if not spec.integer and value.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor, got {value.dtype}")
    value = value.to(torch.int64 if spec.integer else torch.float32)
    if value.device.type == "cpu":
        check_row_param_values(value, name)  # a CPU tensor is read without a device sync
    return value


def _parse_param(value: object, name: str, batch: int, device: torch.device):
    """-> (tensor [B] or None when disabled for every row, host values list or None if unknown)."""
    spec = _SPECS[name]
    dtype = torch.int64 if spec.integer else torch.float32
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu":
        value = value.item()  # CPU scalar: no device sync
    if isinstance(value, torch.Tensor):
        return _tensor_value(value, name, batch, device), None
    if isinstance(value, (list, tuple)):
        if len(value) != batch:
            raise ValueError(f"{name} has {len(value)} entries for {batch} rows")
        host = []
        for row, v in enumerate(value):
            try:
                host.append(_host_value(v, name))
            except ValueError as err:
                raise ValueError(f"{name}[{row}] {err}") from None
    else:
        try:
            host = [_host_value(value, name)] * batch
        except ValueError as err:
            raise ValueError(f"{name} {err}") from None
    if name != "temperature" and all(v == spec.off for v in host):
        return None, host  # disabled everywhere: the samplers skip that work
    return torch.tensor(host, dtype=dtype, device=device), host


def check_row_param_values(value: torch.Tensor | None, name: str) -> None:
    """Range-check a per-row parameter tensor. Syncs with the device (check_inputs only)."""
    if value is None:
        return
    spec = _SPECS[name]
    v = value.double()
    ok = ~torch.isnan(v) & (v > spec.lo if spec.lo_open else v >= spec.lo) & (v < spec.hi if spec.hi_open else v <= spec.hi)
    bad = (~ok).nonzero().flatten().tolist()  # host sync: check_inputs=True only
    if bad:
        raise ValueError(f"{name} must be {spec.text}; rows {bad[:8]} are not "
                         f"(values {v[bad[:8]].tolist()})")


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters as device tensors [B], plus host facts about the batch.

    Build it with :meth:`SamplingParams.build`; every sampler parses its keyword
    arguments through it, so the rules are the same everywhere:

    * each parameter is a scalar (every row), a list/tuple with one entry per row, or a
      tensor [B] on the logits' device; a ``None`` scalar or entry means "off":
      temperature 1.0 (no scaling), top_k 0, top_p 1.0, min_p 0.0;
    * temperature 0 is greedy (one-hot on the first argmax); temperatures must be finite
      (``inf`` would make masked tokens samplable); a host value is taken as the float32 it
      becomes, so one below float32's smallest subnormal (``1e-46``) is 0, greedy, as it is in a
      tensor, and one past float32's range (``1e39``) is inf, rejected;
    * host values and CPU tensors are range-checked at once, naming the argument and the
      rows; tensors on another device only with ``check_inputs=True`` (one host sync).

    Shape:
        temperature: float32 [B]. top_k: int64 [B] or None. top_p, min_p: float32 [B] or
        None (None: disabled in every row, so the samplers skip the sort).

    ``all_greedy`` is True only when every row's temperature is known on the host to be 0
    (then the samplers skip the [B, V] draw); ``all_sampled`` only when every row's is known
    to be > 0 (then ``process_logits`` skips the greedy rows' one-hot). Both stay valid,
    conservatively, under :meth:`select` and :meth:`repeat`.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    all_greedy: bool = False
    all_sampled: bool = False

    @classmethod
    def build(
        cls,
        batch: int,
        temperature=1.0,
        top_k=None,
        top_p=None,
        min_p=None,
        *,
        device: torch.device | str | None = None,
        check_inputs: bool = False,
    ) -> "SamplingParams":
        """Validate scalars, per-row lists or tensors [B] into device tensors [B].

        Raises ValueError naming the argument (and the row, for lists) on a bad value.
        ``device`` defaults to the CPU.
        """
        if isinstance(batch, bool) or not isinstance(batch, Integral) or batch < 0:
            raise ValueError(f"batch must be an int >= 0, got {batch!r}")
        device = torch.device("cpu" if device is None else device)
        temp, temp_host = _parse_param(temperature, "temperature", batch, device)
        params = cls(
            temperature=temp,
            top_k=_parse_param(top_k, "top_k", batch, device)[0],
            top_p=_parse_param(top_p, "top_p", batch, device)[0],
            min_p=_parse_param(min_p, "min_p", batch, device)[0],
            all_greedy=temp_host is not None and all(t == 0 for t in temp_host),
            all_sampled=temp_host is not None and all(t > 0 for t in temp_host),
        )
        if check_inputs:
            params.check_values()
        return params

    def check_values(self) -> None:
        """Range-check every parameter tensor, naming the parameter and rows. One host sync."""
        for name in _SPECS:
            check_row_param_values(getattr(self, name), name)

    @property
    def batch(self) -> int:
        return self.temperature.shape[0]

    def select(self, idx) -> "SamplingParams":
        """The rows ``idx`` (a LongTensor or a list of row indices), in that order."""
        if not isinstance(idx, torch.Tensor):
            idx = torch.tensor(list(idx), dtype=torch.long, device=self.temperature.device)
        pick = lambda t: None if t is None else t.index_select(0, idx)  # noqa: E731
        return replace(self, temperature=pick(self.temperature), top_k=pick(self.top_k),
                       top_p=pick(self.top_p), min_p=pick(self.min_p))

    def repeat(self, n: int) -> "SamplingParams":
        """Each row's parameters repeated for ``n`` consecutive rows ([B] -> [B*n])."""
        rep = lambda t: None if t is None else t.repeat_interleave(n)  # noqa: E731
        return replace(self, temperature=rep(self.temperature), top_k=rep(self.top_k),
                       top_p=rep(self.top_p), min_p=rep(self.min_p))

    def kwargs(self) -> dict:
        """Keyword arguments for ``sample``, ``logits_to_probs`` and ``tree_verify``."""
        return dict(temperature=0.0 if self.all_greedy else self.temperature,
                    top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


def check_ids_in_range(ids: torch.Tensor, name: str, vocab: int) -> None:
    """Raise ValueError if any id lies outside [0, vocab). Syncs (check_inputs only)."""
    bad = ((ids < 0) | (ids >= vocab)).nonzero().tolist()  # host sync: check_inputs=True only
    if bad:
        raise ValueError(f"{name} holds ids outside [0, {vocab}) at {bad[:8]}")
