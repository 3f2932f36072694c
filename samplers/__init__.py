"""NaN-safe sampling and speculative verification (greedy, chain, EAGLE tree).

The middle layer of safespec: logits go through ``numerics`` under the active NanPolicy
and come out as tokens. Every function is functional (inputs are never mutated), takes
per-row parameters as scalars or tensors [B], and never syncs with the device except
where its docstring says so (``nan_policy="raise"``, ``check_inputs=True``, and
``tree_verify`` without ``max_depth``).
"""

from .probs import PLACEHOLDER_TOKEN_ID, logits_to_probs, sample
from .tree import TreeVerifyResult, tree_verify
from .verify import chain_speculative_sampling, greedy_verify

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "TreeVerifyResult",
    "chain_speculative_sampling",
    "greedy_verify",
    "logits_to_probs",
    "sample",
    "tree_verify",
]
