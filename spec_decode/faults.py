"""Fault injection: put NaN or Inf into one request at one step, to rehearse NaN handling.

``NanFault(request, step, site, value, columns=None)`` targets the request at index ``request``
of the ``generate`` call. Steps count target forward passes: step 0 is the prefill, step s >= 1 is
the s-th decode/verify step. By default a fault fills whole rows (at a logits site: *dead rows*,
no finite value left, which ``guard`` answers by finishing the request); ``columns`` limits it to
some vocabulary ids (logits sites) or feature indices (``target_hidden``), a *partial* fault
that leaves the rows alive (``guard`` sanitizes them and the request continues). Sites:

``"target_logits"``
    every target logits row of that request at that step (before the numerics pass);
``"draft_logits"``
    the drafter's first prediction for that request at that step (drafting is skipped by
    ``method="none"`` and by a step that verifies lookup drafts, where this site never fires);
``"target_hidden"``
    the target features that the drafter receives after that step (EAGLE methods);
``"kv_cache"``
    the request's newest committed key *and* value rows, in every layer of the target's KV
    cache, just before that step's target forward (a poisoned cache, as a bad kernel leaves it).

Faults are host-side writes into device tensors: they add no host sync. Whole rows are one fill;
``columns`` are written as one slice fill per contiguous run of ids (no index tensor is built,
since copying one to the device would synchronize), so prefer a few ids or ranges.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch

FAULT_SITES = ("target_logits", "draft_logits", "target_hidden", "kv_cache")
COLUMN_SITES = ("target_logits", "draft_logits", "target_hidden")
"""Sites where ``NanFault.columns`` may select part of a row (the last dimension)."""


@dataclass(frozen=True)
class NanFault:
    """Inject ``value`` (NaN by default; +-inf also allowed) at ``site`` for one request at one step.

    ``columns``: None (default) fills the request's whole rows. Otherwise a non-empty list of
    indices into the last dimension, vocabulary ids at ``target_logits``/``draft_logits`` and
    feature indices at ``target_hidden`` (not allowed at ``kv_cache``); only those entries of
    each of the request's rows are filled. Stored sorted and deduplicated, as a tuple. An id
    beyond the site's width raises ``ValueError`` naming ``columns`` when the fault fires.
    """

    request: int
    step: int
    site: str
    value: float = math.nan
    columns: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.site, str) or self.site not in FAULT_SITES:
            raise ValueError(f"NanFault.site must be one of {FAULT_SITES}, got {self.site!r}")
        if not _is_int(self.request) or self.request < 0:
            raise ValueError(f"NanFault.request must be a request index (an int >= 0), got {self.request!r}")
        if not _is_int(self.step) or self.step < 0:
            raise ValueError(f"NanFault.step must be an int >= 0, got {self.step!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, Real) or math.isfinite(self.value):
            raise ValueError(f"NanFault.value must be NaN or +-inf (a float), got {self.value!r}")
        object.__setattr__(self, "value", float(self.value))
        if self.columns is not None:
            object.__setattr__(self, "columns", _check_columns(self.columns, self.site))


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _check_columns(columns, site: str) -> tuple[int, ...]:
    if site not in COLUMN_SITES:
        raise ValueError(f"NanFault.columns is for the sites {COLUMN_SITES}; site {site!r} takes whole rows "
                         "(columns=None)")
    if isinstance(columns, (str, bytes)) or not hasattr(columns, "__iter__"):
        raise ValueError(f"NanFault.columns must be None or a list of int indices, got {columns!r}")
    cols = list(columns)
    if not cols:
        raise ValueError("NanFault.columns must not be empty (None means the whole row)")
    for c in cols:
        if not _is_int(c) or c < 0:
            raise ValueError(f"NanFault.columns must hold int indices >= 0, got {c!r} in {columns!r}")
    return tuple(sorted(set(cols)))


def _runs(columns: tuple[int, ...]) -> list[tuple[int, int]]:
    """Sorted unique ids -> maximal [start, stop) runs of consecutive ids."""
    runs = []
    for c in columns:
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    return [(a, b) for a, b in runs]


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

    def _due(self, step: int, site: str, active: list[int]) -> list[tuple[int, NanFault]]:
        return [(active.index(f.request), f) for f in self._faults
                if f.step == step and f.site == site and f.request in active]


    def apply(self, target, step: int, site: str, active: list[int], lengths_host: list[int] | None = None) -> None:
        """Apply the faults due at (``step``, ``site``) to the batch rows of ``target`` in place.

        Shape:
            at a tensor site, target: [B, ..., W] (e.g. logits [B, V] or [B, N, V], features [B, T, H]),
            filled whole per due row or in ``columns`` of its last dimension W; at ``"kv_cache"``,
            target: the target's ``KVCache`` (k, v [num_layers, B, n_kv, max_len, head_dim]), whose
            newest committed key and value rows of each due request are filled in every layer, and
            lengths_host [B]: the committed rows per slot (``cache.lengths`` on the host).
        Row r is request ``active[r]``. No host sync: only basic-slice fills.
        """
        if site == "kv_cache":
            for row, f in self._due(step, site, active):
                pos = lengths_host[row] - 1
                target.k[:, row, :, pos] = f.value
                target.v[:, row, :, pos] = f.value
            return
        for row, f in self._due(step, site, active):
            if f.columns is None:
                target[row].fill_(f.value)
                continue
            width = target.shape[-1]
            if f.columns[-1] >= width:
                raise ValueError(f"NanFault.columns: index {f.columns[-1]} is out of range for {site} of "
                                 f"width {width} (the last dimension)")
            for start, stop in _runs(f.columns):
                target[row, ..., start:stop].fill_(f.value)


NO_FAULTS = FaultPlan((), 0)
"""A plan with no faults: a step's hooks outside ``generate`` (``step.StepHooks``)."""
