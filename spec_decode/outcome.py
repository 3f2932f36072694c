"""A step's outcome on the host: the NaN policy applied, tokens appended, finished requests dropped.

``HostRow`` is one request's share of the step's one host copy (``step.copy_to_host``);
``finish_step`` turns the rows into tokens and finished requests and returns a ``StepOutcome``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from numerics import NanLogitsError, NanPolicy, raise_if_nan_logits
from spec_decode.requests import Requests
from spec_decode.results import FINISH_LENGTH, FINISH_NAN_ABORT, FINISH_STOP, GenerationResult, NanEvent
from spec_decode.state import DecodeState

_log = logging.getLogger("safespec.spec_decode")

HOST_COUNTS = ("num", "nan", "inf", "dead", "draft_nan", "draft_inf", "draft_dead")
"""The columns after the tokens in a row of the step's host copy, in order (``HostRow``'s fields)."""


@dataclass
class HostRow:
    """One request's share of the step's host copy: its tokens (``num`` of them are emitted), the
    target logits' NaN/Inf/dead-row counts of this step and the drafter's (0 when not drafted)."""

    tokens: list[int]
    num: int
    nan: int
    inf: int
    dead: int
    draft_nan: int
    draft_inf: int
    draft_dead: int


@dataclass(frozen=True)
class StepOutcome:
    """What a step leaves: the state of the requests still running (None: every request finished) and
    how many tokens each request that was not stopped by the NaN policy emitted (None: none)."""

    state: DecodeState | None
    emitted: list[int] | None


def finish_step(state: DecodeState, host: list[HostRow], step: int, policy: NanPolicy) -> StepOutcome:
    """The step's outcome: apply the NaN policy, append tokens, finish requests.
    ``host``: the step's one host copy (``HostRow`` per active request)."""
    req = state.requests
    corrupted, stopped = {}, set()
    for r, h in enumerate(host):
        res = req.results[state.active[r]]
        record_events(res, step, h)
        if h.nan:
            corrupted[r] = h.nan
        if (policy is NanPolicy.ABORT and h.nan) or (policy is NanPolicy.GUARD and h.dead):
            stopped.add(r)
    if corrupted and policy is NanPolicy.RAISE:
        _raise_nan(state, corrupted)
    warn_rows = [r for r in corrupted if r not in stopped]
    if warn_rows and policy in (NanPolicy.SANITIZE, NanPolicy.GUARD) and not req.warned:
        req.warned = True   # one warning per call; the counts are already on the host
        _log.warning("NaN in the target logits of request(s) %s at step %d; sanitized and continuing "
                     "(nan_policy=%r); their output may be degraded",
                     [req.results[state.active[r]].request_id for r in warn_rows], step, policy.value)
    keep, emitted = [], []
    for r, h in enumerate(host):
        i = state.active[r]
        res = req.results[i]
        if r in stopped:
            res.finish_reason = FINISH_NAN_ABORT
            continue
        emitted.append(h.num)
        if _append(res, h.tokens[:h.num], req, i, record_step=step > 0):
            keep.append(r)
    if stopped:
        bad = torch.zeros(len(state.active), dtype=torch.bool)
        bad[sorted(stopped)] = True
        bad = bad.to(state.root.device)
        state.target_cache.reset_slots(bad)
        if state.draft_cache is not None:
            state.draft_cache.reset_slots(bad)
    if not keep:
        return StepOutcome(None, emitted or None)
    if len(keep) < len(state.active):
        state = state.keep(keep)
    return StepOutcome(state, emitted or None)


def record_events(res: GenerationResult, step: int, h: HostRow) -> None:
    """The step's NaN and Inf counts of one request as ``NanEvent``s, the drafter's first."""
    for site, nan, inf, dead in (("draft_logits", h.draft_nan, h.draft_inf, h.draft_dead),
                                 ("target_logits", h.nan, h.inf, h.dead)):
        if nan:
            res.nan_events.append(NanEvent(step, site, nan, "nan", dead))
        if inf:
            res.nan_events.append(NanEvent(step, site, inf, "inf", dead))


def _append(res: GenerationResult, tokens: list[int], req: Requests, i: int, record_step: bool) -> bool:
    """Append emitted tokens, honouring stop ids and max_new_tokens. Returns True if still running.

    The prefill's token is not a verify step, so it adds no accepted length.
    """
    if record_step:
        res.accepted_lengths.append(len(tokens))
    stops = req.stop_ids[i]
    for t in tokens:
        res.token_ids.append(t)
        if t in stops:
            res.finish_reason = FINISH_STOP
            return False
        if len(res.token_ids) >= req.max_new[i]:
            res.finish_reason = FINISH_LENGTH
            return False
    return True


def _raise_nan(state: DecodeState, corrupted: dict[int, int]) -> None:
    """``raise_if_nan_logits`` naming the corrupted requests, with the partial results attached."""
    req = state.requests
    ids = {req.results[state.active[r]].request_id: c for r, c in corrupted.items()}
    try:
        raise_if_nan_logits(ids)
    except NanLogitsError as err:
        err.results = req.results
        raise
