"""The docs run as written: every ```python block of README.md and docs/*.md, the examples/ scripts,
and the doctests in the public docstrings of numerics, samplers and spec_decode.

Each block runs alone (fresh globals, no state from the block before it), in this process, from the
checkout root, as a reader would paste it. A snippet that is not meant to run takes another fence
language (```text, ```bash). Blocks that load the shipped models run on CPU, so the suite needs no GPU.
"""
from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PACKAGES = ("numerics", "samplers", "spec_decode")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, source) of every ```python block in ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = [(path, line, src) for path in DOC_FILES for line, src in python_blocks(path)]


@pytest.fixture
def clean_process(monkeypatch):
    """The checkout root as the working directory, no NaN policy from the environment, and the
    process-wide NaN warner re-armed afterwards (a block may spend its one warning)."""
    from numerics import NAN_POLICY_ENV, reset_nan_warner

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv(NAN_POLICY_ENV, raising=False)
    yield
    reset_nan_warner()


@pytest.mark.parametrize(("path", "line", "src"), BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}:{line}" for p, line, _ in BLOCKS])
def test_python_block_runs(path, line, src, clean_process):
    # Padding with newlines makes a traceback's line number the line in the markdown file.
    code = compile("\n" * (line - 1) + src, str(path), "exec")
    exec(code, {"__name__": "__docs__"})


def test_every_doc_page_is_scanned():
    """The README and the reference pages hold the blocks this module runs (a renamed fence or an
    emptied README would otherwise pass silently)."""
    assert (ROOT / "README.md") in DOC_FILES and len(DOC_FILES) >= 8
    in_readme = [b for b in BLOCKS if b[0].name == "README.md"]
    assert len(in_readme) >= 2, "the README's quickstart must be a ```python block"


def test_fence_extraction(tmp_path):
    """A block's line number is its first source line; other fence languages are not collected."""
    path = tmp_path / "sample.md"
    path.write_text("text\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = 2\nc = 3\n```\n")
    assert python_blocks(path) == [(3, "a = 1\n"), (9, "b = 2\nc = 3\n")]


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script, clean_process, capsys):
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip(), f"{script.name} printed nothing"


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"quickstart.py", "nan_policy_rehearsal.py"}


def _public_modules() -> list[str]:
    """Every importable module of the three packages (``__main__`` entry points excluded: importing one runs it)."""
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        mod = importlib.import_module(pkg)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, prefix=pkg + ".")
                  if not m.name.endswith(".__main__")]
    return sorted(names)


def _collect_doctests() -> tuple[list[doctest.DocTest], list[str]]:
    """The docstrings with examples, and the modules skipped because an optional dependency is missing."""
    found, missing = [], []
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in _public_modules():
        try:
            module = importlib.import_module(name)
        except ImportError as e:   # triton, sglang, ...: optional extras
            missing.append(f"{name}: {e}")
            continue
        found += [t for t in finder.find(module, name) if t.examples and t.name.startswith(name)]
    return sorted(found, key=lambda t: t.name), missing


DOCTESTS, DOCTEST_SKIPPED = _collect_doctests()


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_doctest(test, clean_process):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {test.name} (output above)"


def test_doctests_found():
    """The public docstrings that carry examples (numerics, samplers) are all collected."""
    modules = {t.name.split(".")[0] for t in DOCTESTS}
    assert {"numerics", "samplers"} <= modules, (modules, DOCTEST_SKIPPED)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCED.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)}


FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINKED_PAGES = [*DOC_FILES, ROOT / "CHANGELOG.md", ROOT / "docs" / "results" / "README.md"]


@pytest.mark.parametrize("path", LINKED_PAGES, ids=[str(p.relative_to(ROOT)) for p in LINKED_PAGES])
def test_relative_links_resolve(path):
    """Every relative link of the README and the reference pages names a file that exists, and a
    heading that exists when it carries an anchor."""
    broken = []
    for target in LINK.findall(FENCED.sub("", path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue   # an absolute URL
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: broken links {broken}"


def test_reference_pages_hold_no_run_logs():
    """The README and the reference pages state the current truth: no dated run (``UTC`` time stamps
    belong in docs/results/ and CHANGELOG.md), and the README stays a front door."""
    stamped = [str(p.relative_to(ROOT)) for p in DOC_FILES if "UTC" in p.read_text(encoding="utf-8")]
    assert not stamped, f"time stamps in {stamped}: move the run to docs/results/"
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 300, f"README.md has {lines} lines (at most 300): move detail to a reference page"


# ---------------------------------------------------------------- issue 51: the docs say what the code does
def test_bench_page_lists_the_coupled_methods():
    """``docs/bench.md`` left out the ``*_coupled`` methods that ``--methods`` accepts."""
    from spec_decode.bench.config import COUPLED_TWINS

    text = (ROOT / "docs" / "bench.md").read_text(encoding="utf-8")
    missing = [k for twin in COUPLED_TWINS for k in (twin, f"{twin}_coupled") if f"`{k}`" not in text]
    assert not missing, f"docs/bench.md does not name {missing}"


def test_nan_event_sentence_excepts_off():
    """``docs/spec_decode.md`` said every policy records ``NanEvent``; ``off`` counts nothing and records none
    (``tests/spec_decode/test_pipeline_policies.py`` checks the code)."""
    text = " ".join((ROOT / "docs" / "spec_decode.md").read_text(encoding="utf-8").split())
    assert "Every policy records" not in text
    assert "Every policy but `off` records `NanEvent" in text and "`off` counts nothing, so it records none" in text
