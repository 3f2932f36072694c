"""Short dtype names (``"bf16"``, ``"fp16"``, ``"fp32"``) and their torch dtypes: the one map the project uses;
and the resolution of the ``dtype`` and ``device`` arguments users pass to the loaders.

The command line (``spec-bench --dtype``), the pytest plugin (``--spec-dtype``) and the tests all
spell dtypes this way; each reads this module instead of keeping its own table.
"""

from __future__ import annotations

import torch

from spec_decode.dtype_names import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
"""Short name -> torch dtype."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a short name (``"bf16"`` -> ``torch.bfloat16``).

    Raises ValueError naming the accepted names when ``name`` is not one of them.
    """
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}") from None


_DTYPE_ALIASES: dict[str, torch.dtype] = {
    **DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "float": torch.float32,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A model dtype from a torch dtype or a name (``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"``/
    ``"half"``, ``"float32"``/``"fp32"``/``"float"``). ValueError naming ``dtype`` otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPE_ALIASES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    raise ValueError(f"dtype must be torch.bfloat16/float16/float32 or one of {', '.join(_DTYPE_ALIASES)}, "
                     f"got {dtype!r}")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """A device from None (CUDA when available, else the CPU), a ``torch.device`` or its name
    (``"cpu"``, ``"cuda"``, ``"cuda:1"``). ValueError naming ``device`` for a name torch does not
    know, a device type other than cpu and cuda (``"meta"``, ``"mps"``, ``"xpu"``), or a CUDA device
    this machine does not have."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be None, a torch.device or a name such as 'cpu' or 'cuda:1', got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be None, a torch.device or a name such as 'cpu' or 'cuda:1', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):   # meta holds no values; mps, xpu and the rest are untested here
        raise ValueError(f"device must be cpu or cuda[:N] (the devices safespec runs on), got {device!r}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"device {device!r} is not available: this machine has {count} CUDA device(s)")
    return dev
