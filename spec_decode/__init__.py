"""EAGLE draft/verify pipeline: models, heads, drafting, the decode loop and the benchmark.

Layout: ``models/`` (the target and draft models, EAGLE heads, KV cache, checkpoints), ``cpu/`` (the
CPU backend of their linear layers), the decoder in this package itself, ``integrations/`` (SGLang and
pytest plugins), ``testing/`` (the fp16 overflow), ``bench/`` (``spec-bench``).

The top layer of safespec; uses ``samplers`` and ``numerics``. Public names load lazily so that
``import spec_decode`` stays cheap: the pytest plugin (``spec_decode.integrations.pytest_plugin``) is imported
by every pytest run in an environment where safespec is installed, and must not import torch.
"""

__version__ = "1.0.0"

import importlib

_EXPORTS = {
    "SpecDecoder": "spec_decode.pipeline",
    "GenerationResult": "spec_decode.results",
    "NanEvent": "spec_decode.results",
    "StepStats": "spec_decode.results",
    "NanFault": "spec_decode.faults",
    "Transformer": "spec_decode.models.transformer",
    "ModelConfig": "spec_decode.models.config",
    "KVCache": "spec_decode.models.kv_cache",
    "EagleHead": "spec_decode.models.eagle",
    "Eagle3Head": "spec_decode.models.eagle",
    "load_drafter": "spec_decode.models.eagle",
    "FAULT_SITES": "spec_decode.faults",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'spec_decode' has no attribute {name!r}")


def __dir__():
    return __all__
