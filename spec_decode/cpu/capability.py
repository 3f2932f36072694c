"""What this CPU runs well: its flags (``cpu_flags``, from ``/proc/cpuinfo``) and the checks that pick
``Linear``'s CPU routes (each cached for the process)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from spec_decode.cpu import cpu_gemm

FP32_PACK_MIN_OUT = 1024            # AVX-512 fp32: outputs from which oneDNN beats F.linear on two rows or more
FP32_PACK_ONE_ROW_MIN_OUT = 3072    # ... and on one row
FP32_PACK_MIN_OUT_AVX2 = 2048       # AVX2 fp32: from two rows on (on one row F.linear is never slower)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's flags from Linux ``/proc/cpuinfo`` (``cpuinfo`` replaces the file's text); empty elsewhere."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return flags


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU flags include ``avx512_bf16`` or ``amx_bf16`` (``cpu_flags``). Elsewhere bf16
    matmuls run emulated, in fp32 units."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """True when the CPU flags include ``amx_bf16``: oneDNN then runs bf16 matmuls on AMX tiles, whose
    bits differ from its AVX-512 kernels'."""
    return "amx_bf16" in cpu_flags(cpuinfo)


def fp32_packs(out_features: int, rows: int, avx512: bool | None = None) -> bool:
    """Whether an fp32 projection to ``out_features`` over ``rows`` rows takes ``Linear``'s packed path.

    ``avx512``: which CPU class's thresholds apply; None means this CPU's.
    """
    if avx512 if avx512 is not None else _cpu_is_avx512():
        return out_features >= FP32_PACK_ONE_ROW_MIN_OUT or (out_features >= FP32_PACK_MIN_OUT and rows >= 2)
    return out_features >= FP32_PACK_MIN_OUT_AVX2 and rows >= 2


@functools.cache
def _cpu_is_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _onednn_packed_op_and(cpu_check) -> bool:
    """oneDNN is available, torch has the packed linear op, and ``cpu_check()`` holds (False on any error)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                    and cpu_check())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def panel_gemm_pays() -> bool:
    """True on an AVX2 CPU (not AVX-512, where it was not measured) where ``cpu_gemm``'s kernel runs."""
    return not _cpu_is_avx512() and cpu_gemm.available()


@functools.cache
def onednn_bf16_native() -> bool:
    """True when this CPU runs oneDNN's bf16 kernels (AVX-512 BW and up) and torch has the packed op."""
    return _onednn_packed_op_and(lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def onednn_fp32_packing_pays() -> bool:
    """True on an AVX-512 or AVX2 CPU with oneDNN and the packed op: where ``fp32_packs`` was measured."""
    return _onednn_packed_op_and(lambda: torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AVX2")))


@functools.cache
def bf16_runs_as_fp32() -> bool:
    """True on a CPU without native bf16 matmuls, where ``Linear`` computes bf16 from float32 weights."""
    return not onednn_bf16_native() and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


CPU_KINDS = ("amx", "avx512_bf16", "avx512", "avx2", "no-avx2")
"""The CPU kinds the project meets, best first: each takes other routes (figures are labelled with it)."""


def cpu_kind(flags: set[str] | None = None) -> str:
    """This CPU's kind, one of ``CPU_KINDS``, from its flags (``flags`` replaces ``cpu_flags()``)."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "no-avx2"


def routes_summary() -> str:
    """One line: the CPU kind and the routes this process takes, for test logs and benchmark results."""
    if cpu_gemm.available():
        kernel = f"panel kernel on {cpu_gemm.isa()} (paths this CPU runs: {', '.join(cpu_gemm.runnable_isas())})"
    else:
        kernel = "no panel kernel (batch-invariant routes off)"
    return (f"CPU kind {cpu_kind()}, torch capability {torch.backends.cpu.get_cpu_capability()}; {kernel}; "
            f"oneDNN bf16 {'native' if onednn_bf16_native() else 'not native'}")


KERNELS_MISSING = ("the CPU kernels (spec_decode.cpu.cpu_gemm) cannot run here: an x86-64 CPU with AVX2 and FMA and "
                   "a C compiler are needed")
"""Why the batch-invariant routes are off on a CPU without the kernels (warnings and ValueErrors say it)."""

INVARIANCE_OFF_WARNED: set[str] = set()
"""The reasons ``warn_batch_invariance_off`` has warned of in this process (a test may clear it)."""


def warn_batch_invariance_off(reason: str) -> None:
    """One RuntimeWarning per ``reason`` and process: the default ``batch_invariant=None`` fell back."""
    if reason not in INVARIANCE_OFF_WARNED:
        INVARIANCE_OFF_WARNED.add(reason)
        warnings.warn(f"safespec: the batch-invariant routes are off ({reason}); a row's bits may depend on the "
                      f"row count and the batch (pass batch_invariant=False to choose this silently)",
                      RuntimeWarning, stacklevel=3)
