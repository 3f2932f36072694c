"""coupled_sample, coupled_scores, coupled_noise: the law of the draws and their keying.

Distribution tests: 100k draws, vocab 6, chi-square at ALPHA = 1e-6 (see samplers_testlib),
over seeds, over the positions of one seed, and for the joint law of two positions. Each
is paired with a mutant patched into samplers.coupled that the same statistic rejects:
noise that is not Gumbel (-log u, an exponential), noise keyed without the position,
noise keyed by the batch row instead of the seed, and position and token sharing one
counter. The coupling itself: draws from p and q under one noise agree at the exact
Gumbel-coupling rate. Then exact properties: the hash against a pure-Python uint64
reference, batch invariance, temperature 0, masks, token ids, argument errors, NaN rows.

The Triton kernel is compared with the torch path bit for bit, under TRITON_INTERPRET=1 on
CPU-only machines (set only while its module is imported), compiled on CUDA ones.
"""

from __future__ import annotations

import importlib
import math
import os
from unittest import mock

import numpy as np
import pytest
import torch

import samplers.coupled as coupled_mod
from numerics import NanLogitsError
from samplers import SamplingParams, coupled_noise, coupled_sample, coupled_scores, logits_to_probs
from samplers.coupled import coupled_hash
from samplers_testlib import NUM_SAMPLES, chi_square, reference_probs

V = 6
LOGITS = [2.0, 1.4, 0.9, 0.2, -0.6, -1.3]  # no ties: the reference needs none
LOGITS_NEXT = [-0.4, 1.1, 0.3, 1.9, -1.0, 0.6]  # the second position of the joint-law test

PARAMS = {
    "plain": dict(temperature=1.0),
    "temperature": dict(temperature=0.6),
    "top_k": dict(temperature=1.2, top_k=4),
    "top_p": dict(temperature=1.3, top_p=0.75),
    "min_p": dict(temperature=1.1, min_p=0.12),
    "top_k_top_p_min_p": dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.08),
}

_original_position_keys = coupled_mod.position_keys


def _rows(logits, n=NUM_SAMPLES) -> torch.Tensor:
    return torch.tensor(logits).expand(n, V).contiguous()


# ----------------------------------------------------------------------------- mutants


def _mutant_exponential_noise(u):
    """Mutant: -log u (an Exp(1) variable) instead of the Gumbel -log(-log u)."""
    return u.log_().neg_()


def _mutant_without_position(seeds, positions):
    """Mutant: the position left out of the key (every position of a seed shares its noise)."""
    return _original_position_keys(seeds, torch.zeros_like(positions))


def _mutant_keyed_by_row(seeds, positions):
    """Mutant: the batch row's index keys the noise instead of its seed."""
    rows = torch.arange(seeds.shape[0], device=seeds.device).view(seeds.shape)
    return _original_position_keys(rows, positions)


def _mutant_shared_counter(seeds, positions, tokens):
    """Mutant: one counter for position and token (G(s, t, x) = G(s, 0, t + x)), so position t + 1
    sees position t's noise shifted by one token."""
    keys = coupled_mod.position_keys(seeds, torch.zeros_like(positions)).unsqueeze(-1)
    return coupled_mod._stream(keys, positions.unsqueeze(-1) + tokens)


# ----------------------------------------------------------------------------- the law over seeds


def _over_seeds_stat(params):
    seeds = torch.arange(NUM_SAMPLES, dtype=torch.int64) * 7919 - 50_000  # negative seeds included
    ids = coupled_sample(_rows(LOGITS), seeds, torch.full((NUM_SAMPLES,), 17), **params)
    return chi_square(ids, reference_probs(LOGITS, **params), V)


@pytest.mark.parametrize("name", list(PARAMS))
def test_over_seeds_matches_processed_distribution(name):
    result = _over_seeds_stat(PARAMS[name])
    assert result.passes, str(result)


