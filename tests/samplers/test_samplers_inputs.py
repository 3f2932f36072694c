"""Input checks, NaN policies, and NaN/Inf fuzzing: ids always in [0, V). Hostile inputs (issues #10, #11,
#51): each bad input gives a named error or the documented result; each such repro failed before its fix."""

from __future__ import annotations

import pytest
import torch

from numerics import NanLogitsError
from samplers import (
    SamplingParams,
    chain_speculative_sampling,
    coupled_sample,
    coupled_scores,
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


# ----------------------------------------------------------------------------- hostile inputs

V = 9
NEG_INF = float("-inf")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _padded(shape, real=5):
    """Logits whose vocabulary is padded with -inf beyond the first ``real`` ids."""
    x = torch.randn(shape, generator=_gen(3))
    x[..., real:] = NEG_INF
    return x


TREE = (torch.tensor([[0, 1, 2, 3]] * 3), torch.tensor([[-1, 0, 0, 1]] * 3))


# ----------------------------------------------------------------------------- one NaN vocabulary

PADDED_CALLS = {
    "sample": lambda p: sample(_padded((64, V)), generator=_gen(), nan_policy=p),
    "logits_to_probs": lambda p: logits_to_probs(_padded((4, V)), nan_policy=p).argmax(-1),
    "greedy_verify": lambda p: greedy_verify(torch.zeros(3, 2, dtype=torch.long), _padded((3, 3, V)), nan_policy=p)[0],
    "tree_verify": lambda p: tree_verify(*TREE, _padded((3, 4, V)), temperature=1.0, generator=_gen(), nan_policy=p).output_token_ids,
    "tree_verify_greedy": lambda p: tree_verify(*TREE, _padded((3, 4, V)), nan_policy=p).output_token_ids,
}


@pytest.mark.parametrize("policy", ["raise", "abort", "guard", "sanitize"])
@pytest.mark.parametrize("call", list(PADDED_CALLS))
def test_inf_padded_vocabulary_never_raises_and_is_never_sampled(call, policy):
    ids = PADDED_CALLS[call](policy)
    assert (((ids >= 0) & (ids < 5)) | (ids == -1)).all()


def test_plus_inf_row_does_not_raise():
    logits = torch.randn(3, V)
    logits[1, 4] = float("inf")
    ids = sample(logits, nan_policy="raise", generator=_gen())
    assert ids[1] == 4  # +inf sanitizes to a peaked distribution


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [1e30, 1e6, torch.tensor([1e30, 1e38, 3e38])])
@pytest.mark.parametrize("policy", ["sanitize", "off"])
def test_huge_temperature_never_revives_masked_tokens(temperature, policy):
    logits = _padded((3, V))
    probs = logits_to_probs(logits, temperature=temperature, nan_policy=policy)
    assert (probs[:, 5:] == 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    ids = sample(logits[:1].expand(3000, V).contiguous(), temperature=1e30, generator=_gen(), nan_policy=policy)
    assert (ids < 5).all()


def test_infinite_temperature_tensor_is_rejected():
    with pytest.raises(ValueError, match=r"temperature.*rows \[1\]"):
        logits_to_probs(_padded((3, V)), temperature=torch.tensor([1e30, float("inf"), 3e38]))


def test_fully_masked_row_stays_uniform():
    probs = logits_to_probs(torch.full((1, 4), NEG_INF), temperature=1e30)
    assert torch.allclose(probs, torch.full((1, 4), 0.25))


def test_temperature_none_means_no_scaling():
    logits = torch.randn(50, V, generator=_gen(1))
    assert torch.equal(logits_to_probs(logits, temperature=None), logits_to_probs(logits, temperature=1.0))
    assert torch.equal(sample(logits, temperature=None, generator=_gen()), sample(logits, temperature=1.0, generator=_gen()))
    res = tree_verify(*TREE, torch.randn(3, 4, V), temperature=None, generator=_gen())
    assert res.output_token_ids.shape == (3, 3)
    per_row = SamplingParams.build(2, temperature=[None, 0.0])
    assert per_row.temperature.tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- strides, empty batches


@pytest.mark.parametrize("policy", ["off", "sanitize"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_verify_transposed_logits(policy, temperature):
    logits = torch.randn(4, 3, V, generator=_gen(2)).transpose(0, 1)  # [3, 4, V], not contiguous
    assert not logits.is_contiguous()
    a = tree_verify(*TREE, logits, temperature=temperature, generator=_gen(), nan_policy=policy)
    b = tree_verify(*TREE, logits.contiguous(), temperature=temperature, generator=_gen(), nan_policy=policy)
    assert torch.equal(a.output_token_ids, b.output_token_ids)


EMPTY_CALLS = {
    "sample": lambda: (sample(torch.randn(0, V), generator=[]), (0,)),
    "logits_to_probs": lambda: (logits_to_probs(torch.randn(0, V)), (0, V)),
    "greedy_verify": lambda: (greedy_verify(torch.zeros(0, 2, dtype=torch.long), torch.randn(0, 3, V))[0], (0, 3)),
    "chain": lambda: (chain_speculative_sampling(torch.rand(0, 2, V), torch.zeros(0, 2, dtype=torch.long), torch.rand(0, 3, V))[0], (0, 3)),
    "tree_greedy": lambda: (tree_verify(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long), torch.randn(0, 4, V)).output_token_ids, (0, 1)),
    "tree_sampled": lambda: (tree_verify(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long), torch.randn(0, 4, V), temperature=1.0, draft_probs=torch.rand(0, 4, V)).output_token_ids, (0, 1)),
    "tree_max_depth": lambda: (tree_verify(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long), torch.randn(0, 4, V), temperature=1.0, max_depth=3).output_token_ids, (0, 4)),
    "without_replacement": lambda: (sample_without_replacement(torch.rand(0, V), 3), (0, 3)),
}


