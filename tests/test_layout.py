"""The library's layout, measured by ``tools/check_layout.py`` (issue 42): no import circle, small files
and functions, no timing figures in library code outside ``spec_decode/bench/``, the public exports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def layout():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "tools" / "check_layout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layout"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured(layout):
    return layout.measure()


def test_no_import_circles(measured):
    assert measured["circles"] == []


def test_layers_import_one_way(measured):
    assert measured["layers"] == []


def test_no_library_file_over_the_limit(layout, measured):
    long = [f for f in measured["files"] if f[0] > layout.MAX_FILE_LINES and f[1] not in layout.PENDING]
    assert long == []


def test_no_function_body_over_the_limit(layout, measured):
    long = [f for f in measured["functions"] if f[0] > layout.MAX_FUNCTION_LINES
            and f[1].split(":")[0] not in layout.PENDING]
    assert long == []


def test_timing_prose_outside_bench_is_rare(layout, measured):
    assert len(measured["timing"]) <= layout.MAX_TIMING_LINES, measured["timing"]


def test_spec_decode_exports_the_public_names(measured):
    assert measured["missing_exports"] == []


def test_the_checks_catch_what_they_measure(layout, tmp_path):
    """Mutants: a circle, a long function, a timing line and a long file are each seen."""
    for pkg in layout.PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "numerics" / "a.py").write_text("from numerics import b\n")
    (tmp_path / "numerics" / "b.py").write_text("def f():\n    from numerics.a import x\n")
    (tmp_path / "samplers" / "c.py").write_text("from spec_decode import d\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(layout.MAX_FUNCTION_LINES + 1))
    long_fn = tmp_path / "spec_decode" / "d.py"
    long_fn.write_text(f'def f():\n    """Doc."""\n{body}\n# this op costs ~10 us on CPU\n')
    graph = layout.import_graph(tmp_path)
    assert layout.import_circles(graph) == [["numerics.a", "numerics.b"]]
    assert layout.layer_violations(graph) == ["samplers.c -> spec_decode.d"]
    sizes = layout.function_sizes(long_fn, tmp_path)
    assert sizes == [(layout.MAX_FUNCTION_LINES + 1, "spec_decode/d.py:1 f")]
    assert [t.split(":")[0] for t in layout.timing_lines(tmp_path)] == ["spec_decode/d.py"]
