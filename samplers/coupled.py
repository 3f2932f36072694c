"""Coupled sampling: Gumbel-max draws whose noise is keyed by (seed, position, token id).

The token at absolute position t of a request with seed s is

    argmax_x [ log p(x) + G(s, t, x) ]

with p the processed distribution (temperature, then top-k / top-p / min-p, exactly as
``logits_to_probs``) and G a standard Gumbel variable computed from a hash of (s, t, x).
For i.i.d. Gumbels this is an exact draw from p (the Gumbel-max trick). Because the noise
is a function of (s, t, x) alone, and not of a generator's state, the batch, the row or
the number of draws made before, any two distributions scored with the same noise are
*coupled*: a drafter that proposes ``argmax_x [log q(x) + G(s, t, x)]`` is right whenever
the two argmaxes agree (probability >= (1 - TV) / (1 + TV); Daliri, Musco and Suresh,
"Coupling without Communication and Drafter-Invariant Speculative Decoding"), and the
emitted tokens depend on (logits, parameters, seed) only, whatever drafted them.

The hash (``coupled_hash``). Write S(k, i) = mix(k + (i + 1) * GAMMA mod 2**64) for output
i of a SplitMix64 stream seeded with k (GAMMA = 0x9E3779B97F4A7C15, ``mix`` SplitMix64's
finalizer, a bijection of 64-bit words). Then

    h(s, t, x) = S(S(S(s, 0), t), x)

the seed's stream gives the key of a position stream, whose output t keys a token stream,
whose output x is the word for token x. For a fixed key, i -> S(k, i) is injective, so
two positions (two tokens) of one seed never share a word; distinct seeds collide only by
a chance of about 2**-64 per pair. torch has no uint64 arithmetic, so it runs on int64
tensors: add, multiply and xor are the same bits in two's complement, and the logical
right shift is the arithmetic one masked to its low ``64 - shift`` bits. Only integer ops
up to here, so the words are the same bits on every device.

The uniform. u = (k + 1/2) / 2**52 with k the top 52 bits of h (as the signed ``h >> 12``
plus 2**51), in float64: u lies in [2**-53, 1 - 2**-53], never 0 or 1, and every value is
an odd multiple of 2**-53, exact in float64 (53 bits plus the half would need 54). float64
and not float32 because the winning Gumbel of a V-token row sits in the upper tail of
probability about 1/V, where a 24-bit uniform leaves only some 2**24 / V distinct values
(about 100 for V = 150k): the argmax's law would be visibly quantized. G = -log(-log u) is
taken in float64 and rounded once to float32, the dtype of the scores.

Devices. The words and the uniforms are bit-identical on CPU and CUDA; ``log`` may differ
in the last float64 bit between the two, which the rounding to float32 hides almost always,
and the processed log-probabilities are as close as the two devices' softmaxes.
"""

from __future__ import annotations

from numbers import Integral

import torch

from numerics import NanPolicy
from samplers.nan import prepare_logits
from samplers.params import (SamplingParams, check_device, check_float_tensor, check_int_tensor, check_shape,
                              check_vocab)
from samplers.output import SamplerOutput
from samplers.probs import process_logits, resolve_params

_U64 = 1 << 64


def _int64(word: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch multiplies int64 modulo 2**64)."""
    return word - _U64 if word >= 1 << 63 else word


GAMMA = _int64(0x9E3779B97F4A7C15)  # SplitMix64's increment (odd: i -> i * GAMMA is a bijection)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_UNIFORM_SHIFT = 12  # keep the top 52 bits
_UNIFORM_SCALE = 2.0**-52
_UNIFORM_OFFSET = 0.5 + 2.0**-53  # (h >> 12) * 2**-52 + this == ((h >> 12) + 2**51 + 1/2) / 2**52


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 words: the arithmetic shift, sign copies masked off. A new tensor."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 words (a bijection of 64-bit words). Writes into ``z``."""
    z ^= _shift_right(z, 30)
    z *= _MIX1
    z ^= _shift_right(z, 27)
    z *= _MIX2
    z ^= _shift_right(z, 31)
    return z