@pytest.mark.parametrize("call", list(EMPTY_CALLS))
def test_empty_batch_gives_empty_outputs(call):
    out, shape = EMPTY_CALLS[call]()
    assert tuple(out.shape) == shape


# ----------------------------------------------------------------------------- guard and dead rows


def _with_dead(shape, dead_rows, partial_rows):
    x = torch.randn(shape, generator=_gen(5))
    for r in dead_rows:
        x[r, ..., :] = float("nan")
    for r in partial_rows:
        x[r, ..., 1] = float("nan")
    return x


@pytest.mark.parametrize("dead", [[0], [3], [6], [0, 6]], ids=["first", "middle", "last", "first_last"])
def test_guard_acts_as_sanitize_and_reports_dead_rows(dead):
    partial = [r for r in (1, 4) if r not in dead]
    b = 7
    expect_dead = [r in dead for r in range(b)]
    expect_bad = [r in dead or r in partial for r in range(b)]
    logits = _with_dead((b, V), dead, partial)
    guard = sample(logits, generator=_gen(), nan_policy="guard", return_nonfinite=True)
    plain = sample(logits, generator=_gen(), nan_policy="sanitize")
    assert torch.equal(guard[0], plain) and ((plain >= 0) & (plain < V)).all()
    assert guard.nonfinite_rows.tolist() == expect_bad and guard.dead_rows.tolist() == expect_dead
    assert logits_to_probs(logits, nan_policy="guard", return_nonfinite=True).dead_rows.tolist() == expect_dead

    logits3 = torch.randn(b, 3, V, generator=_gen(6))
    for r in dead:
        logits3[r, 1] = float("nan")  # one dead position is enough
    for r in partial:
        logits3[r, 2, 0] = float("nan")
    g = greedy_verify(torch.zeros(b, 2, dtype=torch.long), logits3, nan_policy="guard")
    assert g.dead_rows.tolist() == expect_dead and g.nonfinite_rows.tolist() == expect_bad
    probs3 = torch.where(logits3.isnan(), logits3, torch.randn(b, 3, V, generator=_gen(8)).softmax(-1))
    c = chain_speculative_sampling(None, torch.zeros(b, 2, dtype=torch.long), probs3, generator=_gen(), nan_policy="guard")
    assert c.dead_rows.tolist() == expect_dead
    assert (((c[0] >= 0) & (c[0] < V)) | (c[0] == -1)).all()
    parents = torch.tensor([[-1, 0, 1]] * b)
    for t in (0.0, 1.0):
        res = tree_verify(torch.zeros(b, 3, dtype=torch.long), parents, logits3, temperature=t, generator=_gen(), nan_policy="guard")
        ref = tree_verify(torch.zeros(b, 3, dtype=torch.long), parents, logits3, temperature=t, generator=_gen(), nan_policy="sanitize")
        assert torch.equal(res.output_token_ids, ref.output_token_ids)
        assert res.dead_rows.tolist() == expect_dead and res.nonfinite_rows.tolist() == expect_bad
        assert (((res.output_token_ids >= 0) & (res.output_token_ids < V)) | (res.output_token_ids == -1)).all()


def test_off_policy_checks_nothing_and_reports_none():
    logits = _with_dead((3, V), [0], [1])
    # return_nonfinite asks for the masks: they are computed under "off" too (nothing is sanitized)
    asked = sample(logits, generator=_gen(), nan_policy="off", return_nonfinite=True)
    assert asked.dead_rows.tolist() == [True, False, False]
    g = greedy_verify(torch.zeros(3, 1, dtype=torch.long), logits[:, None].expand(3, 2, V).contiguous(), nan_policy="off")
    assert g.nonfinite_rows is None and g.dead_rows is None
    c = chain_speculative_sampling(None, torch.zeros(3, 1, dtype=torch.long), torch.rand(3, 2, V), nan_policy="off")
    assert c.nonfinite_rows is None and c.dead_rows is None
    t = tree_verify(*TREE, torch.randn(3, 4, V), temperature=1.0, draft_probs=torch.rand(3, 4, V), nan_policy="off")
    assert t.nonfinite_rows is None and t.dead_rows is None