def test_over_seeds_with_per_row_parameter_tensors():
    # Two halves with their own parameters, given as tensors [B]: each half follows its own law.
    half = NUM_SAMPLES // 2
    params = dict(temperature=torch.tensor([0.6] * half + [1.2] * half), top_k=torch.tensor([0] * half + [4] * half))
    seeds = torch.arange(NUM_SAMPLES, dtype=torch.int64) + 3
    ids = coupled_sample(_rows(LOGITS), seeds, torch.full((NUM_SAMPLES,), 5), **params)
    first = chi_square(ids[:half], reference_probs(LOGITS, **PARAMS["temperature"]), V)
    second = chi_square(ids[half:], reference_probs(LOGITS, **PARAMS["top_k"]), V)
    assert first.passes and second.passes, f"{first}; {second}"


@pytest.mark.parametrize("name", ["plain", "top_p"])
def test_over_seeds_mutant_exponential_noise_is_rejected(monkeypatch, name):
    monkeypatch.setattr(coupled_mod, "gumbel", _mutant_exponential_noise)
    result = _over_seeds_stat(PARAMS[name])
    assert not result.passes, f"mutant not detected: {result}"


# ----------------------------------------------------------------------------- one seed, many positions


def _over_positions_stat(params):
    positions = torch.arange(NUM_SAMPLES, dtype=torch.int64) + 1000
    ids = coupled_sample(_rows(LOGITS), torch.full((NUM_SAMPLES,), 424242), positions, **params)
    return chi_square(ids, reference_probs(LOGITS, **params), V)


@pytest.mark.parametrize("name", ["plain", "top_k_top_p_min_p"])
def test_one_seed_over_positions_matches_processed_distribution(name):
    result = _over_positions_stat(PARAMS[name])
    assert result.passes, str(result)


@pytest.mark.parametrize(
    "attr, mutant",
    [("position_keys", _mutant_without_position), ("gumbel", _mutant_exponential_noise)],
    ids=["without_position", "exponential_noise"],
)
def test_one_seed_over_positions_mutants_are_rejected(monkeypatch, attr, mutant):
    monkeypatch.setattr(coupled_mod, attr, mutant)
    result = _over_positions_stat(PARAMS["plain"])
    assert not result.passes, f"mutant not detected: {result}"


# ----------------------------------------------------------------------------- two adjacent positions


def _adjacent_stat(params):
    """Joint law of the draws at positions t and t + 1 of each seed, through coupled_scores [B, 2, V]."""
    logits = torch.stack([_rows(LOGITS), _rows(LOGITS_NEXT)], 1)  # [n, 2, V]
    seeds = torch.arange(NUM_SAMPLES, dtype=torch.int64) * 31 + 9
    start = torch.arange(NUM_SAMPLES, dtype=torch.int64) % 50  # t varies over the rows
    ids = coupled_scores(logits, seeds, torch.stack([start, start + 1], 1), **params).argmax(-1)  # [n, 2]
    law = np.outer(reference_probs(LOGITS, **params), reference_probs(LOGITS_NEXT, **params))
    return chi_square(ids[:, 0] * V + ids[:, 1], law.reshape(-1), V * V)


@pytest.mark.parametrize("name", ["plain", "top_p"])
def test_adjacent_positions_are_independent(name):
    result = _adjacent_stat(PARAMS[name])
    assert result.passes, str(result)


@pytest.mark.parametrize(
    "attr, mutant",
    [("position_keys", _mutant_without_position), ("token_words", _mutant_shared_counter)],
    ids=["without_position", "shared_counter"],
)
def test_adjacent_positions_mutants_are_rejected(monkeypatch, attr, mutant):
    monkeypatch.setattr(coupled_mod, attr, mutant)
    result = _adjacent_stat(PARAMS["plain"])
    assert not result.passes, f"mutant not detected: {result}"


# ----------------------------------------------------------------------------- one seed, another row


