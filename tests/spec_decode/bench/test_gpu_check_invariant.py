"""``spec-bench gpu-check``'s ``invariant`` step, run here under the Triton interpreter on small shapes (its
timing half needs CUDA): it passes on the kernels and catches a kernel whose rows depend on the block."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.slow  # the invariant kernels under the Triton interpreter, in subprocesses

_CHECK = """
import torch
from spec_decode.bench.gpu_check import check_invariant_rows
{mutant}
check_invariant_rows(torch.device("cpu"), rows=3, width=40, out=24, keys=37)
"""
# a block-dependent result: each row shifted by a multiple of the block's row count
_MUTANT = """
import spec_decode.cuda.invariant_linear as m
real = m.invariant_linear
m.invariant_linear = lambda x, w, b=None: real(x, w, b) * (1 + 2.0 ** -8 * (x.reshape(-1, x.shape[-1]).shape[0] - 1))
"""


def _run(mutant: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}   # must be set before triton is imported
    return subprocess.run([sys.executable, "-c", _CHECK.format(mutant=mutant)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_invariant_step_passes_on_the_kernels():
    proc = _run("")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_invariant_step_catches_rows_that_depend_on_the_block():
    proc = _run(_MUTANT)
    assert proc.returncode != 0 and "linear torch.bfloat16: row 0 differs" in proc.stderr
