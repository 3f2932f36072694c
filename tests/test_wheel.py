"""The wheel works outside the checkout: build it, install it into a fresh virtual environment, and run
``spec-bench`` from another directory.

The build and the install happen once per session (a module-scoped fixture) and fetch nothing: the
wheel is built with ``--no-build-isolation`` from a copy of the package sources, installed with
``--no-deps --no-index``, and the fresh environment borrows this interpreter's site-packages (torch,
safetensors, tqdm, matplotlib...) through a path line in a ``.pth`` file. A path line does not run
the ``.pth`` files of the directory it adds, so the checkout's editable install stays invisible there:
the test asserts that ``spec_decode`` is imported from the installed wheel. These tests are not
``dtype_sensitive``, so CI runs them once (``make test``), not again in ``make test-fp16``.
"""
from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs the wheel

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("numerics", "samplers", "spec_decode")
SOURCES = ("pyproject.toml", "README.md", "LICENSE", *PACKAGES)
TIMEOUT_S = 300


def _run(cmd, cwd, env=None, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-3000:]}")
    return proc


def _copy_sources(dst: Path) -> None:
    """The files a wheel is built from, without the checkout's caches, build leftovers or fixtures."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            shutil.copy2(src, dst / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The built wheel (pip wheel --no-deps --no-build-isolation, nothing downloaded)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    src.mkdir()
    _copy_sources(src)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", dist, src], cwd=tmp)
    (built,) = dist.glob("safespec-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """A fresh venv holding the wheel, with this interpreter's packages borrowed for its dependencies.

    Returns ``{"bin": venv bin dir, "cwd": a directory outside the checkout, "env": a clean environment}``.
    """
    tmp = tmp_path_factory.mktemp("venv")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp)
                   .stdout.strip())
    borrowed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_safespec_test_borrowed.pth").write_text("".join(f"{p}\n" for p in sorted(borrowed)))
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAFESPEC_", "PYTHON"))}
    work = tmp / "elsewhere"
    work.mkdir()
    return {"bin": venv / "bin", "py": py, "cwd": work, "env": env, "purelib": purelib}


def test_version_agrees_everywhere():
    """pyproject's version is the ``__version__`` of every package."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for pkg in PACKAGES:
        text = (ROOT / pkg / "__init__.py").read_text()
        assert f'__version__ = "{version}"' in text, f"{pkg}/__init__.py: __version__ is not {version!r}"


def test_wheel_contents_and_metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_string(zf.read(meta_name).decode())
    for pkg in PACKAGES:
        assert f"{pkg}/py.typed" in names, f"{pkg}/py.typed missing from the wheel"
    assert "spec_decode/cpu/cpu_gemm.c" in names
    assert "spec_decode/bench/chat_prompts.txt" in names   # the smollm2 suite's chat set
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE missing from the wheel"
    assert not any(n.startswith(("tests/", "fixtures/", "docs/", "examples/")) for n in names)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.10"
    description = meta.get_payload()
    assert "pip install" in description and "SpecDecoder" in description
    assert "UTC" not in description, "the long description holds a dated run log"
    assert len(description.splitlines()) <= 300


def test_installed_wheel_is_the_one_imported(installed):
    out = _run([installed["py"], "-c", "import spec_decode, samplers, numerics; "
                "print(spec_decode.__file__); print(spec_decode.__version__)"],
               cwd=installed["cwd"], env=installed["env"]).stdout.split()
    assert Path(out[0]).is_relative_to(installed["purelib"]), f"spec_decode came from {out[0]}, not the wheel"
    assert out[1] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_spec_bench_help(installed):
    proc = _run([installed["bin"] / "spec-bench", "--help"], cwd=installed["cwd"], env=installed["env"])
    assert "usage: spec-bench" in proc.stdout and "--methods" in proc.stdout


def test_spec_bench_runs_outside_the_checkout(installed):
    env = {**installed["env"], "SAFESPEC_FIXTURES_DIR": str(ROOT / "fixtures")}
    out = installed["cwd"] / "bench_out"
    _run([installed["bin"] / "spec-bench", "--methods", "ar,eagle_chain", "--num-prompts", "1",
          "--max-new-tokens", "4", "--nan-rounds", "0", "--temperatures", "0", "--threads", "1",
          "--no-progress", "--out", out], cwd=installed["cwd"], env=env)
    results = json.loads((out / "results.json").read_text())
    assert results["methods"]["eagle_chain"]["greedy_equals_ar"] is True
    assert results["config"]["num_prompts"] == 1


def test_spec_bench_without_fixtures_says_what_to_set(installed):
    proc = _run([installed["bin"] / "spec-bench", "--methods", "ar", "--num-prompts", "1", "--no-progress"],
                cwd=installed["cwd"], env=installed["env"], check=False)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]   # argparse's usage lines, then the one error line
    assert last.startswith("spec-bench: error: --target") and "SAFESPEC_FIXTURES_DIR" in last, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