def _reordered_stat():
    """Joint law of a (seed, position)'s draw in one batch and in a reversed batch: p on the diagonal."""
    seeds = torch.arange(NUM_SAMPLES, dtype=torch.int64) + 77
    positions = torch.full((NUM_SAMPLES,), 3)
    logits = _rows(LOGITS)
    first = coupled_sample(logits, seeds, positions)
    again = coupled_sample(logits, seeds.flip(0), positions).flip(0)
    law = np.diag(reference_probs(LOGITS))
    return chi_square(first * V + again, law.reshape(-1), V * V)


def test_same_seed_in_another_row_draws_the_same_token():
    result = _reordered_stat()
    assert result.passes, str(result)


def test_same_seed_mutant_keyed_by_row_is_rejected(monkeypatch):
    monkeypatch.setattr(coupled_mod, "position_keys", _mutant_keyed_by_row)
    result = _reordered_stat()
    assert not result.passes, f"mutant not detected: {result}"


# ----------------------------------------------------------------------------- two distributions, one noise


DRAFT_LOGITS = [1.2, 1.9, 0.1, 0.4, -0.2, -2.0]  # a drafter's q, unlike p


def _agreement_law(p: np.ndarray, q: np.ndarray) -> float:
    """P(argmax log p + G == argmax log q + G) for one Gumbel vector G: sum_x 1 / sum_y max(p_y / p_x, q_y / q_x).

    Both pick x iff G_y + log max(p_y / p_x, q_y / q_x) < G_x for every y: x wins a Gumbel race of those weights.
    """
    return float(sum(1.0 / np.maximum(p / p[x], q / q[x]).sum() for x in range(len(p))))


def _coupling_stat(draft_position_shift: int = 0):
    """Agreement of the coupled draws from p and q with the same (seed, position), against its exact law."""
    seeds = torch.arange(NUM_SAMPLES, dtype=torch.int64) + 555
    positions = torch.full((NUM_SAMPLES,), 40)
    target = coupled_sample(_rows(LOGITS), seeds, positions)
    draft = coupled_sample(_rows(DRAFT_LOGITS), seeds, positions + draft_position_shift)
    p, q = reference_probs(LOGITS), reference_probs(DRAFT_LOGITS)
    agree = _agreement_law(p, q)
    tv = 0.5 * np.abs(p - q).sum()
    assert agree >= (1 - tv) / (1 + tv)  # the bound of Daliri, Musco and Suresh
    return chi_square((target == draft).long(), [1.0 - agree, agree], 2)


def test_coupled_draws_of_two_distributions_agree_at_the_gumbel_coupling_rate():
    result = _coupling_stat()
    assert result.passes, str(result)


@pytest.mark.parametrize("attr, mutant, shift", [("gumbel", _mutant_exponential_noise, 0), (None, None, 1)],
                         ids=["exponential_noise", "draft_at_another_position"])
def test_coupling_mutants_are_rejected(monkeypatch, attr, mutant, shift):
    if attr is not None:
        monkeypatch.setattr(coupled_mod, attr, mutant)
    result = _coupling_stat(draft_position_shift=shift)
    assert not result.passes, f"mutant not detected: {result}"


# ----------------------------------------------------------------------------- the hash


_M64 = (1 << 64) - 1


def _mix_reference(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _stream_reference(key: int, i: int) -> int:
    return _mix_reference((key + (i + 1) * 0x9E3779B97F4A7C15) & _M64)


def _word_reference(seed: int, position: int, token: int) -> int:
    """h(s, t, x) = S(S(S(s, 0), t), x) in Python's unbounded ints, as uint64."""
    return _stream_reference(_stream_reference(_stream_reference(seed & _M64, 0), position & _M64), token)


SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 12345678901234, -987654321]
POSITIONS = [0, 1, 7, 2**40 + 3, -3, 2**63 - 1, -(2**63)]


