"""Random draws: per-row uniforms, the exponential race, and k distinct draws per row.

Every random number the samplers use comes from :func:`row_uniform`. With one generator
(or None) a call draws its whole tensor at once; with a sequence of generators, one per
batch row, row r's numbers come only from ``generator[r]``, drawn in an order fixed by
that row's own inputs and the call's static shapes, so a row's result never depends on
its batch-mates (and a request is reproducible across batches). Every row of a call draws
the same count of numbers, fixed by the call's shapes; the one exception is a call whose
rows are all greedy on the host (``SamplingParams.all_greedy``), which draws nothing. A
greedy row's tokens never use its numbers either way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from numbers import Integral

import torch

from samplers.params import check_generator

Generators = torch.Generator | Sequence[torch.Generator] | None


def row_uniform(
    shape: Sequence[int],
    generator: Generators = None,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Uniform random numbers in (0, 1], row r from ``generator[r]`` when given a sequence.

    Shape:
        shape: (rows, ...); returns a ``dtype`` tensor of that shape on ``device``.

    ``generator`` None or one ``torch.Generator``: the whole tensor in one draw. A sequence
    of ``shape[0]`` generators: row r is ``1 - rand(shape[1:], generator=generator[r])``, so
    it consumes exactly ``prod(shape[1:])`` numbers of its own generator and nothing of
    the others'. (That is one small draw per row: torch has no batched generators.)
    float64 by default because float32 can round a uniform to exactly 0.0.

    Examples
    --------
    >>> gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    >>> alone = row_uniform((1, 3), [torch.Generator().manual_seed(2)], device="cpu")
    >>> torch.equal(row_uniform((2, 3), gens, device="cpu")[1], alone[0])  # row 1 ignores row 0
    True
    """
    shape = tuple(int(s) for s in shape)
    device = torch.device(device)
    if generator is None or isinstance(generator, torch.Generator):
        check_generator(generator, device)
        return 1.0 - torch.rand(shape, dtype=dtype, device=device, generator=generator)
    if not shape:
        raise ValueError("shape must have a row dimension when generator is a sequence")
    check_generator(generator, device, shape[0])
    if shape[0] == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    # One draw per row from the row's own generator: a Python loop over rows, unavoidable.
    rows = [torch.rand(shape[1:], dtype=dtype, device=device, generator=g) for g in generator]
    return 1.0 - torch.stack(rows)


def race_sample(weights: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """Draw one index per row with probability proportional to ``weights``, no host sync.

    Shape: weights [B, ..., V] (non-negative, need not be normalised) -> int64 [B, ...].

    Exponential race: argmax_i w_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability
    w_i / sum(w). E = -log(U), U from :func:`row_uniform`. Entries that are not > 0 (zero,
    NaN) never win unless the whole row is such, and then the result is 0: always in range.
    """
    return race_scores(weights, generator).argmax(-1)


def race_scores(weights: torch.Tensor, generator: Generators) -> torch.Tensor:
    """w / E for positive weights, a negative score for the rest. [..., V] -> float64 [..., V].

    Non-positive (or NaN) entries score ``-1 - i``: below every positive entry and
    distinct, so they rank by index.
    """
    u = row_uniform(weights.shape, generator, device=weights.device)
    e = -torch.log(u)  # >= 0; e == 0 only when u == 1, then w/e = inf wins
    w = weights.double()
    return torch.where(w > 0, w / e, race_tail(w.shape[-1], w.device))


@functools.lru_cache(maxsize=16)
def race_tail(vocab: int, device: torch.device) -> torch.Tensor:
    """``-1 - i`` for i < vocab, float64: the scores of non-positive weights (cached, never written to:
    a draw takes two ops fewer; ``docs/performance.md`` has what that is worth)."""
    return -1.0 - torch.arange(vocab, dtype=torch.float64, device=device)


def sample_without_replacement(probs: torch.Tensor, k: int, generator: Generators = None) -> torch.Tensor:
    """Draw ``k`` distinct ids per row from ``probs``, in draw order, without a host sync.

    Shape:
        probs: [B, ..., V] non-negative (need not be normalised); generator: None, one
            Generator, or one per row B.
        returns: int64 [B, ..., k], every id in [0, V).

    Exponential-race top-k (equivalent to Gumbel-top-k): the k largest ``p_i / E_i``, in
    decreasing order, are distributed as k successive draws without replacement: the
    first from p, the next from p renormalised without the first, and so on. This is the
    order ``tree_verify(..., sibling_sampling="without_replacement")`` expects.

    A row with only m < k positive entries (zero, negative and NaN entries count as 0)
    gets its m draws first, then the k - m lowest zero-probability ids in increasing
    order: distinct, in range, and never accepted by ``tree_verify`` (q = 0 there). k must
    be in [0, V].

    Examples
    --------
    >>> g = torch.Generator().manual_seed(0)
    >>> sample_without_replacement(torch.tensor([[0.0, 0.5, 0.5, 0.0]]), 3, g)[0, 2].item()
    0
    """
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.dim() < 2:
        raise ValueError("probs must be a floating tensor [B, ..., V]")
    vocab = probs.shape[-1]
    if isinstance(k, bool) or not isinstance(k, Integral) or not 0 <= k <= vocab:
        raise ValueError(f"k must be an int in [0, {vocab}] (the vocabulary size), got {k!r}")
    check_generator(generator, probs.device, probs.shape[0])
    return race_scores(probs, generator).topk(int(k), dim=-1, sorted=True).indices
