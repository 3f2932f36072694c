"""Tests for spec_decode.cpu.capability: the CPU flags, the CPU kinds, the routes summary, and the clean fallback where a
CPU has no AVX2 (forced with ``ATEN_CPU_CAPABILITY=default``, which makes torch, and so the kernel check,
see a CPU without AVX2 whatever this machine has)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from spec_decode.cpu import CPU_KINDS, cpu_kind, routes_summary
from spec_decode.cpu.capability import cpu_has_amx, cpu_has_native_bf16


@pytest.mark.parametrize("flags,kind", [
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "amx"),
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "avx512_bf16"),
    ({"avx2", "fma", "avx512f"}, "avx512"),
    ({"avx2", "fma"}, "avx2"),
    ({"avx", "sse4_2"}, "no-avx2"),
    ({"avx2"}, "no-avx2"),   # the kernels need FMA too
    (set(), "no-avx2"),
])
def test_each_cpu_kind_is_named_from_its_flags(flags, kind):
    assert cpu_kind(flags) == kind and kind in CPU_KINDS


def test_the_summary_names_this_cpu_kind_and_the_kernel_paths():
    line = routes_summary()
    assert f"CPU kind {cpu_kind()}" in line
    assert "panel kernel on avx" in line or "no panel kernel" in line


_NO_AVX2 = textwrap.dedent("""
    import warnings
    import torch
    from spec_decode import SpecDecoder
    from spec_decode.cpu import cpu_gemm, routes_summary
    from spec_decode.models import Transformer

    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    assert not cpu_gemm.available()
    target = Transformer.from_pretrained({path!r}, dtype=torch.float32)
    try:
        SpecDecoder(target, method="none", batch_invariant=True)
        raise SystemExit("batch_invariant=True was accepted without the kernels")
    except ValueError as err:
        assert "batch_invariant=True" in str(err) and "AVX2" in str(err), err
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dec = SpecDecoder(target, method="none")
        out = dec.generate([[1, 2, 3, 4]], max_new_tokens=4, ignore_eos=True)
        dec.generate([[5, 6, 7]], max_new_tokens=4, ignore_eos=True)
    ours = [str(w.message) for w in seen if "safespec" in str(w.message)]
    assert len(ours) == 1 and "batch-invariant routes are off" in ours[0], ours
    assert dec.batch_invariant is False and len(out[0].token_ids) == 4
    print(routes_summary())
""")


@pytest.mark.slow
def test_a_cpu_without_avx2_falls_back_with_one_warning(safespec_tiny_target_path):
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    proc = subprocess.run([sys.executable, "-c", _NO_AVX2.format(path=str(safespec_tiny_target_path))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no panel kernel" in proc.stdout


@pytest.mark.parametrize("flags,native,amx", [
    ("fpu avx2 fma", False, False),
    ("fpu avx2 avx512f avx512_bf16", True, False),                 # AVX-512 bf16 (Zen 4)
    ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", True, True),     # AMX (Sapphire Rapids)
])
def test_cpu_flags_name_native_bf16_and_amx(flags, native, amx):
    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: amx_bf16_fake\n"   # only the flags line counts
    assert cpu_has_native_bf16(cpuinfo) is native and cpu_has_amx(cpuinfo) is amx