def test_hash_and_uniform_match_a_python_uint64_reference():
    vocab = 9
    seeds = torch.tensor(SEEDS, dtype=torch.int64)
    positions = torch.tensor(POSITIONS, dtype=torch.int64)
    words = coupled_hash(seeds, positions, vocab)
    uniforms = coupled_mod._uniform(words)
    noise = coupled_noise(seeds, positions, vocab)
    for b, (s, t) in enumerate(zip(SEEDS, POSITIONS)):
        for x in range(vocab):
            h = _word_reference(s, t, x)
            assert int(words[b, x]) & _M64 == h, (s, t, x)
            # k = (signed h >> 12) + 2**51: the top 52 bits of h with their highest bit flipped
            u = (((h >> 12) ^ (1 << 51)) + 0.5) / 2.0**52  # exact in float64
            assert float(uniforms[b, x]) == u, (s, t, x)
            assert math.isclose(float(noise[b, x]), -math.log(-math.log(u)), rel_tol=1e-6, abs_tol=1e-6)


def test_uniform_never_reaches_0_or_1_and_noise_stays_finite():
    words = torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1, 4095, -4096], dtype=torch.int64)
    u = coupled_mod._uniform(words)
    assert u.min().item() == 2.0**-53 and u.max().item() == 1.0 - 2.0**-53
    g = coupled_mod.gumbel(u.clone()).float()
    assert torch.isfinite(g).all() and -3.7 < g.min().item() and g.max().item() < 36.8


def test_noise_of_a_token_does_not_depend_on_the_vocabulary_size():
    # A token's noise is keyed by its id: a smaller vocabulary is a prefix of a bigger one.
    seeds, positions = torch.tensor([5, -9]), torch.tensor([[0, 1, 2], [40, 41, 42]])
    assert torch.equal(coupled_noise(seeds, positions, 1000)[..., :37], coupled_noise(seeds, positions, 37))


def test_noise_over_positions_equals_one_position_at_a_time():
    seeds, positions = torch.tensor([3, 3, 8]), torch.tensor([[10, 11], [10, 12], [0, 5]])
    noise = coupled_noise(seeds, positions, 11)
    assert noise.shape == (3, 2, 11) and noise.dtype == torch.float32
    for n in range(2):
        assert torch.equal(noise[:, n], coupled_noise(seeds, positions[:, n].contiguous(), 11))
    assert torch.equal(noise[0, 0], noise[1, 0])  # the same (seed, position) in two rows
    assert not torch.equal(noise[0, 1], noise[1, 1])


@pytest.mark.parametrize("rows, vocab", [(7, 5), (7, 8192 + 3), (3, 49_152), (5, 70_001)])
def test_noise_made_in_blocks_of_rows_is_the_noise_made_at_once(monkeypatch, rows, vocab):
    """On CPU the torch noise is made a block of rows at a time (``_row_blocks``): the same bits as all
    rows at once, with blocks of two rows (a last partial one) or the default's, token ids and a base."""
    seeds = torch.tensor((SEEDS * 2)[:rows], dtype=torch.int64)
    positions = torch.tensor((POSITIONS * 2)[:rows], dtype=torch.int64)
    token_ids = torch.randperm(vocab + 11, generator=torch.Generator().manual_seed(vocab))[:vocab]
    base = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    cases = ((None, None), (token_ids, base))

    def noise_in_blocks_of(words: int) -> list[torch.Tensor]:
        monkeypatch.setattr(coupled_mod, "CPU_BLOCK_WORDS", words)
        return [coupled_mod._coupled_noise_reference(seeds, positions, vocab, ids, b) for ids, b in cases]

    rows_per_block = max(1, coupled_mod.CPU_BLOCK_WORDS // vocab)
    assert len(coupled_mod._row_blocks(rows, vocab, torch.device("cpu"))) == -(-rows // rows_per_block)
    blocked = noise_in_blocks_of(coupled_mod.CPU_BLOCK_WORDS), noise_in_blocks_of(2 * vocab)
    assert len(coupled_mod._row_blocks(rows, vocab, torch.device("cpu"))) == (rows + 1) // 2
    whole = noise_in_blocks_of(1 << 40)
    assert len(coupled_mod._row_blocks(rows, vocab, torch.device("cpu"))) == 1
    for got in blocked:
        assert all(torch.equal(a, b) for a, b in zip(got, whole))


def test_token_ids_key_each_column_by_its_token():
    # A drafter over a reduced vocabulary: column j gets the noise of token ids[j].
    seeds, positions = torch.tensor([5, -9]), torch.tensor([[0, 1], [40, 41]])
    ids = torch.tensor([7, 0, 3, 99, 12], dtype=torch.int32)
    full = coupled_noise(seeds, positions, 100)
    assert torch.equal(coupled_noise(seeds, positions, 5, token_ids=ids), full[..., ids.long()])
    words = coupled_hash(seeds, positions, 5, token_ids=ids)
    assert torch.equal(words, coupled_hash(seeds, positions, 100)[..., ids.long()])
    logits = torch.randn(2, 2, 100)
    want = coupled_scores(logits[..., ids.long()], seeds, positions, token_ids=None)  # keyed by columns 0..4
    got = coupled_scores(logits[..., ids.long()], seeds, positions, token_ids=ids)
    assert not torch.equal(got, want)
    assert torch.equal(got, logits_to_probs(logits[..., ids.long()].flatten(0, 1)).log().view(2, 2, 5)
                       + full[..., ids.long()])


# ----------------------------------------------------------------------------- exact properties


def _batch(seed=0, b=9, vocab=33):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, vocab, generator=g) * 2
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g)
    positions = torch.randint(0, 10_000, (b,), generator=g)
    params = dict(temperature=torch.rand(b, generator=g) + 0.3, top_k=torch.randint(0, 20, (b,), generator=g),
                  top_p=torch.rand(b, generator=g) * 0.5 + 0.5, min_p=torch.rand(b, generator=g) * 0.1)
    return logits, seeds, positions, params