# ---------------------------------------------------------------- temperatures 0 in float32, huge numbers, meta

LOGITS = torch.tensor([[0.0, 5.0, 1.0]])   # argmax 1; id 0 is what a NaN row used to give
SEEDS, POSITIONS = torch.tensor([7]), torch.tensor([3])
TINY = 1e-46   # > 0 in Python, 0 in float32

# the same temperature as a scalar, a list and a tensor of each float dtype that can hold it
TINY_FORMS = {"scalar": TINY, "list": [TINY], "tensor_f64": torch.tensor([TINY], dtype=torch.float64),
              "tensor_0d_f64": torch.tensor(TINY, dtype=torch.float64)}


SAMPLERS = {
    "sample": lambda t: sample(LOGITS, temperature=t, generator=_gen()),
    "coupled_sample": lambda t: coupled_sample(LOGITS, SEEDS, POSITIONS, temperature=t),
    "coupled_scores": lambda t: coupled_scores(LOGITS, SEEDS, POSITIONS, temperature=t).argmax(-1),
    "logits_to_probs": lambda t: logits_to_probs(LOGITS, temperature=t).argmax(-1),
}


@pytest.mark.parametrize("form", list(TINY_FORMS))
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_a_temperature_that_is_0_in_float32_is_greedy(sampler, form):
    """``sample(..., temperature=1e-46)`` returned id 0 (the scaled logits were 0/0 = NaN); now greedy, as a 0."""
    assert SAMPLERS[sampler](TINY_FORMS[form]).tolist() == [1]


def test_a_vanishing_temperature_gives_the_greedy_one_hot_and_host_facts():
    assert logits_to_probs(LOGITS, temperature=TINY).tolist() == [[0.0, 1.0, 0.0]]
    params = SamplingParams.build(2, [TINY, 0.0])
    assert params.all_greedy and not params.all_sampled and params.temperature.tolist() == [0.0, 0.0]
    mixed = SamplingParams.build(2, [TINY, 1.0])
    assert not mixed.all_greedy and not mixed.all_sampled


def test_tree_verify_takes_a_vanishing_temperature_as_greedy():
    tokens, parents = torch.tensor([[0, 1, 2]]), torch.tensor([[-1, 0, 1]])
    logits = torch.randn(1, 3, 5, generator=_gen())
    greedy = tree_verify(tokens, parents, logits, temperature=0.0)
    tiny = tree_verify(tokens, parents, logits, temperature=TINY, generator=_gen())
    assert torch.equal(greedy.output_token_ids, tiny.output_token_ids)


@pytest.mark.parametrize("temperature", [1e39, [1.0, 1e39], 10**400], ids=["1e39", "list_1e39", "10**400"])
def test_a_temperature_past_float32_is_rejected_naming_it(temperature):
    """Past float32's range a temperature is inf there, as a tensor already was; 10**400 raised OverflowError."""
    with pytest.raises(ValueError, match=r"temperature(\[1\])? must be a finite number >= 0 in float32"):
        sample(torch.zeros(2, 3), temperature=temperature)


@pytest.mark.parametrize("top_k, name", [(2**63, "top_k"), (1e300, "top_k"), ([1, 2**64], r"top_k\[1\]"),
                                         (float("inf"), "top_k"), (10**5000, "top_k")],
                         ids=["2**63", "1e300", "list_2**64", "inf", "10**5000"])
def test_a_top_k_too_large_for_int64_is_rejected_naming_it(top_k, name):
    """These raised "Overflow when unpacking long long", naming nothing."""
    with pytest.raises(ValueError, match=name + r" must be an int in \[0, 2\*\*63\)"):
        sample(torch.zeros(2, 3), top_k=top_k)


def test_the_largest_int64_top_k_still_disables_nothing_it_should_not():
    assert sample(LOGITS, top_k=2**63 - 1, temperature=0.0).tolist() == [1]


META_CALLS = {
    "coupled_sample": lambda m: coupled_sample(m, SEEDS.to("meta"), POSITIONS.to("meta")),
    "coupled_scores": lambda m: coupled_scores(m, SEEDS.to("meta"), POSITIONS.to("meta")),
    "sample": lambda m: sample(m),
    "logits_to_probs": lambda m: logits_to_probs(m),
}


@pytest.mark.parametrize("call", list(META_CALLS))
def test_meta_tensors_are_rejected_naming_the_argument(call):
    """``coupled_sample`` on meta tensors raised "Tensor.item() cannot be called on meta tensors"."""
    with pytest.raises(ValueError, match="logits is a meta tensor"):
        META_CALLS[call](LOGITS.to("meta"))