def _stream(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Output ``counters`` of SplitMix64 streams seeded with ``keys`` (broadcast): a new tensor."""
    return _mix(keys + (counters + 1) * GAMMA)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The key of the token stream of each (seed, position). Shape: broadcast of the two."""
    return _stream(_stream(seeds, torch.zeros_like(seeds)), positions)


def coupled_hash(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, *,
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The 64-bit word h(seed, position, token) of every token, as int64 (see the module docstring).

    Shape:
        seeds: [B] integer; positions: [B] or [B, N] integer (row b's N positions share seeds[b]).
        token_ids: [V] integer, the token id of each column (a drafter's reduced vocabulary), or
            None: column j is token j.
        returns: int64 [B, V] or [B, N, V], V = ``vocab_size``.

    NaN: none (integers only).
    """
    seeds, positions = _check_keys(seeds, positions)
    vocab, token_ids = _check_token_ids(token_ids, vocab_size, positions.device)
    seeds = seeds.view(seeds.shape + (1,) * (positions.dim() - 1))  # [B, 1...]: broadcast over N
    return token_words(seeds, positions, _tokens(vocab, token_ids, positions.device))


def token_words(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """h(seed, position, token). Shape: seeds broadcastable to positions [...], tokens [V] -> int64 [..., V]."""
    return _stream(position_keys(seeds, positions).unsqueeze(-1), tokens)


def _uniform(words: torch.Tensor) -> torch.Tensor:
    """int64 words -> float64 uniforms (k + 1/2) / 2**52 in (0, 1), k the top 52 bits. Same shape."""
    # (h >> 12) in [-2**51, 2**51) converts exactly; scale and offset are exact too.
    return (words >> _UNIFORM_SHIFT).double().mul_(_UNIFORM_SCALE).add_(_UNIFORM_OFFSET)


def gumbel(u: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1) -> standard Gumbel -log(-log u), float64, in place."""
    return u.log_().neg_().log_().neg_()


def coupled_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, *,
                  token_ids: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Standard Gumbel noise G(seed, position, token) for every token, float32.

    Shape:
        seeds: [B] integer; positions: [B] or [B, N] integer (row b's N positions share seeds[b]).
        token_ids: [V] integer, the token id keying each column's noise, or None (column j is
            token j): a drafter over a reduced vocabulary gets its tokens' noise.
        returns: float32 [B, V] or [B, N, V], V = ``vocab_size``; every value finite,
            in about [-3.6, 36.7].

    A value depends on its (seed, position, token) only: never on the other rows, the batch
    size, the vocabulary size (a token's noise is keyed by its id) or the device (see the
    module docstring for the hash and the one float rounding). ``backend``: ``"torch"``,
    ``"triton"`` (one kernel, the same bits; CPU tensors need ``TRITON_INTERPRET=1``) or
    ``"auto"``, which is the torch path (the kernel is opt-in).

    NaN: none (no float input).

    Examples
    --------
    >>> import torch
    >>> g = coupled_noise(torch.tensor([7, 7]), torch.tensor([3, 4]), 5)
    >>> torch.equal(g[0], coupled_noise(torch.tensor([7]), torch.tensor([3]), 5)[0])
    True
    """
    seeds, positions = _check_keys(seeds, positions)
    vocab, token_ids = _check_token_ids(token_ids, vocab_size, positions.device)
    if positions.dim() == 2:  # row b*N + n is (seeds[b], positions[b, n])
        seeds = seeds.repeat_interleave(positions.shape[1])
    noise = _noise(seeds, positions.flatten(), vocab, token_ids, None, _check_backend(backend))
    return noise.view(positions.shape + (vocab,))


def _coupled_noise_reference(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                             token_ids: torch.Tensor | None = None, base: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of the noise: G(seed, position, token), plus ``base`` when given.

    Shape: seeds, positions int64 [R]; token_ids int64 [V] (column j's token id) or None (column j
    is token j); base float32 [R, V] or None -> float32 [R, V] (a new tensor).

    NaN: a NaN in ``base`` stays NaN; the noise has none.
    """
    tokens = _tokens(vocab_size, token_ids, seeds.device)
    noise = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    for rows in _row_blocks(seeds.shape[0], vocab_size, seeds.device):
        noise[rows] = gumbel(_uniform(token_words(seeds[rows], positions[rows], tokens)))  # rounds once to float32
        if base is not None:
            noise[rows].add_(base[rows])
    return noise


CPU_BLOCK_WORDS = 1 << 16
"""Words per block of rows on CPU: a block's int64 words and float64 uniforms stay in a core's L2 cache
through the hash's twenty-odd elementwise passes, which otherwise each stream all R x V words through
memory."""


def _row_blocks(rows: int, vocab_size: int, device: torch.device) -> list[slice]:
    """The blocks of rows the torch noise is made in: on CPU ``CPU_BLOCK_WORDS`` words at most (one
    row at least), elsewhere all rows at once (a GPU wants few, large kernels)."""
    per_block = max(1, CPU_BLOCK_WORDS // vocab_size) if device.type == "cpu" else max(rows, 1)
    return [slice(start, start + per_block) for start in range(0, rows, per_block)]


def _noise(seeds, positions, vocab_size, token_ids, base, backend: str) -> torch.Tensor:
    """Dispatch of the noise (plus base) on the chosen backend; arguments as in the reference."""
    if backend != "triton":
        return _coupled_noise_reference(seeds, positions, vocab_size, token_ids, base)
    from samplers import triton_coupled

    return triton_coupled.coupled_noise_triton(seeds, positions, vocab_size, token_ids, base)


def _check_backend(backend) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return backend


def coupled_scores(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    nan_policy: NanPolicy | str | None = None,
    check_inputs: bool = False,
    return_nonfinite: bool = False,
    params: SamplingParams | None = None,
    token_ids: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Noised processed log-probabilities log p(x) + G(seed, position, x): their argmax is the coupled sample.

    Shape:
        logits: [B, V], or [B, N, V] for N positions per row (a tree's nodes, a chain's steps).
        seeds: [B] integer; positions: [B] with [B, V] logits, [B, N] with [B, N, V] logits.
        temperature, top_k, top_p, min_p: per row, as in :func:`logits_to_probs` (scalar,
            list of B or tensor [B]); row b's N positions share row b's parameters.
        params: a built ``SamplingParams`` of B rows instead of those four (as in :func:`sample`).
        token_ids: [V] integer, the token id keying each column's noise (a drafter over a
            reduced vocabulary), or None: column j is token j.
        backend: where the noise is made, as in :func:`coupled_noise`.
        returns: float32 scores [B, V] or [B, N, V]; with ``return_nonfinite`` the
            :class:`SamplerOutput` ``(scores, nonfinite_rows [B] bool)`` with the attribute
            ``dead_rows`` [B] bool.

    A token of probability 0 (masked by -inf, top-k, top-p or min-p) scores -inf; every
    other score is finite. A greedy row (temperature 0) scores finite only at its first
    argmax. The top-k of a row's scores are its coupled drafts; comparing two models'
    argmaxes is the coupled verification.

    NaN: logits are sanitized per ``nan_policy`` as in :func:`logits_to_probs` (``raise``:
    NaN only), so an all-NaN row scores like a uniform one; under ``"off"`` a row still
    holding NaN scores NaN (``nonfinite_rows``/``dead_rows`` are still computed when asked).
    """
    seeds, positions = _check(logits, seeds, positions, backend)
    params = resolve_params(params, logits.shape[0], logits.device, temperature, top_k, top_p, min_p, check_inputs)
    vocab, token_ids = _check_token_ids(token_ids, logits.shape[-1], logits.device)
    prep = prepare_logits(logits, nan_policy, report=return_nonfinite)  # per batch row, before the flattening
    if logits.dim() == 3:  # row b*N + n holds logits[b, n]
        per_row = logits.shape[1]
        seeds, params = seeds.repeat_interleave(per_row), params.repeat(per_row)
    scores = _noised_log_probs(prep.work.reshape(-1, vocab), seeds, positions.flatten(), token_ids, params, backend)
    scores = scores.view(logits.shape)
    if not return_nonfinite:
        return scores
    return SamplerOutput(("scores", "nonfinite_rows"), scores=scores, nonfinite_rows=prep.nonfinite,
                         dead_rows=prep.dead)


def coupled_sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    min_p=None,
    nan_policy: NanPolicy | str | None = None,
    check_inputs: bool = False,
    return_nonfinite: bool = False,
    params: SamplingParams | None = None,
    backend: str = "auto",
):
    """Draw one token per row from the processed distribution by Gumbel-max with noise keyed by (seed, position).

    Shape:
        logits: [B, V]; seeds: [B] integer; positions: [B] integer (absolute positions).
        temperature, top_k, top_p, min_p: as in :func:`sample`.
        returns: ids [B] int64 in [0, V); with ``return_nonfinite`` also nonfinite_rows [B]
            bool and dead_rows [B] bool.

    An exact draw from p, the same for a (logits, parameters, seed, position) in any batch,
    at any row, on any device (up to float rounding of p, see the module docstring): it is
    the argmax of :func:`coupled_scores`. Temperature 0 gives the first argmax of the
    logits, as does top_k = 1 without ties (tokens tied at the top stay in and the noise
    picks one, as in :func:`sample`); a token of probability 0 is never drawn. No host sync.

    NaN: logits are sanitized per ``nan_policy`` (``raise``: NaN only); an all-NaN row gives
    a valid id (uniform over the vocabulary, or id 0 if greedy) and is reported in
    ``nonfinite_rows`` and ``dead_rows``. Under ``"off"`` nothing is checked: a row still
    holding NaN gives the index of its first NaN (in range); the masks are computed only when
    ``return_nonfinite`` asks for them.

    Parameters
    ----------
    logits : torch.Tensor
        Floating logits; never modified.
    seeds : torch.Tensor
        One key per row, any int64 value (a request's seed): rows with the same seed and
        position draw the same noise.
    positions : torch.Tensor
        The absolute position of the token each row draws (the second key).
    temperature, top_k, top_p, min_p, nan_policy, check_inputs, return_nonfinite, params
        As in :func:`sample`.
    backend : {"auto", "torch", "triton"}, default "auto"
        Where the noise is computed, as in :func:`coupled_noise`; every backend gives the
        same noise.

    Returns
    -------
    torch.Tensor or SamplerOutput
        ``ids``; with ``return_nonfinite`` the :class:`SamplerOutput` ``(ids,
        nonfinite_rows)`` with the attribute ``dead_rows``.

    Examples
    --------
    >>> import torch
    >>> from samplers import coupled_sample
    >>> logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    >>> seeds, positions = torch.tensor([1, 2]), torch.tensor([10, 4])
    >>> coupled_sample(logits, seeds, positions, temperature=0.0).tolist()
    [1, 0]
    >>> a = coupled_sample(logits, seeds, positions)
    >>> bool(a[1] == coupled_sample(logits[1:], seeds[1:], positions[1:])[0])  # alone: same token
    True
    >>> coupled_sample(logits, seeds, positions, top_k=1).tolist()  # one token left per row
    [1, 0]
    """
    check_float_tensor(logits, "logits", 2)
    seeds, positions = _check(logits, seeds, positions, backend)
    params = resolve_params(params, logits.shape[0], logits.device, temperature, top_k, top_p, min_p, check_inputs)
    prep = prepare_logits(logits, nan_policy, report=return_nonfinite)
    if params.all_greedy:
        ids = prep.work.argmax(-1)  # what the noised one-hot gives, without the [B, V] noise
    else:
        ids = _noised_log_probs(prep.work, seeds, positions, None, params, backend).argmax(-1)
    if not return_nonfinite:
        return ids
    return SamplerOutput(("ids", "nonfinite_rows"), ids=ids, nonfinite_rows=prep.nonfinite, dead_rows=prep.dead)


def _noised_log_probs(work: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      token_ids: torch.Tensor | None, params: SamplingParams, backend: str) -> torch.Tensor:
    """log p + G for sanitized float32 logits.

    Shape: work [R, V], seeds/positions/params [R], token_ids [V] or None -> float32 [R, V].
    """
    log_p = process_logits(work, params).log_()  # probability 0 -> -inf: never the argmax
    return _noise(seeds, positions, work.shape[-1], token_ids, log_p, backend)


def _check(logits, seeds, positions, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the tensors of the scoring functions and the backend -> (seeds int64 [B], positions int64).

    Shape: logits [B, V] with positions [B], or [B, N, V] with positions [B, N]; seeds [B].
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a tensor [B, V] or [B, N, V], got {shape}")
    check_float_tensor(logits, "logits", logits.dim())
    check_vocab(logits.shape[-1], "logits")
    batch = logits.shape[0]
    seeds, positions = _check_keys(seeds, positions)
    check_device(seeds, "seeds", logits.device)
    if seeds.shape[0] != batch:
        raise ValueError(f"seeds must have shape ({batch},), one per row of logits, got {tuple(seeds.shape)}")
    if positions.shape != logits.shape[:-1]:
        raise ValueError(f"positions must have shape {tuple(logits.shape[:-1])} (the logits without the "
                         f"vocabulary), got {tuple(positions.shape)}")
    _check_backend(backend)
    return seeds, positions


def _check_keys(seeds, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds [B] and positions [B] or [B, N], integer tensors on one device -> both int64."""
    check_int_tensor(seeds, "seeds", 1)
    if not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2):
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"positions must be an integer tensor [B] or [B, N], got {got}")
    check_int_tensor(positions, "positions", positions.dim())
    if positions.shape[0] != seeds.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} rows but seeds has {seeds.shape[0]}")
    if positions.device != seeds.device:
        raise ValueError(f"positions is on {positions.device} but seeds is on {seeds.device}")
    return seeds.long(), positions.long()


def _check_token_ids(token_ids, vocab_size, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """-> (V, token_ids as int64 [V] or None): the vocabulary size and column ids checked."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, Integral) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if token_ids is None:
        return int(vocab_size), None
    check_int_tensor(token_ids, "token_ids", 1)
    check_shape(token_ids, "token_ids", (int(vocab_size),))
    if token_ids.device != device:
        raise ValueError(f"token_ids is on {token_ids.device} but the other tensors are on {device}")
    return int(vocab_size), token_ids.long()


def _tokens(vocab_size: int, token_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The token id of each column, int64 [V]: ``token_ids``, or 0..V-1 when None."""
    return torch.arange(vocab_size, dtype=torch.int64, device=device) if token_ids is None else token_ids
