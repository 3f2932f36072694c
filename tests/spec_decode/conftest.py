"""Fixtures over the small random-model factories in ``tiny_models`` (shared with the pipeline tests).

``factories`` is a namespace holding ``tiny_config``, ``make_tiny_target``, ``make_tiny_eagle`` and
``make_tiny_eagle3``; ``tiny_target_dir`` is a saved target and ``tiny_target`` the same loaded in fp32.
Module-scoped fixtures import the factories directly: ``from tiny_models import ...``.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from spec_decode.models import Transformer
from tiny_models import make_tiny_eagle, make_tiny_eagle3, make_tiny_target, tiny_config


@pytest.fixture
def factories():
    """Namespace with tiny_config, make_tiny_target, make_tiny_eagle, make_tiny_eagle3."""
    return types.SimpleNamespace(tiny_config=tiny_config, make_tiny_target=make_tiny_target,
                                 make_tiny_eagle=make_tiny_eagle, make_tiny_eagle3=make_tiny_eagle3)


@pytest.fixture
def tiny_target_dir(tmp_path) -> Path:
    """A saved random tiny target (float32)."""
    return make_tiny_target(tmp_path)


@pytest.fixture
def tiny_target(tiny_target_dir) -> Transformer:
    """The tiny target loaded in float32."""
    return Transformer.from_pretrained(tiny_target_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real model's converted directory (``spec_decode.fixtures.smollm2_target_dir``); skips naming
    the extra when the smollm2 packages are absent."""
    from spec_decode import fixtures

    try:
        return fixtures.smollm2_target_dir()
    except ImportError as e:
        pytest.skip(str(e))


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch) -> list:
    """The names of every tensor -> host read made while the test runs, in order."""
    calls = []
    for name in HOST_READS:
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


@pytest.fixture(scope="session")
def triton_kernel_module():
    """``load(name)``: the Triton kernel module ``name``, reloaded under ``TRITON_INTERPRET=1`` on a machine
    without CUDA (the variable is read when a kernel is defined); skips when triton is absent."""
    import importlib
    import os
    from unittest import mock

    def load(name: str):
        pytest.importorskip("triton")
        module = importlib.import_module(name)
        if not torch.cuda.is_available() and not module.interpreter_active():
            with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
                module = importlib.reload(module)
        return module

    return load