def _pick(params, idx):
    return {k: v[idx] for k, v in params.items()}


def _batch_invariance_holds() -> bool:
    logits, seeds, positions, params = _batch()
    ids = coupled_sample(logits, seeds, positions, **params)
    perm = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(1))
    permuted = coupled_sample(logits[perm], seeds[perm], positions[perm], **_pick(params, perm))
    alone = torch.cat([coupled_sample(logits[i:i + 1], seeds[i:i + 1], positions[i:i + 1],
                                      **_pick(params, slice(i, i + 1))) for i in range(logits.shape[0])])
    others, oseeds, opos, oparams = _batch(seed=5, b=20)
    bigger = coupled_sample(torch.cat([others, logits]), torch.cat([oseeds, seeds]), torch.cat([opos, positions]),
                            **{k: torch.cat([oparams[k], v]) for k, v in params.items()})[20:]
    return torch.equal(permuted, ids[perm]) and torch.equal(alone, ids) and torch.equal(bigger, ids)


def test_a_row_does_not_depend_on_its_batch():
    assert _batch_invariance_holds()


def test_batch_invariance_mutant_keyed_by_row_is_rejected(monkeypatch):
    monkeypatch.setattr(coupled_mod, "position_keys", _mutant_keyed_by_row)
    assert not _batch_invariance_holds()


def test_scores_over_positions_equal_one_position_at_a_time_and_their_argmax_is_the_sample():
    logits, seeds, positions, params = _batch(b=5)
    steps = torch.stack([logits, logits.flip(-1), logits * 0.5], 1)  # [B, 3, V]
    pos = torch.stack([positions, positions + 1, positions + 2], 1)  # [B, 3]
    scores = coupled_scores(steps, seeds, pos, **params)
    assert scores.shape == steps.shape and scores.dtype == torch.float32
    for n in range(3):
        one = coupled_scores(steps[:, n], seeds, pos[:, n], **params)
        assert torch.equal(scores[:, n], one)
        assert torch.equal(one.argmax(-1), coupled_sample(steps[:, n], seeds, pos[:, n], **params))


def test_scores_are_log_probs_plus_noise():
    logits, seeds, positions, params = _batch(b=4)
    expected = logits_to_probs(logits, **params).log() + coupled_noise(seeds, positions, logits.shape[-1])
    assert torch.equal(coupled_scores(logits, seeds, positions, **params), expected)


