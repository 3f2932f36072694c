"""Input checks, NaN policies, and NaN/Inf fuzzing: ids always in [0, V)."""

from __future__ import annotations

import pytest
import torch

from numerics import NanLogitsError
from samplers import (
    SamplingParams,
    chain_speculative_sampling,
    greedy_verify,
    logits_to_probs,
    sample,
    sample_without_replacement,
    tree_verify,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# ----------------------------------------------------------------------------- bad input


def _tree_args(b=2, n=4, v=9):
    return torch.zeros(b, n, dtype=torch.long), torch.tensor([[-1, 0, 0, 1]] * b), torch.randn(b, n, v)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: sample(torch.randn(2, 3, 4)), "logits"),
        (lambda: sample(torch.zeros(2, 5, dtype=torch.long)), "logits"),
        (lambda: sample(torch.randn(2, 5).numpy()), "logits"),
        (lambda: sample(torch.randn(2, 5), temperature=-0.1), "temperature"),
        (lambda: sample(torch.randn(2, 5), temperature=float("nan")), "temperature"),
        (lambda: sample(torch.randn(2, 5), top_p=0.0), "top_p"),
        (lambda: sample(torch.randn(2, 5), top_p=1.5), "top_p"),
        (lambda: sample(torch.randn(2, 5), top_k=-1), "top_k"),
        (lambda: sample(torch.randn(2, 5), top_k=2.5), "top_k"),
        (lambda: sample(torch.randn(2, 5), min_p=1.1), "min_p"),
        (lambda: sample(torch.randn(2, 5), temperature=torch.ones(3)), "temperature"),
        (lambda: sample(torch.randn(2, 5), top_k=torch.ones(2)), "top_k"),
        (lambda: sample(torch.randn(2, 5), top_p=torch.ones(2, device="meta")), "top_p"),
        (lambda: sample(torch.randn(2, 5), generator=1234), "generator"),
        (lambda: sample(torch.randn(2, 5), temperature=torch.tensor([1.0, -1.0]), check_inputs=True), "temperature"),
        (lambda: logits_to_probs(torch.randn(2, 0)), "logits"),
        (lambda: greedy_verify(torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 3, 7)), "target_logits"),
        (lambda: greedy_verify(torch.zeros(2, 3), torch.randn(2, 4, 7)), "draft_token_ids"),
        (lambda: greedy_verify(torch.zeros(2, 3, dtype=torch.long, device="meta"), torch.randn(2, 4, 7)), "draft_token_ids"),
        (lambda: greedy_verify(torch.full((1, 1), 9), torch.randn(1, 2, 7), check_inputs=True), "draft_token_ids"),
        (lambda: chain_speculative_sampling(torch.rand(2, 3, 6), torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 6)), "target_probs"),
        (lambda: chain_speculative_sampling(torch.rand(2, 2, 6), torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 4, 6)), "draft_probs"),
        (lambda: chain_speculative_sampling(None, torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 4, 6), backend="cuda"), "backend"),
        (lambda: chain_speculative_sampling(None, torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 4, 6), backend="flashinfer"), "flashinfer"),
        (lambda: tree_verify(*_tree_args()[:2], torch.randn(2, 5, 9)), "target_logits"),
        (lambda: tree_verify(_tree_args()[0], torch.tensor([[-1, 0, 0]] * 2), _tree_args()[2]), "tree_parents"),
        (lambda: tree_verify(_tree_args()[0].float(), *_tree_args()[1:]), "tree_token_ids"),
        (lambda: tree_verify(*_tree_args(), draft_probs=torch.rand(2, 4, 8)), "draft_probs"),
        (lambda: tree_verify(*_tree_args(), max_depth=-1), "max_depth"),
        (lambda: tree_verify(*_tree_args(), top_p=2.0), "top_p"),
        (lambda: tree_verify(_tree_args()[0], torch.tensor([[-1, 0, 3, 1]] * 2), _tree_args()[2], check_inputs=True), "tree_parents"),
        (lambda: tree_verify(_tree_args()[0], torch.tensor([[0, 0, 0, 1]] * 2), _tree_args()[2], check_inputs=True), "tree_parents"),
        (lambda: tree_verify(torch.full((2, 4), 99), *_tree_args()[1:], check_inputs=True), "tree_token_ids"),
        (lambda: sample(torch.randn(2, 5), nan_policy="explode"), "explode"),
        # temperatures must be finite: inf would make -inf-masked tokens samplable
        (lambda: sample(torch.randn(2, 5), temperature=float("inf")), "temperature"),
        (lambda: logits_to_probs(torch.randn(2, 5), temperature=float("inf")), "temperature"),
        (lambda: sample(torch.randn(2, 5), temperature=[1.0, float("inf")]), r"temperature\[1\]"),
        (lambda: tree_verify(*_tree_args(), temperature=float("inf")), "temperature"),
        (lambda: sample(torch.randn(2, 5), temperature=torch.tensor([1.0, float("inf")]), check_inputs=True), "temperature"),
        (lambda: sample(torch.randn(2, 5), top_k=[1, 2, 3]), "top_k"),
        (lambda: sample(torch.randn(2, 5), top_p=[0.5, 0.0]), r"top_p\[1\]"),
        (lambda: tree_verify(*_tree_args(), draft_probs=torch.rand(2, 4, 9), sibling_sampling="sorted"), "sibling_sampling"),
        (lambda: sample_without_replacement(torch.rand(2, 5), 6), "k"),
        (lambda: sample_without_replacement(torch.rand(5), 2), "probs"),
        (lambda: SamplingParams.build(2, temperature=[0.5, "hot"]), r"temperature\[1\]"),
        (lambda: SamplingParams.build(3, top_k=[1, 2.5, None]), r"top_k\[1\]"),
        (lambda: SamplingParams.build(-1), "batch"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# ----------------------------------------------------------------------------- NaN policies


def _corrupt(logits, rows):
    logits = logits.clone()
    for r, value in rows.items():
        logits[r, ..., 1] = value
    return logits


@pytest.mark.parametrize("rows", [{0: float("nan")}, {3: float("inf")}, {6: float("-inf"), 0: float("nan")}])
def test_nonfinite_rows_first_middle_last_reported(rows):
    logits = _corrupt(torch.randn(7, 10), rows)
    before = logits.clone()
    ids, bad = sample(logits, generator=torch.Generator().manual_seed(0), return_nonfinite=True)
    assert bad.tolist() == [r in rows for r in range(7)]
    assert ((ids >= 0) & (ids < 10)).all()
    assert torch.equal(before.nan_to_num(), logits.nan_to_num())  # caller's tensor untouched
    probs, bad2 = logits_to_probs(logits, return_nonfinite=True)
    assert torch.allclose(probs.sum(-1), torch.ones(7)) and torch.equal(bad, bad2)


def test_raise_policy_names_nan_rows_only():
    # Only NaN raises; +inf / -inf rows are sanitized (one NaN vocabulary, see numerics.policy).
    logits = _corrupt(torch.randn(5, 10), {1: float("nan"), 4: float("inf"), 2: float("-inf")})
    with pytest.raises(NanLogitsError) as info:
        sample(logits, nan_policy="raise")
    assert set(info.value.nan_counts) == {"1"}
    sample(torch.randn(5, 10), nan_policy="raise")  # clean input does not raise
    tree = _tree_args(b=3)
    corrupted = tree[2].clone()
    corrupted[2, 3, 0] = float("nan")
    corrupted[0, 1, 0] = float("inf")
    with pytest.raises(NanLogitsError) as info:
        tree_verify(tree[0][:3], tree[1][:3], corrupted, nan_policy="raise")
    assert set(info.value.nan_counts) == {"2"}


def test_raise_policy_on_probabilities():
    tp = torch.rand(3, 2, 5).softmax(-1)
    tp[1, 1, 0] = float("nan")
    tp[2, 0, 1] = float("inf")  # Inf is cleaned, not raised
    with pytest.raises(NanLogitsError) as info:
        chain_speculative_sampling(None, torch.zeros(3, 1, dtype=torch.long), tp, nan_policy="raise")
    assert set(info.value.nan_counts) == {"1"}
    tree = _tree_args(b=2)
    q = torch.rand(2, 4, 9)
    q[0, 2, 2] = float("nan")
    q[1, 2, 2] = float("inf")
    with pytest.raises(NanLogitsError) as info:
        tree_verify(*tree, temperature=1.0, draft_probs=q, nan_policy="raise")
    assert set(info.value.nan_counts) == {"0"}


def test_env_policy_is_used(monkeypatch):
    monkeypatch.setenv("SAFESPEC_NAN_POLICY", "raise")
    with pytest.raises(NanLogitsError):
        greedy_verify(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 2, 4), float("nan")))
    # an explicit argument wins over the environment
    greedy_verify(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 2, 4), float("nan")), nan_policy="sanitize")


