"""Package hygiene: the public API, lazy triton, no side effects at import, the demo."""

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numerics

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = [
    "sanitize_nan_logits", "AsyncNanWarner", "maybe_warn_nan", "nan_counts_per_request",
    "raise_if_nan_logits", "NanLogitsError", "NanPolicy", "nonfinite_row_mask", "SANITIZE_MAX",
]


def test_contract_names_are_exported_and_documented():
    for name in CONTRACT:
        obj = getattr(numerics, name)
        assert name in numerics.__all__
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name


def test_import_is_lazy_and_side_effect_free():
    code = (
        "import logging, sys, numerics;"
        "assert 'triton' not in sys.modules, 'triton imported eagerly';"
        "assert not any(m.startswith(('samplers', 'spec_decode')) for m in sys.modules);"
        "assert logging.getLogger('safespec.numerics').handlers == [];"
        "assert logging.getLogger().handlers == []"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)


def test_demo_runs_and_shows_each_step():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_module("numerics.demo", run_name="__main__")
    text = out.getvalue()
    for expected in ("sanitize", "temperature", "NaN counts per request", "NanLogitsError"):
        assert expected in text, expected
