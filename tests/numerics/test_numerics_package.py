"""Package hygiene: the public API, lazy triton, no side effects at import, the demo."""

import os
import subprocess
import sys
from pathlib import Path

import numerics

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = [
    "sanitize_nan_logits", "AsyncNanWarner", "maybe_warn_nan", "nan_counts_per_request",
    "raise_if_nan_logits", "NanLogitsError", "NanPolicy", "nonfinite_row_mask", "SANITIZE_MAX",
    "nonfinite_counts_per_request", "NonfiniteCounts", "dead_row_mask",
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
    # A subprocess, as `make demo` runs it (runpy inside pytest meets the assertion-rewriting
    # import hook that the installed pytest plugin puts over the whole distribution).
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "examples/numerics_tour.py"], capture_output=True, text=True,
                          cwd=root, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for expected in ("sanitize", "temperature", "NaN counts per request", "NanLogitsError"):
        assert expected in text, expected
