"""Logits -> probabilities (temperature, top-k, top-p, min-p) and sync-free sampling."""

from __future__ import annotations

import torch

from numerics import NanPolicy
from samplers._nan import prepare_logits
from samplers._params import (
    check_float_tensor,
    check_generator,
    check_row_param_values,
    check_vocab,
    row_param,
)

PLACEHOLDER_TOKEN_ID = -1  # padding in every output id tensor


class RowParams:
    """Per-row sampling parameters as device tensors [R]; None means disabled."""

    __slots__ = ("temperature", "top_k", "top_p", "min_p")

    def __init__(self, temperature, top_k, top_p, min_p):
        self.temperature = temperature  # float32 [R]
        self.top_k = top_k  # int64 [R] or None; <= 0 means disabled
        self.top_p = top_p  # float32 [R] or None
        self.min_p = min_p  # float32 [R] or None

    @classmethod
    def parse(cls, batch, device, temperature, top_k, top_p, min_p, check_inputs=False):
        params = cls(
            row_param(temperature, "temperature", batch, device),
            row_param(top_k, "top_k", batch, device),
            row_param(top_p, "top_p", batch, device),
            row_param(min_p, "min_p", batch, device),
        )
        if check_inputs:
            for name in cls.__slots__:
                check_row_param_values(getattr(params, name), name)
        return params

    def repeat(self, n: int) -> "RowParams":
        """Each row's parameters repeated for ``n`` consecutive rows ([R] -> [R*n])."""
        rep = lambda t: None if t is None else t.repeat_interleave(n)  # noqa: E731
        return RowParams(rep(self.temperature), rep(self.top_k), rep(self.top_p), rep(self.min_p))


def process_logits(x: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Sanitized float32 logits -> float32 probabilities under per-row parameters.

    Shape:
        x: [R, V] float32, already free of NaN/Inf (it is not modified).
        returns: [R, V] float32; every row sums to 1.

    Order: temperature, top-k, top-p (on the top-k renormalised distribution), min-p.
    Tokens tied at a top-k/top-p boundary are kept together. Rows with temperature 0
    are a one-hot on the first argmax. If ``x`` still held NaN (policy ``off`` on a
    corrupted row) the row comes out NaN; samplers map that to a valid id.
    """
    vocab = x.shape[-1]
    temp = params.temperature
    greedy = temp <= 0  # [R]
    best = x.argmax(-1)  # [R]
    # Shift by the row max before dividing: the max maps to exactly 0, everything else
    # to <= 0, so a tiny temperature gives -inf tails instead of inf - inf = NaN.
    z = (x - x.max(-1, keepdim=True).values) / torch.where(greedy, 1.0, temp).unsqueeze(-1)
    if params.top_k is not None or params.top_p is not None:
        z = _top_k_top_p(z, params.top_k, params.top_p)
    if params.min_p is not None:
        # p_i >= min_p * p_max  <=>  z_i >= log(min_p), because max z is 0.
        z = z.masked_fill(z < params.min_p.log().unsqueeze(-1), float("-inf"))
    probs = z.softmax(-1)
    one_hot = torch.nn.functional.one_hot(best, vocab).to(probs.dtype)
    return torch.where(greedy.unsqueeze(-1), one_hot, probs)


def _top_k_top_p(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside top-k, then outside top-p, with one descending sort.

    Shape: z [R, V] (max 0 per row), top_k/top_p [R] or None -> [R, V].
    """
    vocab = z.shape[-1]
    ordered = z.sort(-1, descending=True).values  # [R, V]
    neg_inf = float("-inf")
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)  # [R]
        kth = ordered.gather(-1, (k - 1).unsqueeze(-1))  # [R, 1]
        z = z.masked_fill(z < kth, neg_inf)
        ordered = ordered.masked_fill(ordered < kth, neg_inf)
    if top_p is not None:
        sorted_probs = ordered.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # exclusive cumsum
        p = top_p.unsqueeze(-1)
        # top_p = 1 must keep everything even when the float32 cumsum rounds up to 1.
        keep = (mass_before < p) | (p >= 1.0)
        count = keep.sum(-1, keepdim=True).clamp(min=1)  # [R, 1]; the top token is always kept
        cutoff = ordered.gather(-1, count - 1)
        z = z.masked_fill(z < cutoff, neg_inf)
    return z


