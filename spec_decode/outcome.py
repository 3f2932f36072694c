"""A step's outcome on the host: the NaN policy applied, tokens appended, finished requests dropped."""

from __future__ import annotations

import logging

import torch

from numerics import NanLogitsError, NanPolicy, raise_if_nan_logits
from spec_decode.results import FINISH_LENGTH, FINISH_NAN_ABORT, FINISH_STOP, GenerationResult
from spec_decode.step import _Batch, _HostRow, _record_events

_log = logging.getLogger("safespec.spec_decode")


def finish_step(batch: _Batch, req, host: list[_HostRow], step: int, policy: NanPolicy) -> _Batch | None:
    """The step's outcome: apply the NaN policy, append tokens, finish requests; return the surviving
    batch or None. ``host``: the step's one host copy (``_HostRow`` per active request)."""
    corrupted, stopped = {}, set()
    for r, h in enumerate(host):
        res = req.results[batch.active[r]]
        _record_events(res, step, h)
        if h.nan:
            corrupted[r] = h.nan
        if (policy is NanPolicy.ABORT and h.nan) or (policy is NanPolicy.GUARD and h.dead):
            stopped.add(r)
    if corrupted and policy is NanPolicy.RAISE:
        _raise_nan(batch, req, corrupted)
    warn_rows = [r for r in corrupted if r not in stopped]
    if warn_rows and policy in (NanPolicy.SANITIZE, NanPolicy.GUARD) and not req.warned:
        req.warned = True   # one warning per call; the counts are already on the host
        _log.warning("NaN in the target logits of request(s) %s at step %d; sanitized and continuing "
                     "(nan_policy=%r); their output may be degraded",
                     [req.results[batch.active[r]].request_id for r in warn_rows], step, policy.value)
    keep, emitted = [], []
    for r, h in enumerate(host):
        i = batch.active[r]
        res = req.results[i]
        if r in stopped:
            res.finish_reason = FINISH_NAN_ABORT
            continue
        emitted.append(h.num)
        if _append(res, h.tokens[:h.num], req, i, record_step=step > 0):
            keep.append(r)
    req.last_emitted = emitted or None
    if stopped:
        bad = torch.zeros(len(batch.active), dtype=torch.bool)
        bad[sorted(stopped)] = True
        bad = bad.to(batch.root.device)
        batch.target_cache.reset_slots(bad)
        if batch.draft_cache is not None:
            batch.draft_cache.reset_slots(bad)
    if not keep:
        return None
    if len(keep) < len(batch.active):
        batch = batch.keep(keep)
    return batch

def _append(res: GenerationResult, tokens: list[int], req, i: int, record_step: bool) -> bool:
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

def _raise_nan(batch: _Batch, req, corrupted: dict[int, int]) -> None:
    """``raise_if_nan_logits`` naming the corrupted requests, with the partial results attached."""
    ids = {req.results[batch.active[r]].request_id: c for r, c in corrupted.items()}
    try:
        raise_if_nan_logits(ids)
    except NanLogitsError as err:
        err.results = req.results
        raise
