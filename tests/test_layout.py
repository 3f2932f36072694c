"""The library's layout, measured by ``tools/check_layout.py`` (issues 42 and 53): no import circle, small
files and functions, no timing figures in library code outside ``spec_decode/bench/``, the public exports;
no figure in library prose, no private name crossing modules, no function over the parameter limit but
the listed exemptions, and a test tree that mirrors the packages. Every check has a mutant: a synthetic
tree in ``tmp_path`` that breaks it, which the check must report."""

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


# ------------------------------------------------------------------ issue 53: prose, privacy, width, tests


def test_no_figures_in_library_prose(measured):
    assert measured["figures"] == [], "figures belong in docs/results/ beside their command:\n" + \
        "\n".join(measured["figures"])


def test_no_private_name_crosses_modules(measured):
    assert measured["private"] == [], "make the name public in its package:\n" + "\n".join(measured["private"])


def test_no_function_over_the_parameter_limit(layout, measured):
    assert measured["wide"] == [], f"over {layout.MAX_PARAMETERS} parameters: {measured['wide']}"


def test_every_parameter_exemption_names_a_function_and_a_reason(layout, measured):
    assert measured["stale_exemptions"] == []
    assert all(why.strip() for why in layout.EXEMPT_PARAMETERS.values())


def test_the_test_tree_mirrors_the_packages(measured):
    assert measured["unmirrored_tests"] == []


def _library(tmp_path, layout, files: dict[str, str]):
    """A synthetic checkout in ``tmp_path``: the three packages, plus ``files`` (relative path -> text)."""
    for pkg in layout.PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_figure_mutants_are_caught(layout, tmp_path):
    """Each kind of figure, in a comment or a docstring, is seen, in bench/ too; code and constants are not."""
    root = _library(tmp_path, layout, {
        "spec_decode/depth.py": '"""Costs jitter by 10-20 % between steps."""\n'
                                "x = 1  # drafts are 18 % likely\n"
                                "def f():\n    '''Doubles (up to 4x).'''\n"
                                "# the kernel is 1.35x the old one\n"
                                "# it runs 2 x faster here\n"
                                "# a 5-token block costs ~1.4 calls\n",
        "samplers/tree.py": "def g():\n    '''In a fixed ~40 ops.'''\n"
                            "    return '18 %'  # a string in code is not prose\n"
                            "# float32's largest value is ~3.4e38; ids like 0x1F and shapes 4x4 are fine\n",
        "spec_decode/bench/run.py": "# 2x faster, 18 %, ~3 calls: bench prose is library prose too\n"
                                    "x = '2x faster'  # a string in code, such as a report's format, is not prose\n",
    })
    found = [line.split(": ", 1)[0] for line in layout.prose_figures(root)]
    assert sorted(found) == sorted([f"spec_decode/depth.py:{i}" for i in (1, 2, 4, 5, 6, 7)] + ["samplers/tree.py:2",
                                                                                                "spec_decode/bench/run.py:1"])


def test_private_crossing_mutants_are_caught(layout, tmp_path):
    """A private name, a private module (absolute, relative, or as a module import) and a private
    attribute reached through an imported module are reported; a module's own private names and a
    package ``__init__`` re-exporting its private submodule's public names are not."""
    root = _library(tmp_path, layout, {
        "samplers/_params.py": "def check(): pass\ndef _helper(): pass\n",
        "samplers/__init__.py": "from ._params import check\n",
        "samplers/probs.py": "from samplers._params import check\n",
        "samplers/tree.py": "from . import _params\n",
        "spec_decode/requests.py": "def _build(): pass\ndef _own(): pass\nx = _own()\n",
        "spec_decode/pipeline.py": "from spec_decode.requests import _build\nfrom spec_decode import requests\n"
                                   "y = requests._own()\nimport samplers._params\n",
    })
    found = sorted(line.split(": ", 1)[1] for line in layout.private_crossings(root))
    assert found == sorted([
        "samplers.probs -> samplers._params.check",
        "samplers.tree -> samplers._params",
        "spec_decode.pipeline -> spec_decode.requests._build",
        "spec_decode.pipeline -> spec_decode.requests._own",
        "spec_decode.pipeline -> samplers._params",
    ])
    (root / "samplers" / "__init__.py").write_text("from ._params import _helper\n")
    assert "samplers -> samplers._params._helper" in [line.split(": ", 1)[1]
                                                       for line in layout.private_crossings(root)]


def test_wide_function_mutants_are_caught(layout, tmp_path, monkeypatch):
    """Nine parameters are reported (self not counted; *args, **kwargs and keyword-only counted),
    eight are not, an exempt name is not, and an exemption that matches nothing is reported."""
    nine = ", ".join(f"a{i}" for i in range(layout.MAX_PARAMETERS + 1))
    eight_with_self = ", ".join(["self"] + [f"a{i}" for i in range(layout.MAX_PARAMETERS)])
    root = _library(tmp_path, layout, {
        "spec_decode/step.py": f"def wide({nine}): pass\n"
                               f"class C:\n    def ok({eight_with_self}): pass\n"
                               f"    def starred(self, a, *args, b, c, d, e, f, g, **kwargs): pass\n",
        "samplers/probs.py": f"def sample({nine}): pass\n",
    })
    monkeypatch.setattr(layout, "EXEMPT_PARAMETERS", {"samplers:sample": "mirrors FlashInfer",
                                                      "samplers:gone": "renamed since"})
    wide, stale = layout.wide_functions(root)
    assert wide == [(layout.MAX_PARAMETERS + 1, "spec_decode/step.py:4 C.starred"),
                    (layout.MAX_PARAMETERS + 1, "spec_decode/step.py:1 wide")]
    assert stale == ["samplers:gone"]


def test_unmirrored_test_dir_mutant_is_caught(layout, tmp_path):
    """A test directory with no package directory is reported; a mirrored one and a support directory
    without tests are not."""
    root = _library(tmp_path, layout, {
        "spec_decode/cpu/__init__.py": "",
        "tests/spec_decode/cpu/test_gemm.py": "",
        "tests/spec_decode/gpu/test_kernels.py": "",
        "tests/spec_decode/models/conftest.py": "",
        "tests/spec_decode/sglang_stand_ins/torchvision/__init__.py": "",
        "tests/test_docs.py": "",
    })
    assert layout.unmirrored_test_dirs(root) == ["tests/spec_decode/gpu", "tests/spec_decode/models"]
