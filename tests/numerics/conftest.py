"""numerics tests: run the Triton kernel under the interpreter on CPU-only machines.

TRITON_INTERPRET must be set before numerics.triton_counts (and its @triton.jit)
is imported; that module is imported lazily, so setting it here is early enough.
On a CUDA machine the kernel runs compiled on the GPU instead.
"""

import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numerics  # noqa: E402

from numerics_testutil import DEVICE  # noqa: E402


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _fresh_process_warner():
    """Each test starts with a process-wide warner that has not warned yet."""
    numerics.reset_nan_warner()
    yield
    numerics.reset_nan_warner()


@pytest.fixture
def nan_log(caplog):
    caplog.set_level(logging.WARNING, logger="safespec.numerics")
    return caplog
