"""The two updates of recursive rejection sampling, shared by chain and tree verification.

Callers reach them as ``rejection.residual`` / ``rejection.without_token`` (module
attributes), so that the distribution tests can patch in their mutants in one place.
"""

from __future__ import annotations

import torch


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(p - q, 0)): the target after a draw from q was rejected.

    Shape: p, q [B, V] float32 (p sums to 1) -> [B, V] float32, rows sum to 1.

    Exact arithmetic gives the residual positive mass whenever a rejection is possible;
    rounding can leave none (p == q): then p is kept rather than sampling from nothing.
    """
    res = (p - q).clamp(min=0)
    total = res.sum(-1, keepdim=True)
    return torch.where(total > 0, res / total.clamp(min=1e-30), p)


def without_token(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q with token x removed and renormalised: the law of the next draw without replacement.

    Shape: q [B, V] float32, x [B] int64 in [0, V) -> [B, V] float32. A row left with no
    mass becomes all zero (no further sibling can have been drawn from it).
    """
    q = q.scatter(1, x.unsqueeze(1), 0.0)
    total = q.sum(-1, keepdim=True)
    return q / torch.where(total > 0, total, 1.0)