def test_params_object_gives_the_same_draws():
    logits, seeds, positions, params = _batch()
    built = SamplingParams.build(logits.shape[0], **params)
    assert torch.equal(coupled_sample(logits, seeds, positions, params=built),
                       coupled_sample(logits, seeds, positions, **params))


def test_temperature_zero_and_top_k_one_are_the_argmax():
    logits, seeds, positions, _ = _batch(b=12, vocab=50)
    argmax = logits.argmax(-1)
    assert torch.equal(coupled_sample(logits, seeds, positions, temperature=0.0), argmax)
    assert torch.equal(coupled_sample(logits, seeds, positions, top_k=1), argmax)
    assert torch.equal(coupled_scores(logits, seeds, positions, temperature=0.0).argmax(-1), argmax)
    # A batch mixing greedy and sampled rows: the greedy rows are the argmax, the others their own draws.
    temps = torch.tensor([0.0, 1.0] * 6)
    mixed = coupled_sample(logits, seeds, positions, temperature=temps)
    sampled = coupled_sample(logits, seeds, positions, temperature=1.0)
    assert torch.equal(mixed[::2], argmax[::2]) and torch.equal(mixed[1::2], sampled[1::2])


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=50.0), dict(temperature=3.0, top_p=0.99)],
                         ids=["t1", "t50", "t3_top_p"])
def test_masked_tokens_are_never_drawn(params):
    n, vocab = 20_000, 8
    logits = torch.zeros(n, vocab)
    logits[:, 1::2] = float("-inf")  # the odd ids are masked; the even ones are equally likely
    logits[:, 6] = -30.0  # unmasked but very unlikely: allowed, never required
    ids = coupled_sample(logits, torch.arange(n), torch.full((n,), 2), **params)
    assert (ids % 2 == 0).all()
    scores = coupled_scores(logits[:4], torch.arange(4), torch.full((4,), 2), **params)
    assert torch.isneginf(scores[:, 1::2]).all()
    assert torch.equal(torch.isfinite(scores), logits_to_probs(logits[:4], **params) > 0)  # top-p may cut id 6


def test_low_precision_logits_are_accepted():
    logits, seeds, positions, _ = _batch(b=6)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        ids = coupled_sample(logits.to(dtype), seeds, positions, temperature=0.8)
        assert ids.dtype == torch.int64 and ((ids >= 0) & (ids < logits.shape[-1])).all()
    assert torch.equal(coupled_sample(logits.double(), seeds, positions, temperature=0.8),
                       coupled_sample(logits, seeds, positions, temperature=0.8))


# ----------------------------------------------------------------------------- bad input


def _one_row():
    return torch.randn(2, 5), torch.tensor([1, 2]), torch.tensor([3, 4])


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda x, s, p: coupled_sample(x, s.float(), p), "seeds"),
        (lambda x, s, p: coupled_sample(x, s[:1], p), "seeds"),
        (lambda x, s, p: coupled_sample(x, s, p.float()), "positions"),
        (lambda x, s, p: coupled_sample(x, s, p[:, None]), "positions"),
        (lambda x, s, p: coupled_sample(x, torch.tensor([1, 2, 3]), torch.tensor([3, 4, 5])), "seeds"),
        (lambda x, s, p: coupled_sample(x, s, [3, 4]), "positions"),
        (lambda x, s, p: coupled_sample(x.long(), s, p), "logits"),
        (lambda x, s, p: coupled_sample(x[None], s, p), "logits"),
        (lambda x, s, p: coupled_sample(x[:, :0], s, p), "logits"),
        (lambda x, s, p: coupled_sample(x, s, p, temperature=-1.0), "temperature"),
        (lambda x, s, p: coupled_sample(x, s, p, temperature=float("inf")), "temperature"),
        (lambda x, s, p: coupled_sample(x, s, p, top_k=1.5), "top_k"),
        (lambda x, s, p: coupled_sample(x, s, p, top_p=0.0), "top_p"),
        (lambda x, s, p: coupled_sample(x, s, p, min_p=[0.1, 2.0]), "min_p"),
        (lambda x, s, p: coupled_sample(x, s, p, nan_policy="explode"), "nan_policy"),
        (lambda x, s, p: coupled_scores(x[:, None], s, p), "positions"),
        (lambda x, s, p: coupled_scores(x[:, None], s, p[:, None].expand(2, 3)), "positions"),
        (lambda x, s, p: coupled_scores(x, s, p, params=SamplingParams.build(3)), "params"),
        (lambda x, s, p: coupled_noise(s, p, 0), "vocab_size"),
        (lambda x, s, p: coupled_noise(s, p, 2.0), "vocab_size"),
        (lambda x, s, p: coupled_noise(s, p[:1], 4), "positions"),
        (lambda x, s, p: coupled_noise(s, p, 4, backend="cuda"), "backend"),
        (lambda x, s, p: coupled_sample(x, s, p, backend=None), "backend"),
        (lambda x, s, p: coupled_scores(x, s, p, token_ids=torch.arange(4)), "token_ids"),
        (lambda x, s, p: coupled_scores(x, s, p, token_ids=torch.arange(5.0)), "token_ids"),
        (lambda x, s, p: coupled_noise(s, p, 3, token_ids=torch.arange(3)[None]), "token_ids"),
    ],
)
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call(*_one_row())


