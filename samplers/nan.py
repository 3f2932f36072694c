"""NaN/Inf handling shared by the samplers: logits under a NanPolicy, and probabilities.

Words as in the glossary of ``numerics.policy``: only NaN triggers a policy (``raise``
raises on NaN, never on Inf: ``-inf`` is a legitimate mask); a non-finite row holds any
NaN/Inf; a dead row holds no finite value. ``guard`` and ``abort`` behave as ``sanitize``
here (a sampler cannot finish a request); the caller acts on the reported rows.

Logits go through ``numerics`` under the active policy. Probabilities handed in directly
(``draft_probs``, ``target_probs``) are cleaned here instead: a probability that is NaN,
Inf or negative becomes 0, rows are renormalised, and the row is reported as bad.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from numerics import NanPolicy, dead_row_mask, nonfinite_row_mask, raise_if_nan_logits, sanitize_nan_logits

# Cap on a single cleaned probability, so that a row sum cannot overflow float32.
_PROB_MAX = 1e30


class Prepared(NamedTuple):
    work: torch.Tensor  # [B, ..., V] sanitized working copy
    nonfinite: torch.Tensor | None  # [B] bool: any NaN/Inf in the batch row (None under off)
    dead: torch.Tensor | None  # [B] bool: a position of the row has no finite value (None under off)


def _per_batch_row(mask: torch.Tensor) -> torch.Tensor:
    """[B, ...] bool -> [B] bool: any position of the batch row."""
    return mask.flatten(1).any(1) if mask.dim() > 1 else mask


def row_masks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nonfinite [B], dead [B]) of ``x`` [B, ..., V], per batch row (any position)."""
    return _per_batch_row(nonfinite_row_mask(x)), _per_batch_row(dead_row_mask(x))


def prepare_logits(
    logits: torch.Tensor, nan_policy: NanPolicy | str | None, *, dtype: torch.dtype | None = torch.float32,
    report: bool = False,
) -> Prepared:
    """A sanitized working copy of ``logits``, with its non-finite and dead row masks.

    Shape:
        logits: [B, ..., V] -> work [B, ..., V] in ``dtype`` (or logits' own dtype if
        None), nonfinite [B] bool (any NaN/Inf in batch row b), dead [B] bool (some
        position of batch row b has no finite value).

    Never mutates ``logits``. Policies: ``off`` -> nothing is sanitized (the caller did it)
    and the copy is skipped when no dtype change is needed; the masks are computed only when
    ``report`` (the caller asked for them: ``return_nonfinite=True``), else both are None; ``sanitize``/``abort``/``guard`` -> sanitize the copy
    (the caller acts on the reported rows); ``raise`` -> raise NanLogitsError naming the
    batch rows that hold NaN (row index as id; Inf does not raise), then sanitize.
    """
    policy = NanPolicy.resolve(nan_policy)
    target = logits.dtype if dtype is None else dtype
    if policy == NanPolicy.OFF:
        masks = row_masks(logits) if report else (None, None)
        return Prepared(logits.to(target), *masks)
    nonfinite, dead = row_masks(logits)
    if policy == NanPolicy.RAISE:
        raise_if_nan_rows(logits)
    work = logits.to(target, copy=True)
    sanitize_nan_logits(work, "samplers")
    return Prepared(work, nonfinite, dead)


def argmax_dtype(logits: torch.Tensor) -> torch.dtype | None:
    """The dtype to take an argmax of ``logits`` in (for ``prepare_logits``): the same ids either way.

    float32 on CPU, where a bfloat16/float16 argmax is not vectorised (the upcast and a float32 argmax
    cost less: ``docs/performance.md``). Elsewhere None (the logits' own dtype, no copy).
    """
    return torch.float32 if logits.device.type == "cpu" else None


def raise_if_nan_rows(*tensors: torch.Tensor | None) -> None:
    """Raise NanLogitsError naming the batch rows whose given tensors hold NaN (Inf is fine).

    Shape: each of tensors [B, ..., V] or None. One host sync (raise mode has to know on
    the host whether to raise).
    """
    given = [x for x in tensors if x is not None]
    if not given or given[0].shape[0] == 0:
        return
    counts = sum(torch.isnan(x).flatten(1).sum(1) for x in given)
    # host sync: raise mode has to know on the host whether to raise.
    per_row = {str(b): int(c) for b, c in enumerate(counts.tolist()) if c}
    raise_if_nan_logits(per_row)


def raise_if_nan_probs(nan_policy: NanPolicy | str | None, *probs: torch.Tensor | None) -> None:
    """Under policy ``raise``, raise NanLogitsError naming batch rows whose given
    probabilities hold NaN. Other policies: nothing (probabilities are cleaned).

    Shape: each of probs [B, ..., V] or None.
    """
    if NanPolicy.resolve(nan_policy) == NanPolicy.RAISE:
        raise_if_nan_rows(*probs)


def clean_probs(probs: torch.Tensor, *, zero_rows: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 copy of ``probs`` with NaN/Inf/negative entries zeroed, rows renormalised.

    Shape:
        probs: [..., V] -> (clean [..., V] float32, bad [...] bool)

    ``bad`` marks rows that held NaN/Inf/negative entries or had no positive mass.
    ``zero_rows`` says what a row without positive mass becomes: ``"uniform"`` (target
    rows: every formula downstream stays defined and every id stays in range) or
    ``"zero"`` (draft rows: nothing was proposed, so every draft token there is rejected).
    Bit for bit :func:`clean_probs_reference`, in arithmetic and reductions only: on CPU,
    torch's elementwise compares are not vectorised and would dominate a step at T > 0.
    """
    if probs.shape[-1] == 0:   # no token: every row is without mass, so bad (and there is no min to take)
        return probs.float().clone(), torch.ones(probs.shape[:-1], dtype=torch.bool, device=probs.device)
    p = probs.float()
    # amin and amax propagate NaN: a NaN row fails ``lo >= 0``
    lo, hi = p.amin(-1), p.amax(-1)
    bad = ~(lo >= 0) | (hi == float("inf"))
    p = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0).clamp_(0.0, _PROB_MAX)
    total = p.sum(-1, keepdim=True)
    empty = total <= 0
    bad = bad | empty.squeeze(-1)
    p = p.div_(torch.where(empty, 1.0, total))
    # adding 0 turns the -0.0 that clamp keeps into +0.0; an empty row gains its uniform mass
    return p.add_(empty * (1.0 / p.shape[-1]) if zero_rows == "uniform" else 0.0), bad


def clean_probs_reference(probs: torch.Tensor, *, zero_rows: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clean_probs` written plainly, with compares and selects: what the tests hold it to."""
    p = probs.float()
    finite = torch.isfinite(p)
    bad = ~finite.all(-1) | (p < 0).any(-1)
    p = torch.where(finite & (p > 0), p, 0.0).clamp(max=_PROB_MAX)
    total = p.sum(-1, keepdim=True)
    empty = total <= 0
    bad = bad | empty.squeeze(-1)
    p = p / torch.where(empty, 1.0, total)
    if zero_rows == "uniform":
        p = torch.where(empty, 1.0 / p.shape[-1], p)
    return p, bad
