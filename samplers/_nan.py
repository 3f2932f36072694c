"""NaN/Inf handling shared by the samplers: logits under a NanPolicy, and probabilities.

Logits go through ``numerics`` under the active policy. Probabilities handed in directly
(``draft_probs``, ``target_probs``) are cleaned here instead: a probability that is NaN,
Inf or negative becomes 0, rows are renormalised, and the row is reported as bad.
"""

from __future__ import annotations

import torch

from numerics import NanPolicy, nonfinite_row_mask, raise_if_nan_logits, sanitize_nan_logits

# Cap on a single cleaned probability, so that a row sum cannot overflow float32.
_PROB_MAX = 1e30


def prepare_logits(
    logits: torch.Tensor, nan_policy: NanPolicy | str | None, *, dtype: torch.dtype | None = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return a sanitized working copy of ``logits`` and its non-finite row mask.

    Shape:
        logits: [B, ..., V] -> (work [B, ..., V] in ``dtype`` (or logits' own dtype if None),
        nonfinite [B] bool: True where any position of row b held NaN/Inf).

    Never mutates ``logits``. Policies: ``off`` -> no sanitize (the caller did it; the copy
    is skipped when no dtype change is needed); ``sanitize``/``abort`` -> sanitize the copy
    (the caller aborts the reported rows under ``abort``); ``raise`` -> raise NanLogitsError
    naming the non-finite batch rows (row index as id).
    """
    policy = NanPolicy.resolve(nan_policy)
    rows = nonfinite_row_mask(logits)  # [B, ...]
    if rows.dim() > 1:
        rows = rows.flatten(1).any(1)
    if policy == NanPolicy.RAISE:
        counts = (~torch.isfinite(logits)).flatten(1).sum(1)
        # host sync: raise mode has to know on the host whether to raise.
        per_row = {str(b): int(c) for b, c in enumerate(counts.tolist()) if c}
        raise_if_nan_logits(per_row)
    target = logits.dtype if dtype is None else dtype
    if policy == NanPolicy.OFF:
        return logits.to(target), rows
    work = logits.to(target, copy=True)
    sanitize_nan_logits(work, "samplers")
    return work, rows


def raise_if_nonfinite_probs(nan_policy: NanPolicy | str | None, *probs: torch.Tensor | None) -> None:
    """Under policy ``raise``, raise NanLogitsError naming batch rows whose given
    probabilities hold NaN/Inf. Other policies: nothing (probabilities are cleaned).

    Shape: each of probs [B, ..., V] or None.
    """
    given = [x for x in probs if x is not None]
    if NanPolicy.resolve(nan_policy) != NanPolicy.RAISE or not given:
        return
    counts = sum((~torch.isfinite(x)).flatten(1).sum(1) for x in given)
    # host sync: raise mode has to know on the host whether to raise.
    per_row = {str(b): int(c) for b, c in enumerate(counts.tolist()) if c}
    raise_if_nan_logits(per_row)


def clean_probs(probs: torch.Tensor, *, zero_rows: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 copy of ``probs`` with NaN/Inf/negative entries zeroed, rows renormalised.

    Shape:
        probs: [..., V] -> (clean [..., V] float32, bad [...] bool)

    ``bad`` marks rows that held NaN/Inf/negative entries or had no positive mass.
    ``zero_rows`` says what a row without positive mass becomes: ``"uniform"`` (target
    rows: every formula downstream stays defined and every id stays in range) or
    ``"zero"`` (draft rows: nothing was proposed, so every draft token there is rejected).
    """
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
