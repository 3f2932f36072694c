"""Short dtype names (``"bf16"``, ``"fp16"``, ``"fp32"``) and their torch dtypes: the one map the project uses.

The command line (``spec-bench --dtype``), the pytest plugin (``--spec-dtype``) and the tests all
spell dtypes this way; each reads this module instead of keeping its own table.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Short name -> torch dtype."""

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a short name (``"bf16"`` -> ``torch.bfloat16``).

    Raises ValueError naming the accepted names when ``name`` is not one of them.
    """
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}") from None


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU flags include ``avx512_bf16`` or ``amx_bf16`` (Linux ``/proc/cpuinfo``;
    ``cpuinfo`` replaces the file's text). Elsewhere bf16 matmuls run emulated, in fp32 units."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})