# ----------------------------------------------------------------------------- NaN rows


def _nan_batch():
    logits = torch.randn(5, 7)
    logits[0, 0] = float("nan")  # first column
    logits[2, 3] = float("nan")  # middle
    logits[3, 6] = float("nan")  # last
    logits[4] = float("nan")  # the whole row
    return logits, torch.arange(5) + 100, torch.full((5,), 9)


def test_nan_policy_raise_names_the_rows():
    logits, seeds, positions = _nan_batch()
    with pytest.raises(NanLogitsError) as info:
        coupled_sample(logits, seeds, positions, nan_policy="raise")
    assert all(str(r) in str(info.value) for r in (0, 2, 3, 4))
    with pytest.raises(NanLogitsError):
        coupled_scores(torch.stack([logits, logits], 1), seeds, torch.stack([positions, positions], 1),
                       nan_policy="raise")
    coupled_sample(logits[1:2], seeds[1:2], positions[1:2], nan_policy="raise")  # a clean row does not raise


@pytest.mark.parametrize("policy", ["sanitize", "guard"])
def test_nan_tokens_are_never_drawn_and_rows_are_reported(policy):
    logits, _, _ = _nan_batch()
    n = 4000
    rows = logits.repeat(n, 1)  # [5n, 7]
    ids, nonfinite = coupled_sample(rows, torch.arange(5 * n), torch.full((5 * n,), 9), nan_policy=policy,
                                    return_nonfinite=True)
    ids = ids.view(n, 5)
    assert (ids[:, 0] != 0).all() and (ids[:, 2] != 3).all() and (ids[:, 3] != 6).all()
    assert ((ids >= 0) & (ids < 7)).all() and len(set(ids[:, 4].tolist())) == 7  # all-NaN row: uniform
    assert nonfinite.view(n, 5).tolist()[0] == [True, False, True, True, True]
    out = coupled_scores(torch.stack([logits, logits], 1), torch.arange(5), torch.zeros(5, 2, dtype=torch.long),
                         nan_policy=policy, return_nonfinite=True)
    assert out.nonfinite_rows.tolist() == [True, False, True, True, True]
    assert out.dead_rows.tolist() == [False, False, False, False, True]
    assert torch.isneginf(out.scores[0, :, 0]).all() and not torch.isnan(out.scores).any()


def test_nan_policy_off_still_gives_ids_in_range():
    logits, seeds, positions = _nan_batch()
    out = coupled_sample(logits, seeds, positions, nan_policy="off", return_nonfinite=True)
    assert ((out.ids >= 0) & (out.ids < 7)).all()
    # nothing sanitized, but the masks the caller asked for are computed (issue 40)
    assert out.nonfinite_rows.tolist() == [True, False, True, True, True]
    assert out.dead_rows.tolist() == [False, False, False, False, True]


