"""EAGLE draft/verify pipeline: models, heads, drafting, the decode loop and the benchmark.

The top layer of safespec; uses ``samplers`` and ``numerics``. Public names load lazily so that
``import spec_decode`` stays cheap: the pytest plugin (``spec_decode.pytest_plugin``) is imported
by every pytest run in an environment where safespec is installed, and must not import torch.
"""

__version__ = "1.0.0"

import importlib

_EXPORTS = {
    "SpecDecoder": "spec_decode.pipeline",
    "GenerationResult": "spec_decode.pipeline",
    "NanEvent": "spec_decode.pipeline",
    "StepStats": "spec_decode.pipeline",
    "NanFault": "spec_decode.faults",
    "FAULT_SITES": "spec_decode.faults",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'spec_decode' has no attribute {name!r}")


def __dir__():
    return __all__
