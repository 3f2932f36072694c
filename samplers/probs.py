"""Logits -> probabilities (temperature, top-k, top-p, min-p) and sync-free sampling."""

from __future__ import annotations

import torch

from numerics import SANITIZE_MAX, NanPolicy
from samplers.nan import prepare_logits
from samplers.params import SamplingParams, check_float_tensor, check_generator, check_vocab
from samplers.draws import Generators, race_sample
from samplers.output import SamplerOutput

PLACEHOLDER_TOKEN_ID = -1  # padding in every output id tensor


def process_logits(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sanitized float32 logits -> float32 probabilities under per-row parameters.

    Shape:
        x: [R, V] float32, already free of NaN/Inf (it is not modified).
        returns: [R, V] float32; every row sums to 1.

    Order: temperature, top-k, top-p (on the top-k renormalised distribution), min-p.
    Tokens tied at a top-k/top-p boundary are kept together. Rows with temperature 0
    are a one-hot on the first argmax. A masked token (logit <= -SANITIZE_MAX: a -inf
    mask or a NaN after sanitizing) keeps probability 0 at every temperature, however
    large, unless its whole row is masked (then the row is uniform). If ``x`` still held
    NaN (policy ``off`` on a corrupted row) the row comes out NaN; samplers map that to a
    valid id.
    """
    vocab = x.shape[-1]
    temp = params.temperature
    # no greedy row (a host fact): no one-hot to build, the same probabilities with five ops fewer
    greedy = None if params.all_sampled else temp <= 0  # [R]
    # The row max, and where a greedy row needs it its first index (the argmax, NaN included) from the
    # same reduction: on CPU an argmax of its own costs more than the rest of a one-row call's reductions,
    # and the max alone (amax) far less than either.
    top = x.amax(-1, keepdim=True) if greedy is None else x.max(-1, keepdim=True)
    top_values = top if greedy is None else top.values
    # Masked tokens, unless the whole row is (then nothing is): the row's threshold is -inf when its
    # max is masked, and x holds no -inf. One compare over [R, V], not three.
    masked = x <= torch.where(top_values <= -SANITIZE_MAX, float("-inf"), -SANITIZE_MAX)  # [R, V]
    # Shift by the row max before dividing: the max maps to exactly 0, everything else
    # to <= 0, so a tiny temperature gives -inf tails instead of inf - inf = NaN.
    z = (x - top_values) / (temp if greedy is None else torch.where(greedy, 1.0, temp)).unsqueeze(-1)
    # A huge temperature maps -1e30 to about -1: re-mask, so masked tokens stay at 0.
    z = z.masked_fill(masked, float("-inf"))
    if params.top_k is not None or params.top_p is not None:
        z = top_k_top_p(z, params.top_k, params.top_p)
    if params.min_p is not None:
        # p_i >= min_p * p_max  <=>  z_i >= log(min_p), because max z is 0.
        z = z.masked_fill(z < params.min_p.log().unsqueeze(-1), float("-inf"))
    probs = z.softmax(-1)
    if greedy is None:
        return probs
    one_hot = torch.nn.functional.one_hot(top.indices[..., 0], vocab).to(probs.dtype)
    return torch.where(greedy.unsqueeze(-1), one_hot, probs)


def top_k_top_p(z: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
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
    params: SamplingParams | None = None,
):
    """Turn logits into float32 probabilities under temperature, top-k, top-p and min-p.

    Shape:
        logits: [B, V], float16/bfloat16/float32/float64.
        temperature, top_p, min_p: scalar, list of B, or float tensor [B]; top_k: int,
            list of B, or int tensor [B] (see :class:`SamplingParams`).
        params: a built ``SamplingParams`` of B rows instead of those four, as in :func:`sample`
            (its host facts kept: ``all_sampled`` skips the greedy one-hot).
        returns: probs [B, V] float32; with ``return_nonfinite`` the
            :class:`SamplerOutput` ``(probs, nonfinite_rows [B] bool)`` whose attribute
            ``dead_rows`` [B] bool marks rows with no finite value.

    ``temperature`` None means 1.0 (no scaling); 0 gives a one-hot on the argmax; it must
    be finite. ``top_k`` None or 0 disables top-k; ``top_p`` None or 1 disables top-p;
    ``min_p`` None or 0 disables min-p. A -inf-masked token stays at probability 0.

    NaN: logits are sanitized (``nan_policy`` off/sanitize/abort/guard; ``raise`` raises
    on NaN only, never on Inf) on a copy first, so every row sums to 1 even when the whole
    row was NaN (then it is uniform, or one-hot on id 0 if greedy). Under ``"off"``
    nothing is sanitized; ``nonfinite_rows`` and ``dead_rows`` are still computed when
    ``return_nonfinite`` asks for them.
    """
    check_float_tensor(logits, "logits", 2)
    batch, vocab = logits.shape
    check_vocab(vocab, "logits")
    params = resolve_params(params, batch, logits.device, temperature, top_k, top_p, min_p, check_inputs)
    prep = prepare_logits(logits, nan_policy, report=return_nonfinite)
    probs = process_logits(prep.work, params)
    if not return_nonfinite:
        return probs
    return SamplerOutput(("probs", "nonfinite_rows"), probs=probs, nonfinite_rows=prep.nonfinite, dead_rows=prep.dead)


def sample(
    logits: torch.Tensor,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    generator: Generators = None,
    nan_policy: NanPolicy | str | None = None,
    check_inputs: bool = False,
    return_nonfinite: bool = False,
    params: SamplingParams | None = None,
):
    """Sample one token per row from the processed distribution, without a host sync.

    Shape:
        logits: [B, V]; temperature, top_k, top_p, min_p: as in :func:`logits_to_probs`.
        generator: None, one ``torch.Generator``, or a sequence of B of them.
        returns: ids [B] int64 in [0, V); with ``return_nonfinite`` also nonfinite_rows [B]
            bool and dead_rows [B] bool.

    Rows with temperature 0 are greedy (first argmax), so one batch mixes greedy and
    sampled rows. Generators must live on the logits' device.

    NaN: logits are sanitized per ``nan_policy`` (``raise``: NaN only); an all-NaN row
    gives a valid id (never out of range) and is reported in ``nonfinite_rows`` and
    ``dead_rows`` (computed under ``"off"`` too when ``return_nonfinite`` asks for them).

    Parameters
    ----------
    logits : torch.Tensor
        Floating logits (float16, bfloat16, float32 or float64); never modified.
    temperature, top_k, top_p, min_p : scalar, list of B, or tensor [B], optional
        Per-row sampling parameters, parsed by :class:`SamplingParams`: ``temperature``
        0 is greedy, None is 1.0; ``top_k`` None or 0, ``top_p`` None or 1 and ``min_p``
        None or 0 switch their filter off.
    generator : torch.Generator or sequence of torch.Generator, optional
        Where the uniforms come from: one generator for the batch, or one per row (row b
        then draws V uniforms from ``generator[b]`` only). None: torch's default generator.
    nan_policy : NanPolicy or str, optional
        ``"off"``, ``"sanitize"``, ``"guard"``, ``"abort"`` or ``"raise"``; None reads the
        active policy (``numerics``).
    check_inputs : bool, default False
        Check the parameters' values (one host sync); off, bad values are not caught.
    return_nonfinite : bool, default False
        Also return which rows held NaN/Inf and which had no finite value.
    params : SamplingParams, optional
        B rows built once (``SamplingParams.build``), instead of ``temperature``/``top_k``/
        ``top_p``/``min_p`` (leave those at their defaults). It keeps its host facts
        (``all_greedy``, ``all_sampled``), which tensors passed again lose.

    Returns
    -------
    torch.Tensor or SamplerOutput
        ``ids``; with ``return_nonfinite`` the :class:`SamplerOutput` ``(ids,
        nonfinite_rows)`` with the attribute ``dead_rows``.

    Examples
    --------
    >>> import torch
    >>> from samplers import sample
    >>> logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, float("nan")]])
    >>> sample(logits, temperature=0.0, nan_policy="sanitize").tolist()
    [1, 0]
    >>> out = sample(logits, temperature=0.0, nan_policy="sanitize", return_nonfinite=True)
    >>> out.nonfinite_rows.tolist(), out.dead_rows.tolist()
    ([False, True], [False, False])
    >>> g = torch.Generator().manual_seed(0)
    >>> ids = sample(torch.randn(2, 7, generator=g), top_k=3, generator=g)
    >>> ids.shape, ids.dtype, bool(((ids >= 0) & (ids < 7)).all())
    (torch.Size([2]), torch.int64, True)
    """
    check_float_tensor(logits, "logits", 2)
    batch, vocab = logits.shape
    check_vocab(vocab, "logits")
    check_generator(generator, logits.device, batch)
    params = resolve_params(params, batch, logits.device, temperature, top_k, top_p, min_p, check_inputs)
    prep = prepare_logits(logits, nan_policy, report=return_nonfinite)
    if params.all_greedy:
        ids = prep.work.argmax(-1)  # what the race gives on a one-hot, without the [B, V] draw
    else:
        ids = race_sample(process_logits(prep.work, params), generator)
    if not return_nonfinite:
        return ids
    return SamplerOutput(("ids", "nonfinite_rows"), ids=ids, nonfinite_rows=prep.nonfinite, dead_rows=prep.dead)


def resolve_params(params: SamplingParams | None, batch: int, device, temperature, top_k, top_p, min_p,
            check_inputs: bool) -> SamplingParams:
    """``params`` when given (checked against the batch and device), else the parsed arguments."""
    if params is None:
        return SamplingParams.build(batch, temperature, top_k, top_p, min_p, device=device, check_inputs=check_inputs)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if temperature != 1.0 or top_k is not None or top_p is not None or min_p is not None:
        raise ValueError("pass either params or temperature/top_k/top_p/min_p, not both")
    if params.batch != batch or params.temperature.device != torch.device(device):
        raise ValueError(f"params has {params.batch} rows on {params.temperature.device}; the logits "
                         f"{batch} rows on {device}")
    if check_inputs:
        params.check_values()
    return params
