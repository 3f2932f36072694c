"""Exact cases: greedy chains and trees, processed probabilities, seeded determinism."""

from __future__ import annotations

import warnings

import pytest
import torch

from samplers import (
    PLACEHOLDER_TOKEN_ID,
    SamplingParams,
    TreeVerifyResult,
    chain_speculative_sampling,
    greedy_accept,
    greedy_tree_verify,
    greedy_verify,
    logits_to_probs,
    sample,
    tree_verify,
)

V = 8


def _logits_for(argmaxes, vocab=V):
    """Target logits [B, T, V] whose argmax at [b, t] is argmaxes[b][t]."""
    ids = torch.tensor(argmaxes)
    logits = torch.randn(*ids.shape, vocab, generator=torch.Generator().manual_seed(0))
    return logits.scatter(-1, ids.unsqueeze(-1), 10.0)


# ----------------------------------------------------------------------------- greedy_verify


@pytest.mark.parametrize(
    "draft, argmax, expected, emitted",
    [
        ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]], [3]),  # perfect match + bonus
        ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]], [1]),  # early mismatch
        ([[1, 2, 3]], [[0, 2, 3, 4]], [[0, -1, -1, -1]], [0]),  # first token wrong
        ([[1], [2]], [[1, 7], [3, 7]], [[1, 7], [3, -1]], [1, 0]),  # K = 1, two sequences
        ([[], []], [[6], [2]], [[6], [2]], [0, 0]),  # K = 0: just the target's token
        (  # several sequences, different stopping points
            [[1, 2, 3], [4, 4, 4], [7, 6, 5]],
            [[1, 2, 0, 0], [4, 4, 4, 1], [0, 6, 5, 1]],
            [[1, 2, 0, -1], [4, 4, 4, 1], [0, -1, -1, -1]],
            [2, 3, 0],
        ),
    ],
)
def test_greedy_verify_exact(draft, argmax, expected, emitted):
    draft_ids = torch.tensor(draft, dtype=torch.long).view(len(argmax), -1)
    out, num = greedy_verify(draft_ids, _logits_for(argmax))
    assert out.dtype == torch.int32 and num.dtype == torch.int32
    assert out.tolist() == expected
    assert num.tolist() == emitted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, k", [(1, 0), (1, 5), (3, 1), (5, 4)])
def test_greedy_accept_is_greedy_verify_without_the_padding(dtype, batch, k):
    """Its argmax prefix and count are greedy_verify's (which pads with -1), drafts out of range included."""
    g = torch.Generator().manual_seed(batch * 10 + k)
    logits = torch.randn(batch, k + 1, V, generator=g).to(dtype)
    best32 = logits.float().argmax(-1)
    # drafts that match a random prefix of the argmax, then differ (sometimes out of range)
    draft = best32[:, :k].clone()
    for b in range(batch):
        cut = int(torch.randint(0, k + 1, (1,), generator=g))
        if cut < k:
            draft[b, cut] = (draft[b, cut] + 1) % V if b % 2 else V + 3
    best, num = greedy_accept(draft, logits)
    out, num_v = greedy_verify(draft, logits)
    assert best.dtype == num.dtype == torch.int64 and best.shape == (batch, k + 1)
    assert torch.equal(best, best32) and num.tolist() == num_v.tolist()
    for b in range(batch):
        n = int(num[b]) + 1
        assert best[b, :n].tolist() == out[b, :n].tolist() and (out[b, n:] == PLACEHOLDER_TOKEN_ID).all()


def test_greedy_verify_out_of_range_draft_is_rejected():
    draft = torch.tensor([[1, -3], [V + 5, 2]])
    out, num = greedy_verify(draft, _logits_for([[1, 0, 4], [2, 2, 4]]))
    assert out.tolist() == [[1, 0, -1], [2, -1, -1]]
    assert num.tolist() == [1, 0]


