"""The Examples sections of the five documented entry points run as doctests (issue 53).

``sample``, ``chain_speculative_sampling``, ``tree_verify``, ``coupled_sample`` and
``SpecDecoder.generate`` each carry numpydoc Parameters, Returns and Examples. The examples are found
on the objects themselves (``doctest.DocTestFinder``), so an object that loses its Examples fails
here, and a wrong printed output fails too (the mutant below proves the runner compares them).
``tests/test_docs.py`` also runs every doctest of the packages; this module pins these five.
"""
from __future__ import annotations

import doctest
import re

import pytest

import samplers
from spec_decode import SpecDecoder

DOCUMENTED = {
    "samplers.sample": samplers.sample,
    "samplers.chain_speculative_sampling": samplers.chain_speculative_sampling,
    "samplers.tree_verify": samplers.tree_verify,
    "samplers.coupled_sample": samplers.coupled_sample,
    "spec_decode.SpecDecoder.generate": SpecDecoder.generate,
}
SECTIONS = ("Parameters", "Returns", "Examples")
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def examples_of(name: str) -> doctest.DocTest:
    """The one doctest in ``name``'s own docstring (not its module's), found by ``DocTestFinder``."""
    obj = DOCUMENTED[name]
    tests = doctest.DocTestFinder(recurse=False, exclude_empty=True).find(obj, name, globs={})
    assert len(tests) == 1 and tests[0].examples, f"{name} has no Examples in its docstring"
    return tests[0]


def run(test: doctest.DocTest) -> doctest.TestResults:
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test, out=lambda text: None)
    return runner.summarize(verbose=False)


@pytest.fixture
def clean_process(monkeypatch):
    """No NaN policy from the environment, and the process-wide NaN warner re-armed afterwards."""
    from numerics import NAN_POLICY_ENV, reset_nan_warner

    monkeypatch.delenv(NAN_POLICY_ENV, raising=False)
    yield
    reset_nan_warner()


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_docstring_has_the_numpydoc_sections(name):
    doc = DOCUMENTED[name].__doc__ or ""
    for section in SECTIONS:
        assert re.search(rf"^\s*{section}\n\s*-{{{len(section)}}}$", doc, re.MULTILINE), \
            f"{name}'s docstring has no numpydoc {section} section"
    assert re.search(r"^\s*Shape:$", doc, re.MULTILINE), f"{name}'s docstring lost its Shape: lines"
    assert "NaN" in doc, f"{name}'s docstring says nothing about NaN"


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_examples_run_as_written(name, clean_process):
    test = examples_of(name)
    result = run(test)
    assert result.attempted == len(test.examples) and result.failed == 0, \
        f"{result.failed} of {result.attempted} examples of {name} printed something else " \
        f"(rerun: python -m doctest -v on it)"


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_examples_show_outputs(name):
    """Every Examples section checks at least one printed output (a silent example proves nothing)."""
    assert any(e.want.strip() for e in examples_of(name).examples), f"{name}'s examples print nothing"


def test_a_wrong_printed_output_fails(clean_process):
    """Mutant: the same example with one expected output changed must fail."""
    test = examples_of("samplers.tree_verify")
    shown = [i for i, e in enumerate(test.examples) if e.want.strip()]
    assert shown
    i = shown[0]
    mutant = doctest.DocTest([*test.examples[:i], doctest.Example(test.examples[i].source, "[[999]]\n"),
                              *test.examples[i + 1:]], test.globs, test.name + "<mutant>", test.filename,
                             test.lineno, test.docstring)
    assert run(mutant).failed == 1


def test_a_missing_example_fails():
    """Mutant: an object without Examples is reported, not skipped."""
    def undocumented(x):
        """Does something; no examples here."""
        return x

    DOCUMENTED["mutant.undocumented"] = undocumented
    try:
        with pytest.raises(AssertionError, match="has no Examples"):
            examples_of("mutant.undocumented")
    finally:
        del DOCUMENTED["mutant.undocumented"]