def test_off_policy_skips_sanitize_but_stays_in_range():
    logits = torch.full((3, 6), float("nan"))
    ids = sample(logits, nan_policy="off")
    assert ((ids >= 0) & (ids < 6)).all()


def test_all_nan_row_sums_to_one():
    probs = logits_to_probs(torch.full((2, 5), float("nan")), temperature=torch.tensor([0.0, 1.0]))
    assert torch.allclose(probs.sum(-1), torch.ones(2))


def test_chain_bad_probabilities_are_repaired_and_reported():
    tp = torch.rand(4, 3, 6).softmax(-1)
    tp[0, 1] = float("nan")
    tp[1, 0] = 0.0
    tp[2, 2, 3] = -1.0
    dp = torch.rand(4, 2, 6).softmax(-1)
    dp[3, 0, 2] = float("inf")
    out, _acc, emitted, bad = chain_speculative_sampling(
        dp, torch.randint(0, 6, (4, 2)), tp, return_nonfinite=True, generator=torch.Generator().manual_seed(0)
    )
    assert bad.tolist() == [True, True, True, True]
    assert (((out >= 0) & (out < 6)) | (out == -1)).all()
    assert ((emitted >= 0) & (emitted <= 2)).all()


# ----------------------------------------------------------------------------- fuzz