def test_greedy_verify_does_not_mutate_and_reports_nan_rows():
    logits = _logits_for([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    logits[0, 1, 4] = float("nan")
    logits[2, 2] = float("inf")
    before = logits.clone()
    out, num, bad = greedy_verify(torch.tensor([[1, 2]] * 3), logits, return_nonfinite=True)
    assert torch.equal(before.isnan(), logits.isnan()) and torch.equal(before.nan_to_num(), logits.nan_to_num())
    assert bad.tolist() == [True, False, True]
    assert ((out >= 0) & (out < V) | (out == PLACEHOLDER_TOKEN_ID)).all()


# ----------------------------------------------------------------------------- tree, greedy


def _tree_logits(argmax_per_node):
    return _logits_for(argmax_per_node)


def test_tree_greedy_second_sibling_matches():
    # root -> 1 (tok 3), 2 (tok 5); 2 -> 3 (tok 6). Target: root says 5, node 2 says 6, node 3 says 1.
    tokens = torch.tensor([[0, 3, 5, 6]])
    parents = torch.tensor([[-1, 0, 0, 2]])
    res = tree_verify(tokens, parents, _tree_logits([[5, 0, 6, 1]]))
    assert res.accepted_node_ids.tolist() == [[2, 3]]
    assert res.output_token_ids.tolist() == [[5, 6, 1]]
    assert res.num_emitted.tolist() == [3]
    assert res.nonfinite_rows.tolist() == [False]


def test_tree_greedy_duplicate_siblings_take_the_first():
    tokens = torch.tensor([[0, 4, 4]])
    parents = torch.tensor([[-1, 0, 0]])
    res = tree_verify(tokens, parents, _tree_logits([[4, 2, 3]]))
    assert res.accepted_node_ids.tolist() == [[1]]
    assert res.output_token_ids.tolist() == [[4, 2]]


def test_tree_greedy_padded_batch():
    # row 0: chain of 3 real nodes; row 1: root + one child, rest padding (parent -1);
    # row 2: root only, its children never match.
    tokens = torch.tensor([[0, 1, 2, 3], [0, 7, 7, 7], [0, 5, 6, 7]])
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, -1, -1], [-1, 0, 0, 0]])
    argmax = [[1, 2, 3, 4], [7, 1, 0, 0], [2, 0, 0, 0]]
    res = tree_verify(tokens, parents, _tree_logits(argmax))
    assert res.accepted_node_ids.tolist() == [[1, 2, 3], [1, -1, -1], [-1, -1, -1]]
    assert res.output_token_ids.tolist() == [[1, 2, 3, 4], [7, 1, -1, -1], [2, -1, -1, -1]]
    assert res.num_emitted.tolist() == [4, 2, 1]


def test_tree_padding_nodes_are_never_followed():
    # node 2 is padding (parent -1) even though its token matches; node 3's parent is padding.
    tokens = torch.tensor([[0, 1, 4, 5]])
    parents = torch.tensor([[-1, 0, -1, 2]])
    res = tree_verify(tokens, parents, _tree_logits([[4, 0, 5, 0]]), max_depth=2)
    assert res.output_token_ids.tolist() == [[4, -1, -1]]
    assert res.accepted_node_ids.tolist() == [[-1, -1]]


def test_tree_max_depth_width_and_cut():
    tokens = torch.tensor([[0, 1, 2, 3]])
    parents = torch.tensor([[-1, 0, 1, 2]])
    logits = _tree_logits([[1, 2, 3, 4]])
    assert tree_verify(tokens, parents, logits).output_token_ids.shape == (1, 4)
    cut = tree_verify(tokens, parents, logits, max_depth=1)
    assert cut.output_token_ids.tolist() == [[1, 2]]  # the bonus comes from node 1's logits
    assert cut.accepted_node_ids.tolist() == [[1]]


def test_tree_root_only():
    res = tree_verify(torch.tensor([[0]]), torch.tensor([[-1]]), _tree_logits([[6]]))
    assert res.output_token_ids.tolist() == [[6]]
    assert res.accepted_node_ids.shape == (1, 0)


