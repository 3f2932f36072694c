"""EAGLE draft/verify pipeline: models, heads, drafting, the decode loop and the benchmark.

The top layer of safespec; uses ``samplers`` and ``numerics``. Heavy modules load lazily so that
``import spec_decode`` stays cheap (the pytest plugin imports it at collection time).
"""
from spec_decode.faults import FAULT_SITES, NanFault
from spec_decode.pipeline import GenerationResult, NanEvent, SpecDecoder, StepStats

__all__ = ["FAULT_SITES", "GenerationResult", "NanEvent", "NanFault", "SpecDecoder", "StepStats"]
