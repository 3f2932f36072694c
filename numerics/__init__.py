"""NaN/Inf-safe logits: sanitize, one-shot async warning, per-request NaN counts, fail-fast.

The words NaN, Inf, non-finite and dead row are defined in the glossary of
``numerics.policy``; that glossary is binding across safespec.

The bottom layer of safespec; it imports nothing else of ours. triton is optional
and only imported when the Triton backend of ``nan_counts_per_request`` runs.
"""

__version__ = "1.0.0"

from .counts import NonfiniteCounts, nan_counts_per_request, nonfinite_counts_per_request
from .policy import NAN_POLICY_ENV, NanLogitsError, NanPolicy, raise_if_nan_logits
from .sanitize import SANITIZE_MAX, dead_row_mask, nonfinite_row_mask, sanitize_bound, sanitize_nan_logits
from .warner import AsyncNanWarner, get_nan_warner, maybe_warn_nan, reset_nan_warner

__all__ = [
    "AsyncNanWarner",
    "NAN_POLICY_ENV",
    "NanLogitsError",
    "NanPolicy",
    "NonfiniteCounts",
    "SANITIZE_MAX",
    "dead_row_mask",
    "get_nan_warner",
    "maybe_warn_nan",
    "nan_counts_per_request",
    "nonfinite_counts_per_request",
    "nonfinite_row_mask",
    "raise_if_nan_logits",
    "reset_nan_warner",
    "sanitize_bound",
    "sanitize_nan_logits",
]