# ----------------------------------------------------------------------------- the Triton kernel


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernel():
    """samplers.triton_coupled, interpreted on CPU-only machines (TRITON_INTERPRET is read at import)."""
    pytest.importorskip("triton")
    module = importlib.import_module("samplers.triton_coupled")
    if DEVICE == "cpu" and not module.interpreter_active():  # imported before, compiled (test_docs does)
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            module = importlib.reload(module)
    return module


def _keys(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.cat([torch.tensor(SEEDS), torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)])
    positions = torch.cat([torch.tensor(POSITIONS), torch.randint(0, 1 << 20, (rows,), generator=g)])
    return seeds.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("vocab", [1, 5, 1100])  # 1100: two programs per row, the second partial
def test_kernel_noise_equals_torch_bit_for_bit(kernel, vocab):
    seeds, positions = _keys(6)
    torch_noise = coupled_noise(seeds, positions, vocab, backend="torch")
    assert torch.equal(coupled_noise(seeds, positions, vocab, backend="triton"), torch_noise)
    grid = torch.stack([positions, positions + 1], 1)  # [B, 2]
    assert torch.equal(coupled_noise(seeds, grid, vocab, backend="triton"), coupled_noise(seeds, grid, vocab))
    ids = torch.randperm(3 * vocab, generator=torch.Generator().manual_seed(vocab))[:vocab].to(DEVICE)
    assert torch.equal(coupled_noise(seeds, grid, vocab, token_ids=ids, backend="triton"),
                       coupled_noise(seeds, grid, vocab, token_ids=ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_scores_and_samples_equal_torch_bit_for_bit(kernel, dtype):
    logits, seeds, positions, params = _batch(b=5, vocab=1100)
    logits[:, 7] = float("-inf")
    logits[1, 3] = float("nan")
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    logits, seeds, positions = dev(logits).to(dtype), dev(seeds), dev(positions)
    params = {k: dev(v) for k, v in params.items()}
    steps, grid = torch.stack([logits, logits.flip(-1)], 1), torch.stack([positions, positions + 1], 1)
    for backend_args in [dict(logits=logits, positions=positions), dict(logits=steps, positions=grid)]:
        want = coupled_scores(backend_args["logits"], seeds, backend_args["positions"], backend="torch", **params)
        got = coupled_scores(backend_args["logits"], seeds, backend_args["positions"], backend="triton", **params)
        assert torch.equal(got, want)
    assert torch.equal(coupled_sample(logits, seeds, positions, backend="triton", **params),
                       coupled_sample(logits, seeds, positions, **params))
    ids = torch.arange(logits.shape[-1], device=DEVICE) * 3 + 1  # a reduced vocabulary's token ids
    assert torch.equal(coupled_scores(logits, seeds, positions, token_ids=ids, backend="triton", **params),
                       coupled_scores(logits, seeds, positions, token_ids=ids, **params))


def test_kernel_on_cpu_without_the_interpreter_says_how_to_run_it(kernel, monkeypatch):
    monkeypatch.setattr(kernel, "interpreter_active", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        coupled_noise(torch.tensor([1]), torch.tensor([2]), 4, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares CPU with CUDA")
def test_words_and_uniforms_are_the_same_bits_on_cpu_and_cuda():
    seeds, positions = _keys(64)
    words = coupled_hash(seeds, positions, 5000)
    cpu_words = coupled_hash(seeds.cpu(), positions.cpu(), 5000)
    assert torch.equal(words.cpu(), cpu_words)
    assert torch.equal(coupled_mod._uniform(words).cpu(), coupled_mod._uniform(cpu_words))
    # The float64 logs may differ in their last bit; after the rounding to float32 almost never.
    noise, cpu_noise = coupled_noise(seeds, positions, 5000).cpu(), coupled_noise(seeds.cpu(), positions.cpu(), 5000)
    assert (noise != cpu_noise).float().mean().item() < 1e-4
    torch.testing.assert_close(noise, cpu_noise, rtol=2e-7, atol=1e-7)
