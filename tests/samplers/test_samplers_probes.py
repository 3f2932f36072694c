"""Hostile-input probes (issue #10/#11): each bad input gives a named error (see
test_samplers_inputs) or the documented result checked here."""

from __future__ import annotations

import warnings

import pytest
import torch

from samplers import (
    SamplingParams,
    TreeVerifyResult,
    chain_speculative_sampling,
    greedy_verify,
    logits_to_probs,
    sample,
    sample_without_replacement,
    tree_verify,
)

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


# ----------------------------------------------------------------------------- one meaning of "emitted"


def test_emitted_means_accepted_plus_one_everywhere():
    logits = torch.randn(2, 3, V, generator=_gen(4))
    best = logits.argmax(-1)
    draft = torch.stack([best[0, :2], torch.tensor([(best[1, 0] + 1) % V, 0])])
    g = greedy_verify(draft, logits)
    assert g.num_accepted.tolist() == [2, 0] and g.num_emitted.tolist() == [3, 1]
    c = chain_speculative_sampling(None, draft, logits.softmax(-1), generator=_gen())
    assert torch.equal(c.num_emitted, c.num_accepted + 1)
    t = tree_verify(torch.tensor([[0, 3, 4]]), torch.tensor([[-1, 0, 1]]), torch.randn(1, 3, V))
    assert torch.equal(t.num_accepted, t.num_emitted - 1)


def test_old_names_still_work_with_a_deprecation_warning():
    draft = torch.zeros(2, 2, dtype=torch.long)
    g = greedy_verify(draft, torch.randn(2, 3, V))
    out, num = g  # positional unpacking is unchanged
    with pytest.warns(DeprecationWarning, match="num_accepted"):
        assert g.emitted_num is g.num_accepted
    c = chain_speculative_sampling(None, draft, torch.rand(2, 3, V), generator=_gen())
    out, passed, accepted = c
    with pytest.warns(DeprecationWarning, match="num_passed"):
        assert c.accepted_num is passed
    with pytest.warns(DeprecationWarning, match="num_accepted"):
        assert c.emitted_num is accepted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.num_passed is passed  # the new names do not warn
    with pytest.raises(AttributeError):
        c.nonsense  # noqa: B018


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


def test_tree_verify_result_positional_construction_still_works():
    z = torch.zeros(1, dtype=torch.int32)
    res = TreeVerifyResult(z, z, z + 1, z.bool())
    assert res.dead_rows is None and res.num_accepted.tolist() == [0]


# ----------------------------------------------------------------------------- SamplingParams


def test_sampling_params_build_select_kwargs():
    params = SamplingParams.build(3, temperature=[0.0, 0.7, None], top_k=[None, 5, 0], top_p=0.9)
    assert params.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert params.top_k.tolist() == [0, 5, 0] and params.min_p is None
    assert not params.all_greedy
    sub = params.select([2, 0])
    assert sub.temperature.tolist() == [1.0, 0.0] and sub.top_k.tolist() == [0, 0]
    greedy = SamplingParams.build(2, temperature=0.0, top_p=None)
    assert greedy.all_greedy and greedy.top_p is None and greedy.kwargs()["temperature"] == 0.0
    logits = torch.randn(3, V, generator=_gen(7))
    assert torch.equal(sample(logits, generator=_gen(), **params.kwargs()),
                       sample(logits, generator=_gen(), temperature=[0.0, 0.7, None], top_k=[None, 5, 0], top_p=0.9))
    tensors = SamplingParams.build(2, temperature=torch.tensor([0.0, 0.0]))
    assert not tensors.all_greedy  # unknown on the host without a sync: conservative


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
