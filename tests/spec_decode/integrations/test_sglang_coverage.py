"""docs/sglang.md's Coverage tables, checked against the installed SGLang.

Needs sglang (``make test-sglang``); skipped with "sglang not installed" otherwise.
Every symbol a table names must exist; a covered worker must reach the hooked
``eagle_sample`` function object (so the hook applies where it is called); an uncovered
one must not; every speculative algorithm SGLang defines needs a row; every module with
a token-sampling call site in the scanned folders needs a row.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

from _sglang_harness import import_sglang

_SKIP_REASON = import_sglang()
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")

DOC = Path(__file__).parents[3] / "docs" / "sglang.md"
SRT = "sglang.srt."
SCANNED = ("speculative", "dllm", "hardware_backend", "sampling", "beam_search", "layers/sampler.py")
"""Folders (and a file) of sglang/srt scanned for token-sampling call sites."""
SAMPLING_CALL = re.compile(r"(argmax|multinomial|\btopk|sampling_from_probs|speculative_sampling_\w+|eagle_sample|run_eagle_verify)\(")
"""A call that can pick tokens: ``topk`` as a name of its own (``torch.topk(``, ``x.topk(``), not ``tree_topk(``."""
VERIFY_NAMES = ("run_eagle_verify", "eagle_sample")
VERIFY_HOMES = {"run_eagle_verify": SRT + "speculative.eagle_worker_common", "eagle_sample": SRT + "speculative.eagle_utils"}
CUDA_ONLY = ("flashinfer",)
"""Packages a scanned module may import at module level that have no CPU build."""
STATES = ("covered", "not covered", "not target", "refused")


def _table(marker: str) -> list[list[str]]:
    """Rows (cells stripped of backticks) of the markdown table between <!-- marker --> and <!-- /marker -->."""
    text = DOC.read_text()
    body = text.split(f"<!-- {marker} -->", 1)[1].split(f"<!-- /{marker} -->", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in body.strip().splitlines()[2:]]
    return [[cell.strip() for cell in row] for row in rows]


def _code(cell: str) -> str:
    """The first `backticked` name of a cell."""
    match = re.search(r"`([^`]+)`", cell)
    assert match, f"no `name` in {cell!r}"
    return match.group(1)


def _srt_root() -> Path:
    import sglang

    return Path(sglang.__file__).parent / "srt"


class _Parsed:
    """A function or class read from source, for a module that cannot import here.

    ``uno_utils`` imports flashinfer (CUDA only) at module level, so UNO is checked
    from its source: which names each function uses, and where the module imports them from.
    """

    def __init__(self, module: str, node, imports: dict):
        self.__name__ = node.name
        self.__module__ = module
        self.node = node
        self.imports = imports  # name -> module it is imported from

    def functions(self) -> list:
        nodes = self.node.body if isinstance(self.node, ast.ClassDef) else [self.node]
        return [_Parsed(self.__module__, n, self.imports) for n in nodes
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def names(self) -> set:
        return {n.id for n in ast.walk(self.node) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(self.node) if isinstance(n, ast.Attribute)}


def _parse(dotted: str) -> _Parsed:
    module, _, attr = (SRT + dotted).rpartition(".")
    path = _srt_root().joinpath(*module.split(".")[2:]).with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = {alias.asname or alias.name: node.module for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) for alias in node.names}
    node = next(n for n in tree.body if getattr(n, "name", None) == attr)
    return _Parsed(module, node, imports)


def _resolve(dotted: str):
    """The named sglang object, or a ``_Parsed`` one when its module needs a CUDA-only package."""
    try:
        return pkgutil.resolve_name(SRT + dotted)
    except (AttributeError, ImportError):
        try:  # surface the real import error
            importlib.import_module((SRT + dotted).rpartition(".")[0])
        except ModuleNotFoundError as exc:
            if exc.name in CUDA_ONLY:
                return _parse(dotted)
        raise


def _functions(cls) -> list:
    """Every function defined on ``cls`` or its sglang base classes."""
    if isinstance(cls, _Parsed):
        return cls.functions()
    found = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("sglang"):
            continue
        for value in vars(klass).values():
            fn = inspect.unwrap(getattr(value, "__func__", value))
            if inspect.isfunction(fn):
                found.append(fn)
    return found


def _calls_hooked_verify(fn) -> bool:
    """``fn`` calls run_eagle_verify or eagle_sample, bound to SGLang's own function objects."""
    from sglang.srt.speculative import eagle_utils, eagle_worker_common

    if isinstance(fn, _Parsed):
        return any(name in fn.names() and fn.imports.get(name) == home for name, home in VERIFY_HOMES.items())
    targets = {"run_eagle_verify": eagle_worker_common.run_eagle_verify, "eagle_sample": eagle_utils.eagle_sample}
    names = set(fn.__code__.co_names)
    return any(name in names and fn.__globals__.get(name) is target for name, target in targets.items())


def _names(fn) -> set:
    return fn.names() if isinstance(fn, _Parsed) else set(fn.__code__.co_names)


ALGORITHMS = _table("coverage:algorithms") if DOC.exists() else []
MODULES = _table("coverage:modules") if DOC.exists() else []


def test_tables_are_well_formed():
    assert ALGORITHMS and MODULES
    for row in ALGORITHMS:
        assert len(row) == 5 and row[3] in STATES[:2], row
    for row in MODULES:
        assert len(row) == 3 and row[1] in STATES, row


def test_run_eagle_verify_calls_the_hooked_eagle_sample():
    from sglang.srt.speculative import eagle_utils, eagle_worker_common

    assert _calls_hooked_verify(eagle_worker_common.run_eagle_verify)
    assert eagle_worker_common.eagle_sample is eagle_utils.eagle_sample


@pytest.mark.parametrize("row", ALGORITHMS, ids=[r[0] for r in ALGORITHMS])
def test_algorithm_row_matches_installed_sglang(row):
    algorithm, worker_cell, site_cell, state, _ = row
    worker = _resolve(_code(worker_cell))
    site = _resolve(_code(site_cell))
    if algorithm.startswith("none"):
        from sglang.srt.layers.sampler import Sampler

        assert site is Sampler.forward and "_preprocess_logits" in Sampler.forward.__code__.co_names
        assert "sampler" in inspect.unwrap(worker.sample).__code__.co_names
        return
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    assert worker.__name__ in inspect.getsource(SpeculativeAlgorithm.create_worker), "create_worker no longer picks it"
    reaching = [fn for fn in _functions(worker) if _calls_hooked_verify(fn)]
    if state == "covered":
        assert reaching, f"{worker.__name__} no longer verifies through eagle_sample"
        assert site.__name__ in VERIFY_NAMES
    elif "chain mode" in algorithm:  # the worker has a covered tree mode; chain mode avoids it
        chain = [fn for fn in _functions(worker) if site.__name__ in _names(fn)]
        assert chain and not any(_calls_hooked_verify(fn) for fn in chain)
    else:
        assert not reaching, f"{worker.__name__} now verifies through eagle_sample: mark it covered"
        assert site.__name__ in inspect.getsource(inspect.getmodule(worker))
    if state == "not covered":
        site_fns = _functions(site) if inspect.isclass(site) or isinstance(site, _Parsed) else [site]
        assert not any(_calls_hooked_verify(fn) for fn in site_fns)


def test_every_speculative_algorithm_has_a_row():
    from sglang.srt.speculative.spec_info import _RESERVED_ALIASES, SpeculativeAlgorithm

    named = {_code(row[0]) for row in ALGORITHMS if "`" in row[0]}
    defined = {a.name for a in SpeculativeAlgorithm if a.name != "NONE"} | set(_RESERVED_ALIASES)
    assert defined <= named, f"no Coverage row for {sorted(defined - named)}"
    assert named <= defined, f"rows for algorithms SGLang no longer has: {sorted(named - defined)}"


def test_startup_warning_names_exactly_the_uncovered_algorithms():
    from spec_decode.integrations.sglang_plugin import UNCOVERED_ALGORITHMS

    uncovered = {_code(row[0]) for row in ALGORITHMS if row[3] == "not covered"}
    assert set(UNCOVERED_ALGORITHMS) == uncovered


def _modules_with_sampling_calls() -> set:
    root = _srt_root()
    found = set()
    for scanned in SCANNED:
        path = root / scanned
        for file in [path] if path.suffix == ".py" else path.rglob("*.py"):
            code = [line for line in file.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
            if any(SAMPLING_CALL.search(line) for line in code):
                found.add(".".join(file.relative_to(root).with_suffix("").parts))
    return found


def test_every_module_with_a_sampling_call_site_has_a_row():
    listed = {_code(row[0]) for row in MODULES}
    root = _srt_root()
    for module in listed:
        assert root.joinpath(*module.split(".")).with_suffix(".py").exists(), module
    found = _modules_with_sampling_calls()
    assert found - listed == set(), f"modules with a sampling call site missing from the table: {sorted(found - listed)}"
    assert listed - found == set(), f"rows for modules without a sampling call site: {sorted(listed - found)}"


DISTRIBUTED_SETTINGS = ("single process", "TP", "DP attention, attention-TP 1", "DP attention, attention-TP > 1", "PP",
                        "multi-node")
TEST_REF = re.compile(r"(test_sglang_\w+\.py)(?:::(\w+))?")


def test_distributed_table_has_every_setting_and_names_tests_that_exist():
    rows = _table("coverage:distributed")
    assert [row[0].split(" (")[0] for row in rows] == list(DISTRIBUTED_SETTINGS)
    here = Path(__file__).parent
    for row in rows:
        assert len(row) == 3, row
        assert TEST_REF.search(row[2]) or "no engine test" in row[2], row
        for file, name in TEST_REF.findall(row[2]):
            source = (here / file).read_text()
            assert not name or f"def {name}(" in source, f"{file}::{name} named in docs/sglang.md does not exist"


@pytest.mark.parametrize("line, picks", [("v, t = torch.topk(x, k, dim=-1)", True), ("idx = scores.reshape(-1).topk(n)", True),
                                         ("n = info.tree_topk()", False), ("if spec.need_topk():", False)])
def test_the_pattern_finds_topk_calls(line, picks):
    assert bool(SAMPLING_CALL.search(line)) is picks


def test_the_scan_catches_a_module_left_out_of_the_table():
    """Mutant: the table without its beam_search rows (which pick tokens by topk only). The scan must name them."""
    listed = {_code(row[0]) for row in MODULES if not _code(row[0]).startswith("beam_search.")}
    assert {"beam_search.coordinator", "beam_search.joint_select"} <= _modules_with_sampling_calls() - listed


def test_refused_modules_are_refused_by_the_plugin():
    """A ``refused`` row is a path the plugin turns away: beam search, through its hook on SGLang's beam check."""
    from spec_decode.integrations.sglang_plugin import BEAM_TARGET

    refused = [_code(row[0]) for row in MODULES if row[1] == "refused"]
    assert refused and all(module.startswith("beam_search.") for module in refused)
    assert BEAM_TARGET.startswith(SRT + "beam_search.")