@pytest.mark.parametrize("max_depth", [None, 0, 2])
def test_tree_greedy_fast_path_equals_the_level_walk(max_depth):
    """All rows greedy on the host: per-node tests instead of the level walk. It must give the walk's
    result on any tree: random parents (padding, forward references, orphans), duplicate sibling
    tokens, out-of-range tokens, a depth bound. A temperature tensor hides greediness from the host,
    so the same call walks the levels (greedy rows follow the argmax there too)."""
    g = torch.Generator().manual_seed(7 + (max_depth or 0))
    B, N, vocab = 256, 9, 3   # a small vocabulary: many matches and duplicate siblings
    well_formed = torch.arange(N) - 1 - (torch.rand(B, N, generator=g) * torch.arange(N)).long()  # in [-1, i)
    parents = torch.where(torch.rand(B, N, generator=g) < 0.9, well_formed, torch.randint(-1, N, (B, N), generator=g))
    parents[:, 0] = -1
    tokens = torch.randint(0, vocab + 1, (B, N), generator=g)                 # vocab itself is out of range
    logits = torch.randn(B, N, vocab, generator=g)
    fast = tree_verify(tokens, parents, logits, temperature=0.0, max_depth=max_depth)
    walked = tree_verify(tokens, parents, logits, temperature=torch.zeros(B), max_depth=max_depth)
    assert fast.accepted_node_ids.tolist() == walked.accepted_node_ids.tolist()
    assert fast.output_token_ids.tolist() == walked.output_token_ids.tolist()
    assert fast.num_emitted.tolist() == walked.num_emitted.tolist()
    if max_depth != 0:   # the trees do accept: the comparison is not vacuous
        assert fast.num_emitted.float().mean() > 1.5



def _random_trees(g, B, N):
    """Random parents with padding, forward references and orphans (as the walk test above)."""
    well_formed = torch.arange(N) - 1 - (torch.rand(B, N, generator=g) * torch.arange(N)).long()  # in [-1, i)
    parents = torch.where(torch.rand(B, N, generator=g) < 0.9, well_formed, torch.randint(-1, N, (B, N), generator=g))
    parents[:, 0] = -1
    return parents


def _reference_ancestors(parents):
    """Self-or-ancestor mask by walking each node up on the host: a node that reaches the root sees its
    ancestors; padding (a parent not in [0, i), or below such a node) sees only itself."""
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
    for b in range(B):
        for i in range(1, N):
            chain, j = [], i
            while j > 0 and 0 <= parents[b, j] < j:
                j = int(parents[b, j])
                chain.append(j)
            if j == 0:
                mask[b, i, chain] = True
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_depth", [None, 0, 2, 8])
@pytest.mark.parametrize("with_mask", [False, True])
def test_greedy_tree_verify_equals_the_level_walk(dtype, max_depth, with_mask):
    """``greedy_tree_verify`` gives the walk's result bit for bit, with or without the ancestor mask, on
    random trees (padding, orphans, duplicate sibling tokens, out-of-range tokens), in every logits dtype,
    with NaN and Inf in the logits (nonfinite and dead rows reported the same)."""
    g = torch.Generator().manual_seed(11 + (max_depth or 0))
    B, N, vocab = 256, 9, 3   # a small vocabulary: many matches and duplicate siblings
    parents = _random_trees(g, B, N)
    tokens = torch.randint(0, vocab + 1, (B, N), generator=g)                 # vocab itself is out of range
    logits = torch.randn(B, N, vocab, generator=g)
    logits[torch.rand(B, N, vocab, generator=g) < 0.03] = float("nan")
    logits[torch.rand(B, N, vocab, generator=g) < 0.03] = float("inf")
    logits[:3, 2] = float("nan")                                            # dead rows
    logits = logits.to(dtype)
    mask = _reference_ancestors(parents) if with_mask else None
    walked = tree_verify(tokens, parents, logits, temperature=torch.zeros(B), max_depth=max_depth,
                         nan_policy="sanitize")
    got = greedy_tree_verify(tokens, parents, logits, ancestor_mask=mask, max_depth=max_depth,
                             nan_policy="sanitize")
    for field in ("accepted_node_ids", "output_token_ids", "num_emitted", "nonfinite_rows", "dead_rows"):
        assert torch.equal(getattr(got, field), getattr(walked, field)), field
    if max_depth != 0:   # the trees do accept: the comparison is not vacuous
        assert got.num_emitted.float().mean() > 1.5


