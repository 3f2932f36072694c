"""Fixtures shared by the spec_decode tests (this directory and its subdirectories, which mirror the package).

Random models, from the factories in ``tiny_models``: ``factories`` is a namespace holding ``tiny_config``,
``make_tiny_target``, ``make_tiny_eagle`` and ``make_tiny_eagle3``; ``tiny_target_dir`` is a saved target and
``tiny_target`` the same loaded in fp32; ``random_models`` is one target with each kind of drafter, built once per
test module. Module-scoped fixtures of a test file import the factories directly: ``from tiny_models import ...``.

Shipped models: the pytest plugin (``spec_decode.integrations.pytest_plugin``) gives the path of each
(``safespec_tiny_target_path``, ``safespec_tiny_draft_path``, ``safespec_tiny_eagle_path``,
``safespec_tiny_eagle3_path``, ``safespec_tiny_prompts``); ``shipped_target`` is the target loaded in fp32,
``fixtures_dir`` and ``manifest`` the directory and manifest they come from, ``smollm2_dir`` the real model.
"""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def random_models(tmp_path_factory) -> dict:
    """Random fp32 models, built once per test module (a test may change a model's routes or compile it).

    ``target`` (seed 0), ``eagle`` (an EAGLE head), ``eagle3`` (an EAGLE-3 head with a 61-token draft
    vocabulary), ``draft`` (a one-layer draft LM, seed 5) and their saved dirs (``tdir``, ``eagle_dir``,
    ``eagle3_dir``, ``draft_dir``). Keyed by method name for tests that parametrize over methods:
    ``draft_model`` is the target drafting for itself and ``none`` is no drafter.
    """
    root = tmp_path_factory.mktemp("random_models")
    tdir = make_tiny_target(root, seed=0)
    target = Transformer.from_pretrained(tdir, dtype=torch.float32)
    eagle = make_tiny_eagle(target, root / "eagle")
    eagle3 = make_tiny_eagle3(target, root / "eagle3", draft_vocab_size=61)
    ddir = make_tiny_target(root, seed=5, name="draft", num_hidden_layers=1)
    draft = Transformer.from_pretrained(ddir, dtype=torch.float32)
    return dict(target=target, eagle=eagle, eagle3=eagle3, draft=draft, draft_model=target, none=None,
                tdir=tdir, eagle_dir=root / "eagle", eagle3_dir=root / "eagle3", draft_dir=ddir)


@pytest.fixture(scope="module")
def fixtures_dir(safespec_tiny_target_path) -> Path:
    """The shipped fixtures' directory (``fixtures/``: ``models/`` and ``prompts.jsonl``)."""
    return safespec_tiny_target_path.parent.parent


@pytest.fixture(scope="module")
def manifest(fixtures_dir) -> dict:
    """The shipped models' ``MANIFEST.json``: their files' hashes, recipe and recorded metrics."""
    return json.loads((fixtures_dir / "models" / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def shipped_target(safespec_tiny_target_path) -> Transformer:
    """The shipped tiny target (``fixtures/models/tiny-target``) loaded in fp32, once per test module."""
    return Transformer.from_pretrained(safespec_tiny_target_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real model's converted directory (``spec_decode.fixtures.smollm2_target_dir``); skips naming
    the extra when the smollm2 packages are absent."""
    from spec_decode import fixtures

    try:
        return fixtures.smollm2_target_dir()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture
def fast_routes(monkeypatch):
    """The fastest CPU routes (``batch_invariant=False``) for every ``Linear``, ``Attention`` and ``MLP`` made or
    run in the test: the tests that use it check those routes (cpu/test_batch_invariant.py checks the
    invariant ones)."""
    from spec_decode.cpu import Linear
    from spec_decode.models import Attention
    from spec_decode.models.layers import MLP

    monkeypatch.setattr(Linear, "batch_invariant", False)
    monkeypatch.setattr(Attention, "batch_invariant", False)
    monkeypatch.setattr(MLP, "batch_invariant", False)


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


AVX2_LIKE = lambda n: 1.0 if n <= 6 else 2.2   # noqa: E731  a block past the AVX2 kernel's rows costs two steps and more
FLAT = lambda n: 1.0 + 0.01 * (n - 1)          # noqa: E731  AVX-512-like: one row block up to the cap


@pytest.fixture
def verify_cost_curve(monkeypatch, tmp_path):
    """``install(curve)``: ``spec_decode.verify_cost.time_verify_blocks`` replaced by a stand-in whose block of
    ``n`` rows takes ``curve(n)`` seconds (``AVX2_LIKE``, ``FLAT`` or any function), with safespec's cache in
    ``tmp_path``; returns the list of the calls' row lists (one per timing pass)."""
    from spec_decode import disk_cache, verify_cost

    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(verify_cost.REMEASURE_ENV, raising=False)
    calls = []

    def install(curve):
        def fake(target, context, rows, repeats):
            rows = sorted(set(rows))
            calls.append(rows)
            return {n: [curve(n)] * repeats for n in rows}
        monkeypatch.setattr(verify_cost, "time_verify_blocks", fake)
        return calls

    return install
