"""Chain verification: greedy, and speculative (rejection) sampling.

Words (accepted, recovered, bonus, emitted) as in the glossary of ``samplers``. Outputs
hold the accepted tokens, then one recovered or bonus token, then
``PLACEHOLDER_TOKEN_ID`` (-1): ``num_emitted = num_accepted + 1`` tokens per row.
"""

from __future__ import annotations

import torch

from numerics import NanPolicy, dead_row_mask
from samplers import rejection
from samplers.nan import argmax_dtype, clean_probs, prepare_logits, raise_if_nan_probs
from samplers.params import (
    check_device,
    check_float_tensor,
    check_generator,
    check_ids_in_range,
    check_int_tensor,
    check_shape,
    check_vocab,
)
from samplers.draws import Generators, race_sample, row_uniform
from samplers.output import SamplerOutput
from samplers.probs import PLACEHOLDER_TOKEN_ID


def _emit(draft: torch.Tensor, final: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    """Output row: draft[:num], then final, then -1.

    Shape: draft [B, K] int64, final [B] int64, num [B] int64 -> [B, K+1] int32.
    """
    batch, k = draft.shape
    pos = torch.arange(k + 1, device=draft.device)  # [K+1]
    padded = torch.cat([draft, final.unsqueeze(1)], 1)  # [B, K+1]
    padded = padded.scatter(1, num.unsqueeze(1), final.unsqueeze(1))
    out = torch.where(pos <= num.unsqueeze(1), padded, PLACEHOLDER_TOKEN_ID)
    return out.to(torch.int32)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of leading True entries per row. Shape: [B, K] bool -> [B] int64."""
    return mask.cumprod(1).sum(1)   # cumprod of bool counts in int64


def greedy_accept(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's argmax at every position and how many leading drafts equal it.

    ``greedy_verify``'s acceptance without its checks, NaN pass and padded output, for a caller
    that validated and sanitized the logits itself (the pipeline's NaN pass): a row emits
    ``argmax[:num_accepted + 1]``, the accepted drafts then the target's token after them.

    Shape:
        draft_token_ids: [B, K] integer; target_logits: [B, K+1, V] floating, sanitized.
        returns: (argmax [B, K+1] int64, num_accepted [B] int64).
    """
    dtype = argmax_dtype(target_logits)
    work = target_logits if dtype in (None, target_logits.dtype) else target_logits.to(dtype)
    best = work.argmax(-1)  # [B, K+1]
    return best, _leading_true(draft_token_ids == best[:, :draft_token_ids.shape[1]])  # out-of-range ids never match


def greedy_verify(
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    nan_policy: NanPolicy | str | None = None,
    check_inputs: bool = False,
    return_nonfinite: bool = False,
) -> SamplerOutput:
    """Accept draft tokens while they equal the target's argmax.

    Shape:
        draft_token_ids: [B, K] integer.
        target_logits: [B, K+1, V] floating; position j predicts the token after draft j-1.
        returns: :class:`SamplerOutput` ``(output_token_ids [B, K+1] int32,
            num_accepted [B] int32)`` [+ ``nonfinite_rows`` [B] bool if
            ``return_nonfinite``]; attributes also ``num_emitted`` [B] int32 and
            ``dead_rows`` [B] bool (``emitted_num``: deprecated name of num_accepted).

    ``output_token_ids`` holds the accepted draft tokens, then the target's argmax at the
    first mismatch (or the bonus argmax when all K match), then -1. ``num_accepted``
    counts the accepted draft tokens (FlashInfer's ``emitted_draft_token_num``); the row
    emits ``num_emitted = num_accepted + 1`` tokens. Out-of-range draft ids are never
    accepted.

    NaN: logits are sanitized on a copy per ``nan_policy`` (``raise``: NaN only; an
    all-NaN position's argmax is id 0); ``nonfinite_rows`` marks rows with any NaN/Inf
    logit, ``dead_rows`` rows with a position that has no finite logit. Under ``"off"``
    nothing is checked (no pass over the logits): both are None.
    """
    check_int_tensor(draft_token_ids, "draft_token_ids", 2)
    check_float_tensor(target_logits, "target_logits", 3)
    batch, k = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    check_vocab(vocab, "target_logits")
    check_shape(target_logits, "target_logits", (batch, k + 1, vocab))
    check_device(draft_token_ids, "draft_token_ids", target_logits.device)
    if check_inputs:
        check_ids_in_range(draft_token_ids, "draft_token_ids", vocab)
    prep = prepare_logits(target_logits, nan_policy, dtype=argmax_dtype(target_logits), report=return_nonfinite)
    best, num = greedy_accept(draft_token_ids, prep.work)
    # The accepted drafts equal the argmax at their positions, and the token after them is the argmax
    # there: the row is the argmax up to position num, then -1 (two ops, not _emit's gather and scatter).
    pos = torch.arange(k + 1, device=best.device)
    out = torch.where(pos <= num[:, None], best, PLACEHOLDER_TOKEN_ID).to(torch.int32)
    num = num.to(torch.int32)
    positional = ("output_token_ids", "num_accepted") + (("nonfinite_rows",) if return_nonfinite else ())
    return SamplerOutput(positional, output_token_ids=out, num_accepted=num, num_emitted=num + 1,
                         nonfinite_rows=prep.nonfinite, dead_rows=prep.dead)


def chain_speculative_sampling(
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generator: Generators = None,
    nan_policy: NanPolicy | str | None = None,
    check_inputs: bool = False,
    return_nonfinite: bool = False,
    backend: str = "auto",
) -> SamplerOutput:
    """Speculative sampling of a draft chain: the output is distributed as the target's.

    Shape:
        draft_probs: [B, K, V] floating, or None.
        draft_token_ids: [B, K] integer.
        target_probs: [B, K+1, V] floating.
        generator: None, one ``torch.Generator``, or a sequence of B of them.
        returns: output_token_ids [B, K+1] int32, num_passed [B] int32, num_accepted [B]
            int32, num_emitted [B] int32; nonfinite_rows [B] bool and dead_rows [B] bool.

    Same rule as FlashInfer's function of this name: draft j is accepted when
    ``q > 0 and p / q >= u`` (u float64 uniform in (0, 1]); at the first rejection the
    recovered token is drawn from normalised ``max(p - q, 0)``; if all K are accepted the
    bonus token is drawn from ``target_probs[:, K]``. Exact for drafts really drawn from
    ``draft_probs`` (sampled chains: draft j ~ q_j given drafts < j), and for
    deterministic drafts with ``draft_probs=None``. ``num_accepted`` counts the accepted
    draft tokens (the row emits ``num_emitted = num_accepted + 1``); ``num_passed``
    counts the drafts that pass their own test regardless of earlier rejections (a
    drafter-alignment metric, FlashInfer's ``accepted_num``). An out-of-range draft id
    is always rejected and its q treated as all zero (the recovered token is then drawn
    from p).

    NaN: probabilities that are NaN/Inf/negative count as 0 and rows are renormalised; a
    target row with no mass left becomes uniform, a draft row with no mass rejects its
    token. ``nonfinite_rows`` marks batch rows where any such repair happened,
    ``dead_rows`` rows with a target position without any finite probability. This
    happens under every ``nan_policy``; ``"raise"`` first raises NanLogitsError naming
    the batch rows whose probabilities hold NaN (one host sync; Inf does not raise).
    Under ``"off"`` nothing is reported: ``nonfinite_rows`` and ``dead_rows`` are None.

    Parameters
    ----------
    draft_probs : torch.Tensor or None
        The drafter's distribution that draft token j was drawn from; None for
        deterministic drafts (q is then one-hot on the token).
    draft_token_ids : torch.Tensor
        The K draft tokens of each row, in chain order.
    target_probs : torch.Tensor
        The target's distribution at each draft position, then after the last draft.
    generator : torch.Generator or sequence of torch.Generator, optional
        One generator for the batch, or one per row (row b then draws K uniforms, then V,
        from ``generator[b]`` only). None: torch's default generator.
    nan_policy : NanPolicy or str, optional
        As in :func:`sample`; None reads the active policy.
    check_inputs : bool, default False
        Check that every draft id is in [0, V) (one host sync).
    return_nonfinite : bool, default False
        Also return ``nonfinite_rows`` as the fourth positional output.
    backend : {"auto", "torch", "flashinfer"}, default "auto"
        ``"auto"`` uses FlashInfer's kernel for CUDA tensors when flashinfer is installed
        and ``generator`` is not a sequence, else torch; ``"torch"`` forces the torch path;
        ``"flashinfer"`` requires it (one generator only).

    Returns
    -------
    SamplerOutput
        ``(output_token_ids, num_passed, num_accepted)``, plus ``nonfinite_rows`` with
        ``return_nonfinite``. ``output_token_ids`` holds the accepted drafts, then the
        recovered or bonus token, then -1. Attributes also ``num_emitted`` and
        ``dead_rows``. Deprecated names: ``accepted_num`` (num_passed), ``emitted_num``
        (num_accepted).

    Examples
    --------
    Deterministic drafts against one-hot targets, so every draw is certain: row 0's
    second draft (2) is rejected and 3 recovered; row 1 keeps both and adds the bonus 0.

    >>> import torch
    >>> from samplers import chain_speculative_sampling
    >>> eye = torch.eye(4)
    >>> drafts = torch.tensor([[1, 2], [1, 2]])
    >>> target = torch.stack([eye[[1, 3, 0]], eye[[1, 2, 0]]])   # [B=2, K+1=3, V=4]
    >>> out = chain_speculative_sampling(None, drafts, target, generator=torch.Generator().manual_seed(0))
    >>> out.output_token_ids.tolist()
    [[1, 3, -1], [1, 2, 0]]
    >>> out.num_accepted.tolist(), out.num_emitted.tolist(), out.num_passed.tolist()
    ([1, 2], [2, 3], [1, 2])
    """
    check_int_tensor(draft_token_ids, "draft_token_ids", 2)
    check_float_tensor(target_probs, "target_probs", 3)
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    check_vocab(vocab, "target_probs")
    check_shape(target_probs, "target_probs", (batch, k + 1, vocab))
    check_device(draft_token_ids, "draft_token_ids", device)
    if draft_probs is not None:
        check_float_tensor(draft_probs, "draft_probs", 3)
        check_shape(draft_probs, "draft_probs", (batch, k, vocab))
        check_device(draft_probs, "draft_probs", device)
    check_generator(generator, device, batch)
    if backend not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'flashinfer', got {backend!r}")
    per_row_generators = generator is not None and not isinstance(generator, torch.Generator)
    if backend == "flashinfer" and per_row_generators:
        raise ValueError("backend='flashinfer' takes one generator, not one per row")
    if check_inputs:
        check_ids_in_range(draft_token_ids, "draft_token_ids", vocab)
    # Probabilities are cleaned under every policy (it is cheap and keeps ids in range);
    # ``raise`` additionally raises NanLogitsError naming rows with NaN probabilities.
    raise_if_nan_probs(nan_policy, target_probs, draft_probs)

    p, bad = clean_probs(target_probs, zero_rows="uniform")  # [B, K+1, V], [B, K+1]
    draft = draft_token_ids.long()
    valid = (draft >= 0) & (draft < vocab)  # [B, K]
    safe = draft.clamp(0, vocab - 1)
    checked = return_nonfinite or NanPolicy.resolve(nan_policy) != NanPolicy.OFF
    nonfinite = bad.any(1)
    dead = dead_row_mask(target_probs).any(1) if checked else None
    if draft_probs is None:
        q = torch.nn.functional.one_hot(safe, vocab).float()  # [B, K, V]
    else:
        q, bad_q = clean_probs(draft_probs, zero_rows="zero")
        nonfinite = nonfinite | bad_q.any(1)
    q = q * valid.unsqueeze(-1)  # an out-of-range id proposes nothing

    use_fi = backend != "torch" and device.type == "cuda" and not per_row_generators
    fi = _flashinfer() if use_fi else None
    if backend == "flashinfer" and fi is None:
        raise ValueError("backend='flashinfer' needs CUDA tensors and an importable flashinfer "
                         '(pip install "safespec[flashinfer]")')
    if fi is not None:
        out, passed, num = _chain_flashinfer(fi, p, q, safe, generator)
    else:
        out, passed, num = _chain_torch(p, q, safe, generator)
    nonfinite = nonfinite if checked else None
    positional = ("output_token_ids", "num_passed", "num_accepted") + (("nonfinite_rows",) if return_nonfinite else ())
    return SamplerOutput(positional, output_token_ids=out, num_passed=passed, num_accepted=num.to(torch.int32),
                         num_emitted=(num + 1).to(torch.int32), nonfinite_rows=nonfinite, dead_rows=dead)


def _chain_torch(p, q, draft, generator):
    """Torch chain sampling on cleaned inputs.

    Shape: p [B, K+1, V] float32 (rows sum to 1), q [B, K, V] float32, draft [B, K] int64
    in range -> (out [B, K+1] int32, passed [B] int32, num_accepted [B] int64).
    Draws per row: K acceptance uniforms, then V for the recovered/bonus race.
    """
    batch, k = draft.shape
    p_draft = p[:, :k].gather(2, draft.unsqueeze(-1)).squeeze(-1).double()  # [B, K]
    q_draft = q.gather(2, draft.unsqueeze(-1)).squeeze(-1).double()  # [B, K]
    u = row_uniform((batch, k), generator, device=p.device)
    # Guarded division: q == 0 (token the drafter could not have proposed) is a rejection.
    passed = (q_draft > 0) & (p_draft >= u * q_draft)  # p/q >= u without dividing
    num = _leading_true(passed)  # [B]
    final = _final_token(p, q, num, generator)
    return _emit(draft, final, num), passed.sum(1).to(torch.int32), num


def _final_token(p, q, num, generator):
    """Recovered token from max(p - q, 0) at position ``num``, or bonus from p[:, K].

    Shape: p [B, K+1, V], q [B, K, V], num [B] int64 in [0, K] -> [B] int64.
    """
    batch, k1, vocab = p.shape
    rows = torch.arange(batch, device=p.device)
    # indexing picks one [V] row per request; a gather along dim 1 with an index expanded over V reads
    # the index tensor per element and measured several times slower on CPU
    p_at = p[rows, num]  # [B, V]
    if k1 == 1:   # no drafts: the bonus position only, where q = 0
        q_at = torch.zeros_like(p_at)
    else:   # the bonus position (num == K) has q = 0: a real row of q zeroed, not a padded copy of q
        q_at = q[rows, num.clamp(max=k1 - 2)] * (num < k1 - 1).unsqueeze(-1)
    return race_sample(rejection.residual(p_at, q_at), generator)


_FLASHINFER_MISSING = object()
_flashinfer_module = None


def _flashinfer():
    """flashinfer.sampling if importable, else None. Imported lazily, on first CUDA use."""
    global _flashinfer_module
    if _flashinfer_module is None:
        try:
            import flashinfer.sampling as fi_sampling  # noqa: PLC0415 (optional dependency)

            _flashinfer_module = fi_sampling
        except Exception:  # noqa: BLE001 (any import failure means "not available")
            _flashinfer_module = _FLASHINFER_MISSING
    return None if _flashinfer_module is _FLASHINFER_MISSING else _flashinfer_module


def _chain_flashinfer(fi, p, q, draft, generator):
    """FlashInfer's kernel on cleaned inputs, then a fix-up for tokens with q(x) == 0.

    FlashInfer accepts when ``u * q(x) < p(x)``, so it accepts a token with q(x) == 0
    (out-of-range ids, whose q row is zero here, included). Our rule rejects them. The
    fix-up cuts each row at its first such position if FlashInfer went past it and draws
    the recovered token there from max(p - q, 0): the decisions before that position are
    untouched, so the result has the torch path's distribution.
    """
    batch, k = draft.shape
    # FlashInfer's (accepted_num, emitted_num) are our (num_passed, num_accepted).
    out, passed, fi_accepted = fi.chain_speculative_sampling(
        q.contiguous(), draft.to(torch.int32).contiguous(), p.contiguous(), generator=generator
    )
    q_draft = q.gather(2, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
    first_bad = _leading_true(q_draft > 0)  # [B], K when every token is proposable
    fi_accepted = fi_accepted.long()
    cut = fi_accepted > first_bad
    num = torch.where(cut, first_bad, fi_accepted)
    fixed_final = _final_token(p, q, first_bad, generator)
    final = torch.where(cut, fixed_final, out.long().gather(1, num.unsqueeze(1)).squeeze(1))
    return _emit(draft, final, num), passed.to(torch.int32), num
