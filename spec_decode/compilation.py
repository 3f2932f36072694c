"""``SpecDecoder(compile=True)``: the target's and the drafter's forwards compiled in place."""

from __future__ import annotations

import torch

COMPILE_RECOMPILE_LIMIT = 64
"""Graphs torch.compile may keep per code object under ``compile=True`` (torch's default is 8). Every
``Transformer`` shares one ``forward`` code object, and each call pattern (prefill, tree verify,
plain step, drafter rows, EAGLE-3 aux layers) is a graph per model; past the limit dynamo falls
back to eager and still checks every cached guard on each call."""


def compile_in_place(module) -> None:
    """``module.compile(dynamic=True)`` once (a module shared by several decoders is compiled once)."""
    if isinstance(module, torch.nn.Module) and getattr(module, "_compiled_call_impl", None) is None:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
        module.compile(dynamic=True)