def race_sample(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one index per row with probability proportional to ``weights``, no host sync.

    Shape: weights [..., V] (non-negative, need not be normalised) -> int64 [...].

    Exponential race: argmax_i w_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability
    w_i / sum(w). E = -log(U) with U float64 in (0, 1]. Entries that are not > 0 (zero,
    NaN) never win unless the whole row is such, and then the result is 0: always in range.
    """
    u = 1.0 - torch.rand(weights.shape, dtype=torch.float64, device=weights.device, generator=generator)
    e = -torch.log(u)  # [..., V], >= 0; e == 0 only when u == 1, then w/e = inf wins
    w = weights.double()
    score = torch.where(w > 0, w / e, -1.0)
    return score.argmax(-1)


def logits_to_probs(
    logits: torch.Tensor,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    nan_policy: NanPolicy | str | None = None,
    check_inputs: bool = False,
    return_nonfinite: bool = False,
):
    """Turn logits into float32 probabilities under temperature, top-k, top-p and min-p.

    Shape:
        logits: [B, V], float16/bfloat16/float32/float64.
        temperature, top_p, min_p: scalar or float tensor [B]; top_k: int or int tensor [B].
        returns: probs [B, V] float32 (plus nonfinite [B] bool if ``return_nonfinite``).

    ``top_k`` None or 0 disables top-k; ``top_p`` None or 1 disables top-p; ``min_p`` None
    or 0 disables min-p. Temperature 0 gives a one-hot on the argmax.

    NaN: logits are sanitized (per ``nan_policy``) on a copy first, so every row sums to 1
    even when the whole row was NaN (then it is uniform, or one-hot on id 0 if greedy).
    ``return_nonfinite=True`` also returns which rows held NaN/Inf.
    """
    check_float_tensor(logits, "logits", 2)
    batch, vocab = logits.shape
    check_vocab(vocab, "logits")
    params = RowParams.parse(batch, logits.device, temperature, top_k, top_p, min_p, check_inputs)
    work, nonfinite = prepare_logits(logits, nan_policy)
    probs = process_logits(work, params)
    return (probs, nonfinite) if return_nonfinite else probs


def sample(
    logits: torch.Tensor,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    generator: torch.Generator | None = None,
    nan_policy: NanPolicy | str | None = None,
    check_inputs: bool = False,
    return_nonfinite: bool = False,
):
    """Sample one token per row from the processed distribution, without a host sync.

    Shape:
        logits: [B, V]; parameters as in :func:`logits_to_probs`.
        returns: ids [B] int64 in [0, V) (plus nonfinite [B] bool if ``return_nonfinite``).

    Rows with temperature 0 are greedy (first argmax), so one batch mixes greedy and
    sampled rows. ``generator`` must live on the logits' device.

    NaN: logits are sanitized per ``nan_policy``; an all-NaN row gives a valid id (never
    out of range), and ``return_nonfinite=True`` reports the row.

    Examples
    --------
    >>> import torch
    >>> from samplers import sample
    >>> g = torch.Generator().manual_seed(0)
    >>> sample(torch.tensor([[0.0, 5.0, 1.0]]), temperature=0.0).tolist()
    [1]
    >>> int(sample(torch.randn(2, 7), top_k=3, generator=g).max()) < 7
    True
    """
    check_float_tensor(logits, "logits", 2)
    batch, vocab = logits.shape
    check_vocab(vocab, "logits")
    check_generator(generator, logits.device)
    params = RowParams.parse(batch, logits.device, temperature, top_k, top_p, min_p, check_inputs)
    work, nonfinite = prepare_logits(logits, nan_policy)
    if is_all_greedy(temperature):
        ids = work.argmax(-1)  # what the race gives on a one-hot, without the [B, V] draw
    else:
        ids = race_sample(process_logits(work, params), generator)
    return (ids, nonfinite) if return_nonfinite else ids


def is_all_greedy(temperature) -> bool:
    """True when ``temperature`` is a Python number 0 (no tensor read: a host-side fact)."""
    return isinstance(temperature, (int, float)) and temperature == 0