def _random_corruption(shape, dtype, g):
    x = torch.randn(shape, generator=g) * 5
    pick = torch.rand(shape, generator=g)
    x = torch.where(pick < 0.05, float("nan"), x)
    x = torch.where((pick >= 0.05) & (pick < 0.08), float("inf"), x)
    x = torch.where((pick >= 0.08) & (pick < 0.11), float("-inf"), x)
    whole = torch.rand(shape[:-1], generator=g) < 0.2  # some rows entirely corrupted
    fill = [float("nan"), float("inf"), float("-inf")][int(torch.randint(0, 3, (1,), generator=g))]
    x = torch.where(whole.unsqueeze(-1), fill, x)
    return x.to(dtype)


def _in_range(ids, vocab, allow_placeholder=False):
    ok = (ids >= 0) & (ids < vocab)
    if allow_placeholder:
        ok = ok | (ids == -1)
    return bool(ok.all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [1, 2, 37])
def test_fuzz_nan_inf_never_gives_out_of_range_ids(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    for trial in range(6):
        b = 1 + trial * 3
        params = dict(
            temperature=torch.rand(b, generator=g) * 2 * (torch.rand(b, generator=g) > 0.3),
            top_k=torch.randint(0, vocab + 2, (b,), generator=g),
            top_p=torch.rand(b, generator=g).clamp(min=0.05),
            min_p=torch.rand(b, generator=g) * 0.5,
        )
        policy = ["sanitize", "off", "abort"][trial % 3]
        logits = _random_corruption((b, vocab), dtype, g)
        assert _in_range(sample(logits, generator=g, nan_policy=policy, **params), vocab)

        k = trial % 3
        out, num = greedy_verify(torch.randint(-2, vocab + 2, (b, k), generator=g), _random_corruption((b, k + 1, vocab), dtype, g), nan_policy=policy)
        assert _in_range(out, vocab, True) and ((num >= 0) & (num <= k)).all()

        tp = _random_corruption((b, k + 1, vocab), dtype, g).float().abs()
        dp = _random_corruption((b, k, vocab), dtype, g).float()
        out, _a, num = chain_speculative_sampling(dp if trial % 2 else None, torch.randint(-2, vocab + 2, (b, k), generator=g), tp, generator=g)
        assert _in_range(out, vocab, True) and ((num >= 0) & (num <= k)).all()

        n = 5
        parents = torch.tensor([[-1, 0, 0, 1, -1]] * b)
        tokens = torch.randint(-2, vocab + 2, (b, n), generator=g)
        q = _random_corruption((b, n, vocab), torch.float32, g).abs() if trial % 2 else None
        res = tree_verify(tokens, parents, _random_corruption((b, n, vocab), dtype, g), draft_probs=q, generator=g, nan_policy=policy, **params)
        assert _in_range(res.output_token_ids, vocab, True)
        assert ((res.num_emitted >= 1) & (res.num_emitted <= 3)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (2, 3, 17), (4, 1031), (2, 5, 4096)])
@pytest.mark.parametrize("zero_rows", ["uniform", "zero"])
def test_clean_probs_is_its_reference_bit_for_bit(dtype, shape, zero_rows):
    """``clean_probs`` (arithmetic and reductions, fast on CPU) against the plain compare-and-select
    reference, over NaN, +-Inf, negatives, -0.0, huge entries, all-zero and all-NaN rows."""
    from samplers.nan import clean_probs_reference
    from samplers import clean_probs

    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    p = torch.rand(shape, generator=g, dtype=torch.float64)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1e-3, 3e38, 1e-45, -1.0])
    p = torch.where(torch.rand(shape, generator=g) < 0.15,
                    specials[torch.randint(0, len(specials), shape, generator=g)], p)
    rows = p.view(-1, shape[-1])
    rows[1::4] = 0.0                # no mass
    rows[2::4] = -0.0               # no mass, negative zeros
    rows[3::5] = float("nan")       # dead
    p = p.to(dtype)
    got, bad = clean_probs(p, zero_rows=zero_rows)
    want, want_bad = clean_probs_reference(p, zero_rows=zero_rows)
    assert got.dtype == torch.float32 and torch.equal(bad, want_bad)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))   # -0.0 and +0.0 told apart
    assert torch.equal(p.isnan(), p.clone().isnan())                      # the input is not modified
    empty, none_bad = clean_probs(torch.empty(*shape[:-1], 0, dtype=dtype), zero_rows=zero_rows)
    assert empty.shape == (*shape[:-1], 0) and none_bad.shape == shape[:-1] and bool(none_bad.all())
