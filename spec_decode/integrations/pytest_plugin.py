"""pytest plugin ``safespec``: the verification dtype switch and the trained tiny fixtures.

Registered through the ``pytest11`` entry point ``safespec = "spec_decode.integrations.pytest_plugin"``, so every
pytest run in an environment with safespec installed loads it (or use ``-p spec_decode.integrations.pytest_plugin``).
It imports nothing heavy at import time: torch and the pipeline load inside the fixtures that need them.

Options
    ``--spec-dtype {bf16,fp16,fp32}``: the dtype that ``safespec_spec_dtype`` and ``safespec_spec_decoder``
    verify in. The env var ``SAFESPEC_TEST_DTYPE`` sets it too; the command line wins; the default is bf16.

Fixtures (every name starts with ``safespec_``: the plugin is loaded into every pytest run of an
environment where safespec is installed, so a user's own ``nan_policy`` or ``spec_dtype`` fixture must
never collide with ours; the user's fixture of the same name wins anyway, as pytest's conftest and
module fixtures override plugin fixtures)
    ``safespec_spec_dtype`` (torch.dtype), ``safespec_spec_dtype_name`` ("bf16" / "fp16" / "fp32");
    ``safespec_tiny_target_path``, ``safespec_tiny_eagle_path``, ``safespec_tiny_eagle3_path``,
    ``safespec_tiny_draft_path`` (pathlib.Path); ``safespec_fixtures_dir`` (pathlib.Path);
    ``safespec_tiny_prompts`` (list of dicts from ``prompts.jsonl``: id, source_file, text, token_ids);
    ``safespec_spec_decoder``: a ``SpecDecoder`` on the tiny target + EAGLE head in ``safespec_spec_dtype``,
    built once per session, with NaN policy ``raise`` (set ``.nan_policy`` on it, or build your own, for
    other policies);
    ``safespec_nan_policy``: sets ``SAFESPEC_NAN_POLICY`` for one test (``raise`` unless the test carries
    ``@pytest.mark.safespec_nan_policy("abort")`` etc.) and returns the ``NanPolicy``.

The fixtures directory is ``$SAFESPEC_FIXTURES_DIR`` when set, else the first ``fixtures/`` holding
``models/`` found walking up from pytest's rootdir. Path fixtures skip, naming the path they looked
for, when the files are absent (e.g. an installed wheel without the repository's fixtures).

Marker
    ``dtype_sensitive``: the test's expectation depends on ``safespec_spec_dtype``; CI reruns these with
    ``--spec-dtype fp16`` (``pytest -m dtype_sensitive --spec-dtype fp16``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spec_decode.dtype_names import DTYPE_NAMES
from spec_decode.fixtures import (DRAFT_SUBDIR, EAGLE3_SUBDIR, EAGLE_SUBDIR, FIXTURES_ENV, PROMPTS_FILE, TARGET_SUBDIR,
                                  find_fixtures_dir)

DTYPE_ENV = "SAFESPEC_TEST_DTYPE"
NAN_POLICY_ENV = "SAFESPEC_NAN_POLICY"
DEFAULT_DTYPE = "bf16"
DEFAULT_TEST_NAN_POLICY = "raise"  # inside tests no NaN may hide
NAN_POLICY_MARKER = "safespec_nan_policy"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("safespec")
    group.addoption("--spec-dtype", action="store", choices=DTYPE_NAMES, default=None,
                    help=f"verification dtype for safespec fixtures (default: ${DTYPE_ENV} or {DEFAULT_DTYPE})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "dtype_sensitive: expectation depends on --spec-dtype; CI reruns "
                                       "these tests with --spec-dtype fp16")
    config.addinivalue_line("markers", f"{NAN_POLICY_MARKER}(policy): NaN policy the safespec_nan_policy "
                                       f"fixture sets (default {DEFAULT_TEST_NAN_POLICY})")
    resolve_dtype_name(config)  # a bad env value fails at startup, not inside the first fixture


def resolve_dtype_name(config: pytest.Config) -> str:
    """The dtype name: ``--spec-dtype``, else ``$SAFESPEC_TEST_DTYPE``, else bf16.

    Raises pytest.UsageError naming the env var when its value is not one of bf16/fp16/fp32.
    """
    cli = config.getoption("--spec-dtype", default=None)
    if cli:
        return cli
    env = os.environ.get(DTYPE_ENV, "").strip().lower()
    if not env:
        return DEFAULT_DTYPE
    if env not in DTYPE_NAMES:
        raise pytest.UsageError(f"{DTYPE_ENV}={os.environ[DTYPE_ENV]!r} is not one of {', '.join(DTYPE_NAMES)}")
    return env


def pytest_report_header(config: pytest.Config) -> str:
    source = "--spec-dtype" if config.getoption("--spec-dtype", default=None) else (
        DTYPE_ENV if os.environ.get(DTYPE_ENV) else "default")
    return f"safespec: spec dtype {resolve_dtype_name(config)} ({source})"


def _torch_dtype(name: str):
    from spec_decode.dtypes import torch_dtype  # imports torch: on use, the plugin loads in every pytest run

    return torch_dtype(name)


@pytest.fixture(scope="session")
def safespec_spec_dtype_name(pytestconfig: pytest.Config) -> str:
    """"bf16", "fp16" or "fp32" (``--spec-dtype`` > ``$SAFESPEC_TEST_DTYPE`` > bf16)."""
    return resolve_dtype_name(pytestconfig)


@pytest.fixture(scope="session")
def safespec_spec_dtype(safespec_spec_dtype_name: str):
    """The verification dtype as a torch.dtype."""
    return _torch_dtype(safespec_spec_dtype_name)


@pytest.fixture(scope="session")
def safespec_fixtures_dir(pytestconfig: pytest.Config) -> Path:
    """The fixtures directory; skips when none is found."""
    found = find_fixtures_dir(pytestconfig.rootpath)
    if found is None:
        pytest.skip(f"safespec fixtures not found: set {FIXTURES_ENV} or run inside a safespec checkout "
                    f"(no fixtures/models at or above {pytestconfig.rootpath})")
    if not found.is_dir():
        pytest.skip(f"safespec fixtures directory {found} (from {FIXTURES_ENV}) does not exist")
    return found


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        pytest.skip(f"{what} not found at {path} (build it with `python fixtures/make_fixtures.py`)")
    return path


@pytest.fixture(scope="session")
def safespec_tiny_target_path(safespec_fixtures_dir: Path) -> Path:
    """The trained tiny target (HF layout, bf16 weights, tokenizer included)."""
    return _require(safespec_fixtures_dir / TARGET_SUBDIR / "config.json", "tiny target").parent


@pytest.fixture(scope="session")
def safespec_tiny_eagle_path(safespec_fixtures_dir: Path) -> Path:
    """The trained EAGLE-1/2 head for the tiny target."""
    return _require(safespec_fixtures_dir / EAGLE_SUBDIR / "config.json", "tiny EAGLE head").parent


@pytest.fixture(scope="session")
def safespec_tiny_eagle3_path(safespec_fixtures_dir: Path) -> Path:
    """The trained EAGLE-3 head for the tiny target."""
    return _require(safespec_fixtures_dir / EAGLE3_SUBDIR / "config.json", "tiny EAGLE-3 head").parent


@pytest.fixture(scope="session")
def safespec_tiny_draft_path(safespec_fixtures_dir: Path) -> Path:
    """The trained 2-layer draft LM (same tokenizer as the target)."""
    return _require(safespec_fixtures_dir / DRAFT_SUBDIR / "config.json", "tiny draft LM").parent


@pytest.fixture(scope="session")
def safespec_tiny_prompts(safespec_fixtures_dir: Path) -> list[dict]:
    """Held-out prompts: dicts with id, source_file, start_line, text, token_ids."""
    path = _require(safespec_fixtures_dir / PROMPTS_FILE, "held-out prompts")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def safespec_spec_decoder(safespec_tiny_target_path: Path, safespec_tiny_eagle_path: Path, safespec_spec_dtype):
    """SpecDecoder(tiny target + EAGLE head) in ``safespec_spec_dtype``, NaN policy raise; one per session.

    Shared: tests must not leave attributes changed (restore ``.nan_policy`` if they set it).
    """
    from spec_decode import SpecDecoder  # imported on use (heavy)

    return SpecDecoder.from_pretrained(safespec_tiny_target_path, safespec_tiny_eagle_path, method="eagle",
                                       dtype=safespec_spec_dtype, nan_policy=DEFAULT_TEST_NAN_POLICY)


@pytest.fixture
def safespec_nan_policy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Set ``SAFESPEC_NAN_POLICY`` for this test and return the resolved ``NanPolicy``.

    ``raise`` by default; ``@pytest.mark.safespec_nan_policy("abort")`` (or guard/sanitize/off) chooses
    another.
    """
    from numerics import NanPolicy  # imported on use

    marker = request.node.get_closest_marker(NAN_POLICY_MARKER)
    value = marker.args[0] if marker is not None and marker.args else DEFAULT_TEST_NAN_POLICY
    policy = NanPolicy.resolve(value)  # ValueError naming a bad marker value
    monkeypatch.setenv(NAN_POLICY_ENV, policy.value)
    return policy
