"""The pytest plugin's names: every fixture is ``safespec_``-prefixed, so a user's own fixtures and
markers (``nan_policy``, ``spec_dtype``, ...) never collide with ours (issue 10)."""

import re
from importlib.metadata import entry_points

import pytest

pytest_plugins = ["pytester"]

USER_CONFTEST = '''
import pytest

def pytest_configure(config):
    config.addinivalue_line("markers", "nan_policy(x): the user's own marker")

@pytest.fixture
def nan_policy():
    return "user-nan-policy"

@pytest.fixture
def spec_dtype():
    return "user-spec-dtype"

@pytest.fixture
def spec_dtype_name():
    return "user-spec-dtype-name"
'''

USER_TESTS = '''
import os

import pytest
import torch


def test_user_fixtures_win(nan_policy, spec_dtype, spec_dtype_name):
    assert (nan_policy, spec_dtype, spec_dtype_name) == ("user-nan-policy", "user-spec-dtype", "user-spec-dtype-name")


@pytest.mark.safespec_nan_policy("abort")
def test_ours_beside_theirs(nan_policy, spec_dtype, safespec_nan_policy, safespec_spec_dtype,
                            safespec_spec_dtype_name):
    assert nan_policy == "user-nan-policy" and spec_dtype == "user-spec-dtype"
    assert safespec_nan_policy.value == "abort" == os.environ["SAFESPEC_NAN_POLICY"]
    assert safespec_spec_dtype is torch.float32 and safespec_spec_dtype_name == "fp32"


@pytest.mark.nan_policy("the user's meaning")
def test_users_marker_is_not_ours(safespec_nan_policy):
    assert safespec_nan_policy.value == "raise"
'''


def _plugin_args() -> list[str]:
    registered = any(ep.value == "spec_decode.integrations.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if registered else ["-p", "spec_decode.integrations.pytest_plugin"]


def test_users_own_fixtures_win_without_collision(pytester, monkeypatch):
    monkeypatch.delenv("SAFESPEC_TEST_DTYPE", raising=False)
    monkeypatch.delenv("SAFESPEC_NAN_POLICY", raising=False)
    pytester.makeconftest(USER_CONFTEST)
    pytester.makepyfile(USER_TESTS)
    result = pytester.runpytest_inprocess(*_plugin_args(), "-p", "no:cacheprovider", "--spec-dtype", "fp32",
                                          "-W", "error::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=3)


def test_every_plugin_fixture_is_prefixed(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(*_plugin_args(), "-p", "no:cacheprovider", "--fixtures", "-v")
    text = result.stdout.str()
    section = re.search(r"-+ fixtures defined from spec_decode\.integrations\.pytest_plugin -+\n(.*?)(?:\n-{5,}|\Z)", text, re.S)
    assert section, text
    names = re.findall(r"^(\w+)(?: \[\w+ scope\])? -- ", section.group(1), re.M)
    assert "safespec_nan_policy" in names and "safespec_spec_dtype" in names, names
    assert all(n.startswith("safespec_") for n in names), names
