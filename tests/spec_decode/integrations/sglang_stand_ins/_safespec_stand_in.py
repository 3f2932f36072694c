"""Stand-in packages for the SGLang CPU test venv: ``torchvision`` and ``sgl_kernel``.

Not a real implementation of either. ``make test-sglang`` puts this folder on the
path of every process in ``.venv-sglang`` (a ``.pth`` file), so the scheduler
processes that ``sglang.Engine`` spawns import these stand-ins too:

- ``torchvision``: its PyPI wheel needs SGLang's CUDA torch build; sglang imports it
  at module level for vision preprocessing that the tests never reach.
- ``sgl_kernel``: no CPU build exists on the package index; sglang imports names
  from it at module level, and plain Llama decoding on the CPU engine calls none.

Every attribute is a ``StandInOp``: importing and looking names up works, calling
one raises ``StandInCalled`` and, when ``$SAFESPEC_STAND_IN_CALLS`` names a file,
appends the op's name to it first, so a test in another process can assert that
no op was ever called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

CALLS_ENV = "SAFESPEC_STAND_IN_CALLS"
"""File to which every called stand-in op appends its dotted name (one per line)."""
STAND_IN_VERSION = "0.0.0+safespec-stand-in"


class StandInCalled(RuntimeError):
    """A stand-in op was called: the code under test needs the real package."""


def _record_call(name: str) -> None:
    path = os.environ.get(CALLS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(name + "\n")


class StandInOp:
    """Stands for any attribute of a stand-in package; raises only if called."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "StandInOp":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandInOp(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        _record_call(self._name)
        raise StandInCalled(f"{self._name}: a safespec test stand-in was called; the real package is needed")

    def __mro_entries__(self, bases):  # allows `class X(stand_in.Foo)` at import time
        return (object,)

    def __repr__(self) -> str:
        return f"<safespec stand-in {self._name}>"


class StandInModule(types.ModuleType):
    """A stand-in (sub)package: every missing attribute is a ``StandInOp``."""

    __safespec_stand_in__ = True

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandInOp(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every ``<root>.*`` submodule of the stand-in package ``root``."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return make_module(spec.name)

    def exec_module(self, module):
        pass


def make_module(name: str) -> StandInModule:
    module = StandInModule(name, f"safespec test stand-in for {name}")
    module.__path__ = []  # a package, so submodule imports resolve through the finder
    module.__version__ = STAND_IN_VERSION
    return module


def install(package: types.ModuleType) -> None:
    """Turn the just-imported stand-in ``package`` into a ``StandInModule`` with a submodule finder."""
    name = package.__name__
    package.__class__ = StandInModule
    package.__version__ = STAND_IN_VERSION
    if not any(isinstance(f, _StandInFinder) and f.root == name for f in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder(name))
