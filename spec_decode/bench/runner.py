"""The contract between the bench's harness and each engine's runner: ours, Hugging Face's, llama.cpp's.

A runner serves one method key: ``ModelCache.runner`` (``spec_decode.bench.methods``) builds it with its
models loaded, and the harness only calls what ``Runner`` names, outside the timed region but for
``generate``'s own stopwatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class CallResult:
    """What one runner call produced.

    ``tokens[i]`` are prompt i's new tokens; ``accepted_lengths`` every verify step's emitted count,
    over all prompts (empty for non-speculative methods); ``step_s`` per-step wall seconds (ours) or
    per-token latency of each call of an engine that runs one prompt per call (HF, llama.cpp);
    ``seconds`` wall time of the ``generate`` call(s).
    """

    tokens: list[list[int]] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    seconds: float = 0.0


class Runner(Protocol):
    """One method key's runner. ``spec`` is its ``config.MethodSpec``."""

    def describe(self) -> dict:
        """The method's settings as the runner holds them (``results.json``'s ``config.method_configs``)."""

    def weight_bytes(self) -> int:
        """Bytes of the weights the method reads (part of ``peak_mem_mb``)."""

    def lookup_costs(self) -> dict[str, float] | None:
        """The verify costs a ``lookup_tokens="auto"`` method measured (``results.json``'s
        ``methods[key]["lookup_costs"]``); None for every other method."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> CallResult:
        """Exactly ``max_new_tokens`` new tokens for each of ``prompts`` (EOS ignored), timed."""


def prompt_seed(seed: int, i: int) -> int:
    """The seed of the ``i``-th prompt of a call seeded ``seed``, for engines that run one prompt per call."""
    return seed * 1009 + i
