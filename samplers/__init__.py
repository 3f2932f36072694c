"""NaN-safe sampling and speculative verification (greedy, chain, EAGLE tree).

The middle layer of safespec: logits go through ``numerics`` under the active NanPolicy
and come out as tokens. Every function is functional (inputs are never mutated), takes
per-row parameters as scalars, lists or tensors [B] (one parser: ``SamplingParams``),
draws every random number through ``row_uniform`` (one generator, or one per row), and
never syncs with the device except where its docstring says so (``nan_policy="raise"``,
``check_inputs=True``, and ``tree_verify`` without ``max_depth``).

Glossary (binding across safespec, with the NaN words of ``numerics.policy``)
------------------------------------------------------------------------------
draft token
    A token proposed by the drafter (a chain position or a tree node).
accepted token
    A draft token that verification keeps. ``num_accepted`` counts them per row.
recovered token
    The token drawn from the residual ``normalise(max(p - q, 0))`` (or the target's
    argmax, greedy) at the first rejected position.
bonus token
    The token drawn from the target's last distribution when every draft on the path
    was accepted.
emitted tokens
    What one verification step outputs: the accepted tokens, then exactly one recovered
    or bonus token. ``num_emitted = num_accepted + 1`` (>= 1 for every row).
passed draft (chain only)
    A draft that passes its own acceptance test, whether or not an earlier one was
    rejected (FlashInfer's ``accepted_num``); ``num_passed`` is a drafter-alignment
    metric, not a count of kept tokens.
NaN, Inf, non-finite, dead row
    As in ``numerics.policy``: only NaN triggers ``raise``; Inf is sanitized. Outputs
    ``nonfinite_rows`` (any NaN/Inf) and ``dead_rows`` (a position with no finite value)
    report rows; ``guard`` and ``abort`` act as ``sanitize`` here (a sampler cannot
    finish a request; its caller does, from these outputs).

Renamed for one release (they warn with ``DeprecationWarning`` when accessed):
``emitted_num`` -> ``num_accepted`` and ``accepted_num`` -> ``num_passed`` on the
results of ``greedy_verify`` and ``chain_speculative_sampling``.
"""

__version__ = "1.0.0"

from .nan import clean_probs
from .coupled import coupled_noise, coupled_sample, coupled_scores
from .draws import row_uniform, sample_without_replacement
from .output import SamplerOutput
from .params import SamplingParams
from .probs import PLACEHOLDER_TOKEN_ID, logits_to_probs, sample
from .tree import TreeVerifyResult, greedy_tree_verify, tree_verify
from .verify import chain_speculative_sampling, greedy_accept, greedy_verify

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "SamplerOutput",
    "SamplingParams",
    "TreeVerifyResult",
    "chain_speculative_sampling",
    "clean_probs",
    "coupled_noise",
    "coupled_sample",
    "coupled_scores",
    "greedy_tree_verify",
    "greedy_accept",
    "greedy_verify",
    "logits_to_probs",
    "row_uniform",
    "sample",
    "sample_without_replacement",
    "tree_verify",
]