def test_greedy_tree_verify_needs_every_ancestor_to_pass():
    """Node 2 matches the argmax at its parent 1, but 1 does not match at the root: nothing is accepted.
    A verifier that read only each node's own test (no ancestors) would accept node 2."""
    tokens, parents = torch.tensor([[0, 4, 6]]), torch.tensor([[-1, 0, 1]])
    logits = _tree_logits([[3, 6, 1]])
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=torch.bool)
    for m in (None, mask):
        res = greedy_tree_verify(tokens, parents, logits, ancestor_mask=m, max_depth=2)
        assert res.output_token_ids.tolist() == [[3, -1, -1]] and res.num_emitted.tolist() == [1]


def test_greedy_tree_verify_refuses_a_bad_ancestor_mask_by_name():
    tokens, parents = torch.tensor([[0, 4, 6]]), torch.tensor([[-1, 0, 1]])
    logits = _tree_logits([[3, 6, 1]])
    good = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=torch.bool)
    with pytest.raises(ValueError, match="ancestor_mask must be a bool"):
        greedy_tree_verify(tokens, parents, logits, ancestor_mask=good.long())
    with pytest.raises(ValueError, match="ancestor_mask"):
        greedy_tree_verify(tokens, parents, logits, ancestor_mask=good[:, :2])
    assert greedy_tree_verify(tokens, parents, logits, ancestor_mask=good, check_inputs=True).num_emitted.tolist() == [1]
    wrong = good.clone()
    wrong[0, 2, 1] = False   # node 2 would not see its parent
    with pytest.raises(ValueError, match="ancestor_mask does not match tree_parents"):
        greedy_tree_verify(tokens, parents, logits, ancestor_mask=wrong, check_inputs=True)


def test_tree_greedy_with_draft_probs_ignores_q():
    tokens = torch.tensor([[0, 3, 5]])
    parents = torch.tensor([[-1, 0, 0]])
    q = torch.zeros(1, 3, V)  # a broken drafter must not stop a greedy match
    res = tree_verify(tokens, parents, _tree_logits([[5, 0, 2]]), draft_probs=q)
    assert res.output_token_ids.tolist() == [[5, 2]]
    assert res.nonfinite_rows.tolist() == [True]


def test_tree_mixed_greedy_and_sampled_rows():
    tokens = torch.tensor([[0, 3, 5]] * 2)
    parents = torch.tensor([[-1, 0, 0]] * 2)
    logits = _tree_logits([[5, 0, 2], [5, 0, 2]])
    res = tree_verify(tokens, parents, logits, temperature=torch.tensor([0.0, 1.0]), generator=torch.Generator().manual_seed(0))
    assert res.output_token_ids[0].tolist() == [5, 2]


def test_tree_out_of_range_child_token_is_never_accepted():
    tokens = torch.tensor([[0, -1, V + 2, 2]])
    parents = torch.tensor([[-1, 0, 0, 0]])
    res = tree_verify(tokens, parents, _tree_logits([[2, 0, 0, 6]]))
    assert res.output_token_ids.tolist() == [[2, 6]]


# ----------------------------------------------------------------------------- probs


def test_logits_to_probs_greedy_and_topk():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    probs = logits_to_probs(logits, temperature=torch.tensor([0.0, 1.0]), top_k=2)
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    # ties at the top-k boundary are kept together
    assert torch.allclose(probs[1], torch.full((4,), 0.25))
    assert probs.dtype == torch.float32


