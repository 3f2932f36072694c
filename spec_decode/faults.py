"""Fault injection: put NaN or Inf into one request at one step, to rehearse NaN handling.

``NanFault(request, step, site, value)`` targets the request at index ``request`` of the
``generate`` call. Steps count target forward passes: step 0 is the prefill, step s >= 1 is the
s-th decode/verify step. Sites:

``"target_logits"``
    every target logits row of that request at that step (before the numerics pass);
``"draft_logits"``
    the drafter's first prediction for that request at that step (drafting is skipped by
    ``method="none"``, where this site never fires);
``"target_hidden"``
    the target features that the drafter receives after that step (EAGLE methods);
``"kv_cache"``
    the request's newest committed key *and* value rows, in every layer of the target's KV
    cache, just before that step's target forward (a poisoned cache, as a bad kernel leaves it).

Faults are host-side writes into device tensors: they add no host sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FAULT_SITES = ("target_logits", "draft_logits", "target_hidden", "kv_cache")


@dataclass(frozen=True)
class NanFault:
    """Inject ``value`` (NaN by default; +-inf also allowed) at ``site`` for one request at one step."""

    request: int
    step: int
    site: str
    value: float = math.nan

    def __post_init__(self):
        if self.site not in FAULT_SITES:
            raise ValueError(f"NanFault.site must be one of {FAULT_SITES}, got {self.site!r}")
        if not isinstance(self.request, int) or self.request < 0:
            raise ValueError(f"NanFault.request must be a request index >= 0, got {self.request!r}")
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"NanFault.step must be an int >= 0, got {self.step!r}")
        if math.isfinite(self.value):
            raise ValueError(f"NanFault.value must be NaN or +-inf, got {self.value!r}")


class FaultPlan:
    """The faults of one generate call, looked up by (step, site) on the host."""

    def __init__(self, faults, num_requests: int):
        faults = tuple(faults)
        for f in faults:
            if not isinstance(f, NanFault):
                raise ValueError(f"faults must hold NanFault objects, got {type(f).__name__}")
            if f.request >= num_requests:
                raise ValueError(f"NanFault.request={f.request} but only {num_requests} prompts were given")
        self._faults = faults

    def rows(self, step: int, site: str, active: list[int]) -> list[tuple[int, float]]:
        """(batch row, value) pairs to corrupt now; requests that already finished are skipped."""
        out = []
        for f in self._faults:
            if f.step == step and f.site == site and f.request in active:
                out.append((active.index(f.request), f.value))
        return out

    def apply(self, tensor: torch.Tensor, step: int, site: str, active: list[int]) -> None:
        """Fill batch row(s) of ``tensor`` (batch-first) in place."""
        for row, value in self.rows(step, site, active):
            tensor[row] = value
