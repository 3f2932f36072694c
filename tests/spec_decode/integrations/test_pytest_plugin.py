"""The pytest plugin (``spec_decode.integrations.pytest_plugin``).

Its names: every fixture is ``safespec_``-prefixed, so a user's own fixtures and markers (``nan_policy``,
``spec_dtype``, ...) never collide with ours (issue 10). Its options and fixtures: the verification dtype
(``--spec-dtype``, ``SAFESPEC_TEST_DTYPE``), the NaN policy and its marker, and the shipped fixtures' paths."""

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


# ------------------------------------------------------------------ options, policy and the fixtures' paths


PLUGIN_TEST = '''
import torch

def test_dtype(safespec_spec_dtype, safespec_spec_dtype_name):
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    assert safespec_spec_dtype == names[safespec_spec_dtype_name]
    print("DTYPE=" + safespec_spec_dtype_name)

def test_policy(safespec_nan_policy):
    import os
    assert os.environ["SAFESPEC_NAN_POLICY"] == safespec_nan_policy.value == "raise"

import pytest

@pytest.mark.safespec_nan_policy("abort")
def test_policy_marker(safespec_nan_policy):
    assert safespec_nan_policy.value == "abort"

def test_paths(safespec_tiny_target_path, safespec_tiny_prompts):
    print("TARGET=" + str(safespec_tiny_target_path))
'''


@pytest.fixture
def plugin_run(pytester, monkeypatch):
    pytester.makepyfile(PLUGIN_TEST)

    def run(*args, env=None, fixtures_dir=None):
        monkeypatch.delenv("SAFESPEC_TEST_DTYPE", raising=False)
        monkeypatch.delenv("SAFESPEC_FIXTURES_DIR", raising=False)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        if fixtures_dir is not None:
            monkeypatch.setenv("SAFESPEC_FIXTURES_DIR", str(fixtures_dir))
        return pytester.runpytest_inprocess(*_plugin_args(), "-s", "-p", "no:cacheprovider", *args)

    return run



@pytest.mark.parametrize("args, env, want", [
    ((), {}, "bf16"),
    ((), {"SAFESPEC_TEST_DTYPE": "fp16"}, "fp16"),
    (("--spec-dtype", "fp32"), {"SAFESPEC_TEST_DTYPE": "fp16"}, "fp32"),
])
def test_plugin_dtype_option(plugin_run, fixtures_dir, args, env, want):
    result = plugin_run(*args, "-k", "test_dtype", env=env, fixtures_dir=fixtures_dir)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*DTYPE={want}*"])


def test_plugin_bad_env_dtype_is_a_usage_error(plugin_run, fixtures_dir):
    result = plugin_run(env={"SAFESPEC_TEST_DTYPE": "fp8"}, fixtures_dir=fixtures_dir)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*SAFESPEC_TEST_DTYPE='fp8'*"])


def test_plugin_nan_policy_and_paths(plugin_run, fixtures_dir):
    result = plugin_run(fixtures_dir=fixtures_dir)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([f"*TARGET={fixtures_dir / 'models' / 'tiny-target'}*"])


def test_plugin_missing_fixtures_skip_naming_the_path(plugin_run, tmp_path):
    missing = tmp_path / "nowhere"
    missing.mkdir()
    result = plugin_run("-rs", "-k", "test_paths", fixtures_dir=missing)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*tiny target not found at {missing}*"])