def test_logits_to_probs_top_p_keeps_boundary_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, top_p=0.6)  # 0.5 < 0.6 -> keep the 0.3 token too
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(logits_to_probs(logits, top_p=1.0), logits.softmax(-1))
    min_p = logits_to_probs(logits, min_p=0.5)  # keep p >= 0.25
    assert torch.allclose(min_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_sample_greedy_rows_are_argmax():
    logits = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_are_one_hot_on_the_first_argmax(dtype):
    """Ties, +-Inf and (policy off) NaN: a greedy row is one-hot on torch.argmax's id, the first maximum
    (or the first NaN), whatever its batch-mates' temperatures."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.round(torch.randn(37, generator=g) * 2) / 2 for _ in range(4)]   # many ties
    rows[1][[5, 20]] = float("inf")
    rows[2][[3, 9]] = float("nan")
    rows[3][:] = -float("inf")
    logits = torch.stack(rows).to(dtype)
    probs = logits_to_probs(logits, temperature=torch.tensor([0.0, 0.0, 0.0, 0.0]), nan_policy="off")
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.float().argmax(-1), 37).float())
    mixed = logits_to_probs(logits[:1].expand(2, -1), temperature=torch.tensor([0.0, 1.0]), nan_policy="off")
    assert torch.equal(mixed[0], probs[0])


def test_all_sampled_is_a_host_fact_that_keeps_the_bits():
    """``SamplingParams.all_sampled``: known on the host only for scalars and lists with every
    temperature > 0; with it ``process_logits`` skips the greedy one-hot and returns the same bits."""
    from samplers import SamplingParams
    from samplers.probs import process_logits

    build = SamplingParams.build
    assert build(3, 0.7).all_sampled and build(2, [1.0, None]).all_sampled   # None means 1.0
    assert not build(2, [1.0, 0.0]).all_sampled and not build(2, torch.tensor([1.0, 1.0])).all_sampled
    assert build(4, [0.5, 2.0, 1.0, 3.0]).select([1, 3]).all_sampled and build(2, 1.0).repeat(3).all_sampled
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 50, generator=g) * 4
    x[0, :10] = -1e30   # masked tokens stay at 0 at every temperature
    x[1] = -1e30        # a wholly masked row is uniform
    temps = [1e30, 0.5, 1e-6, 1e6, 2.0, 1.0]   # 1e30 maps the masked -1e30 to about -1
    for extra in ({}, {"top_k": 7}, {"top_p": 0.6}, {"min_p": 0.1}, {"top_k": 5, "top_p": 0.9}):
        fast = build(6, temps, device="cpu", **extra)
        slow = build(6, torch.tensor(temps), device="cpu", **extra)
        assert fast.all_sampled and not slow.all_sampled
        assert torch.equal(process_logits(x, fast), process_logits(x, slow)), extra


def test_sample_takes_prebuilt_params_with_the_same_draws():
    """``sample(params=...)`` draws what the same parameters passed one by one draw (and
    ``logits_to_probs(params=...)`` gives the same probabilities), and refuses
    a mix of both, the wrong row count or a non-SamplingParams, naming the argument."""
    from samplers import SamplingParams

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    for temps in ([1.0, 0.7, 2.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.5]):
        params = SamplingParams.build(3, temps, top_k=9)
        gens = lambda: [torch.Generator().manual_seed(s) for s in (4, 5, 6)]   # noqa: E731
        want = sample(logits, temperature=temps, top_k=9, generator=gens())
        assert torch.equal(sample(logits, params=params, generator=gens()), want), temps
        assert torch.equal(logits_to_probs(logits, params=params), logits_to_probs(logits, temperature=temps, top_k=9))
    params = SamplingParams.build(3, 1.0)
    with pytest.raises(ValueError, match="either params or"):
        logits_to_probs(logits, params=params, temperature=0.5)
    with pytest.raises(ValueError, match="either params or"):
        sample(logits, params=params, top_k=5)
    with pytest.raises(ValueError, match="params has 2 rows"):
        sample(logits, params=SamplingParams.build(2, 1.0))
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        sample(logits, params={"temperature": 1.0})


def test_tiny_temperature_stays_finite():
    logits = torch.tensor([[1e30, -1e30, 0.0, 1.0]])
    probs = logits_to_probs(logits, temperature=1e-20)
    assert torch.isfinite(probs).all() and probs[0, 0] == 1.0


# ----------------------------------------------------------------------------- determinism


def _run_all(seed):
    g = torch.Generator().manual_seed(seed)
    data = torch.Generator().manual_seed(123)
    logits = torch.randn(16, 11, generator=data)
    tp = torch.randn(16, 4, 11, generator=data).softmax(-1)
    dp = torch.randn(16, 3, 11, generator=data).softmax(-1)
    ids = torch.randint(0, 11, (16, 3), generator=data)
    tree_logits = torch.randn(16, 5, 11, generator=data)
    tokens = torch.randint(0, 11, (16, 5), generator=data)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 16)
    return (
        sample(logits, top_k=5, generator=g),
        *chain_speculative_sampling(dp, ids, tp, generator=g),
        tree_verify(tokens, parents, tree_logits, temperature=0.8, generator=g).output_token_ids,
        tree_verify(tokens, parents, tree_logits, temperature=0.8, draft_probs=tp[:, :1].expand(16, 5, 11), generator=g).output_token_ids,
    )


def test_seeded_determinism():
    first, again, other = _run_all(7), _run_all(7), _run_all(8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_chain_deterministic_draft_accepts_certain_token():
    # p puts all mass on the drafted tokens: always accepted, bonus from the last row.
    tp = torch.zeros(2, 3, V)
    tp[:, 0, 4] = 1
    tp[:, 1, 2] = 1
    tp[:, 2, 7] = 1
    out, accepted, emitted = chain_speculative_sampling(None, torch.tensor([[4, 2], [4, 3]]), tp)
    assert out.tolist() == [[4, 2, 7], [4, 2, -1]]
    assert emitted.tolist() == [2, 1] and accepted.tolist() == [2, 1]


# ----------------------------------------------------------------------------- one meaning of "emitted"

RESULT_V = 9   # these result tests' vocabulary, odd beside V


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_emitted_means_accepted_plus_one_everywhere():
    logits = torch.randn(2, 3, RESULT_V, generator=_gen(4))
    best = logits.argmax(-1)
    draft = torch.stack([best[0, :2], torch.tensor([(best[1, 0] + 1) % RESULT_V, 0])])
    g = greedy_verify(draft, logits)
    assert g.num_accepted.tolist() == [2, 0] and g.num_emitted.tolist() == [3, 1]
    c = chain_speculative_sampling(None, draft, logits.softmax(-1), generator=_gen())
    assert torch.equal(c.num_emitted, c.num_accepted + 1)
    t = tree_verify(torch.tensor([[0, 3, 4]]), torch.tensor([[-1, 0, 1]]), torch.randn(1, 3, RESULT_V))
    assert torch.equal(t.num_accepted, t.num_emitted - 1)


def test_old_names_still_work_with_a_deprecation_warning():
    draft = torch.zeros(2, 2, dtype=torch.long)
    g = greedy_verify(draft, torch.randn(2, 3, RESULT_V))
    out, num = g  # positional unpacking is unchanged
    with pytest.warns(DeprecationWarning, match="num_accepted"):
        assert g.emitted_num is g.num_accepted
    c = chain_speculative_sampling(None, draft, torch.rand(2, 3, RESULT_V), generator=_gen())
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
    logits = torch.randn(3, RESULT_V, generator=_gen(7))
    assert torch.equal(sample(logits, generator=_gen(), **params.kwargs()),
                       sample(logits, generator=_gen(), temperature=[0.0, 0.7, None], top_k=[None, 5, 0], top_p=0.9))
    tensors = SamplingParams.build(2, temperature=torch.tensor([0.0, 0.0]))
    assert not tensors.all_greedy  # unknown on the host without a sync: conservative
