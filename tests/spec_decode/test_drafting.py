"""Tree plumbing: ancestor masks and the EAGLE-2 selection, against plain-Python references."""
from __future__ import annotations

import random

import pytest
import torch

from spec_decode.drafting import TreeRoot, TreeShape, ancestor_mask


def _naive_ancestors(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    out = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            out[i][j] = True
            j = parents[j]
    return out


def _random_forest(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(0, i) for i in range(1, n)]


@pytest.mark.parametrize("n", [1, 2, 5, 9, 17])
def test_ancestor_mask_matches_a_naive_walk(n):
    rng = random.Random(n)
    forests = [_random_forest(n, rng) for _ in range(6)] + [list(range(-1, n - 1))]   # + a chain
    got = ancestor_mask(torch.tensor(forests), max(n - 1, 0))   # n - 1 bounds every depth
    assert got.tolist() == [_naive_ancestors(f) for f in forests]


def test_ancestor_mask_of_a_deep_chain_sees_every_ancestor():
    """Depth 6: a doubling hop (hop = hop[hop], an earlier bug) skipped the ancestors 3 and 5 steps up."""
    parents = torch.arange(-1, 6)[None]
    mask = ancestor_mask(parents, 6)
    assert torch.equal(mask[0], torch.tril(torch.ones(7, 7, dtype=torch.bool)))


def test_ancestor_mask_with_padding_nodes():
    parents = torch.tensor([[-1, 0, -1, 1, -1]])          # nodes 2 and 4 are padding
    mask = ancestor_mask(parents, 2)[0]
    assert mask[3].tolist() == [True, True, False, True, False]
    assert mask[2].tolist() == [False, False, True, False, False]


# ------------------------------------------------------------------ incremental drafting vs a full recompute
def _reference_draft_tree(drafter, cache, root, first_logits, first_hidden, num_steps, topk, num_draft_tokens):
    """The straightforward EAGLE-2 expansion: every depth re-runs ALL spec rows with a fresh ancestor mask."""
    from spec_decode.drafting import _Pool, _greedy_children, _select_tree

    B, k = root.shape[0], topk
    lp, ids = _greedy_children(first_logits, k)
    pool = _Pool(B, k + (num_steps - 1) * k * k, root.device)
    no = torch.zeros_like(ids, dtype=torch.bool)
    pool.add(lp, drafter.to_target_ids(ids), torch.full_like(ids, -1), no, 1)
    frontier_pool, frontier_score = torch.arange(k).expand(B, k), lp
    frontier_tokens = pool.tokens[0]
    frontier_hidden = None if first_hidden is None else first_hidden[:, None].expand(B, k, -1)
    spec_tokens, spec_hidden, spec_parent = [], [], []
    for step in range(1, num_steps):
        parent_rows = torch.full((B, k), -1) if step == 1 else frontier_parent_row
        spec_tokens.append(frontier_tokens)
        spec_parent.append(parent_rows)
        if frontier_hidden is not None:
            spec_hidden.append(frontier_hidden)
        tokens, parents = torch.cat(spec_tokens, 1), torch.cat(spec_parent, 1)
        R = tokens.shape[1]
        offset = torch.arange(step).repeat_interleave(k).expand(B, R)
        hidden, feedback = drafter.draft_forward(tokens, torch.cat(spec_hidden, 1) if spec_hidden else None, cache,
                                                 position_ids=cache.lengths[:, None] + offset,
                                                 tree_mask=ancestor_mask(parents, step))
        base = (step - 1) * k
        lp, ids = _greedy_children(drafter.compute_logits(hidden[:, base:base + k]), k)
        cand_score = (frontier_score[:, :, None] + lp).reshape(B, k * k)
        pool_base = pool.add(cand_score, drafter.to_target_ids(ids).reshape(B, k * k),
                             frontier_pool[:, :, None].expand(B, k, k).reshape(B, k * k),
                             torch.zeros(B, k * k, dtype=torch.bool), step + 1)
        if step + 1 < num_steps:
            frontier_score, pick = torch.topk(cand_score, k, dim=-1)
            frontier_pool = pool_base + pick
            frontier_tokens = pool.tokens[-1].gather(1, pick)
            frontier_parent_row = base + torch.div(pick, k, rounding_mode="floor")
            if feedback is not None:
                frontier_hidden = feedback.gather(1, frontier_parent_row[:, :, None].expand(B, k, feedback.shape[-1]))
    return _select_tree(root, pool, num_draft_tokens, num_steps, None, None, drafter, topk)


def _target_and_drafter(tmp_path, kind: str):
    """A tiny fp32 target and a drafter of ``kind`` (eagle, eagle3 or draft_model) for it."""
    from spec_decode.models import Transformer
    from tiny_models import make_tiny_eagle, make_tiny_eagle3, make_tiny_target

    target = Transformer.from_pretrained(make_tiny_target(tmp_path, seed=0), dtype=torch.float32)
    drafter = {"eagle": lambda: make_tiny_eagle(target, seed=1),
               "eagle3": lambda: make_tiny_eagle3(target, draft_vocab_size=61),
               "draft_model": lambda: Transformer.from_pretrained(
                   make_tiny_target(tmp_path, seed=5, name="d", num_hidden_layers=1), dtype=torch.float32)}[kind]()
    return target, drafter


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
@pytest.mark.parametrize("shape", [(5, 4, 8), (4, 3, 20), (4, 1, 5)], ids=["5-4-8", "4-3-20", "chain4"])
def test_incremental_drafting_builds_the_same_trees_as_a_full_recompute(tmp_path, kind, shape):
    """Caching the spec rows' K/V and feeding one depth per call changes the cost, not the tree."""
    from spec_decode.drafting import draft_tree
    target, drafter = _target_and_drafter(tmp_path, kind)
    prompts = torch.tensor([[3, 14, 15, 92, 65, 35], [8, 9, 79, 32, 38, 46]])
    with torch.no_grad():
        out = target(prompts, target.new_cache(2, 64), aux_layers=drafter.aux_layers)
        cache = drafter.new_cache(2, 64)
        feats = drafter.features(out)
        hidden, feedback = drafter.draft_forward(prompts, feats, cache)
        cache.commit(torch.tensor([6, 6]))
        first_logits = drafter.compute_logits(hidden[:, -1])
        first_hidden = None if feedback is None else feedback[:, -1]
        root = torch.tensor([7, 11])
        steps, k, n = shape
        ref = _reference_draft_tree(drafter, cache, root, first_logits, first_hidden, steps, k, n)
        new = draft_tree(drafter, cache, TreeRoot(root, first_logits, first_hidden), TreeShape(steps, k, n), kv_len=6)
    assert torch.equal(new.tokens, ref.tokens) and torch.equal(new.parents, ref.parents)
    assert torch.equal(new.depth, ref.depth)
    assert torch.equal(new.tree_mask, ref.tree_mask)
    assert torch.equal(new.tree_mask, ancestor_mask(new.parents, steps))
    assert torch.equal(cache.lengths, torch.tensor([6, 6]))   # nothing speculative was committed


@pytest.mark.parametrize("shape, budget", [((5, 4, 8), [3, 1, 1, 1, 1]), ((4, 1, 5), [1, 1, 1, 1]),
                                           ((3, 3, 7), [3, 2, 1]), ((6, 2, 4), [1, 1, 1, 0, 0, 0]),
                                           ((2, 2, 7), [2, 2])])
def test_sampled_depth_budget(shape, budget):
    from spec_decode.drafting import sampled_depth_budget

    assert sampled_depth_budget(*shape) == budget


def test_sampled_trees_keep_draw_order_prefixes_and_carry_q(tmp_path):
    """Sampled rows: real nodes = the budget, siblings distinct, q at every expanded node; greedy rows unchanged."""
    from spec_decode.drafting import DraftSampling, draft_tree, sampled_depth_budget
    from spec_decode.models import Transformer
    from tiny_models import make_tiny_eagle, make_tiny_target

    target = Transformer.from_pretrained(make_tiny_target(tmp_path, seed=0), dtype=torch.float32)
    head = make_tiny_eagle(target, seed=1)
    prompts = torch.tensor([[3, 14, 15, 92, 65, 35]] * 4)
    with torch.no_grad():
        out = target(prompts, target.new_cache(4, 64))
        cache = head.new_cache(4, 64)
        hidden, feedback = head.draft_forward(prompts, head.features(out), cache)
        cache.commit(torch.full((4,), 6))
        args = (head, cache, TreeRoot(torch.full((4,), 7), head.compute_logits(hidden[:, -1]), feedback[:, -1]))
        shape = TreeShape(num_steps=4, topk=3, num_draft_tokens=9)
        sampled = torch.tensor([True, False, True, False])
        gens = [torch.Generator().manual_seed(s) for s in range(4)]
        tree = draft_tree(*args, shape, kv_len=6, sampling=DraftSampling(
            sampled, torch.ones(4), None, None, gens))
        greedy = draft_tree(*args, shape, kv_len=6)
    for r in (1, 3):
        assert torch.equal(tree.tokens[r], greedy.tokens[r]) and torch.equal(tree.parents[r], greedy.parents[r])
    budget = sampled_depth_budget(4, 3, 9)
    for r in (0, 2):
        parents, depth = tree.parents[r], tree.depth[r]
        real = parents >= 0
        assert int(real.sum()) == sum(budget)
        assert [int((real & (depth == d)).sum()) for d in range(1, 5)] == budget
        for node in range(tree.tokens.shape[1]):
            kids = tree.tokens[r][real & (parents == node)]
            assert len(set(kids.tolist())) == len(kids)                  # without replacement
            if len(kids):
                q = tree.draft_probs[r, node]
                assert torch.allclose(q.sum(), torch.tensor(1.0)) and bool((q[kids] > 0).all())


class _WithoutPrepareChain:
    """A drafter seen without its optional ``prepare_chain``: chain drafting takes the per-call path."""

    def __init__(self, drafter):
        self._drafter = drafter

    def __getattr__(self, name):
        if name == "prepare_chain":
            raise AttributeError(name)
        return getattr(self._drafter, name)


@pytest.mark.parametrize("prepared", [True, False], ids=["prepare_chain", "per-call"])
def test_chain_drafting_restores_the_committed_lengths_when_a_drafter_call_fails(tmp_path, prepared):
    """Without ``prepare_chain`` the chain counts its spec rows as committed while it drafts; with it,
    the lengths never move. Either way an error midway must not keep them."""
    from spec_decode.drafting import draft_tree
    target, drafter = _target_and_drafter(tmp_path, "eagle")
    if not prepared:
        drafter = _WithoutPrepareChain(drafter)
    prompts = torch.tensor([[3, 14, 15, 92, 65, 35]])
    calls = []
    real_logits = drafter.compute_logits

    def failing_logits(hidden):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("drafter failed")
        return real_logits(hidden)

    with torch.no_grad():
        out = target(prompts, target.new_cache(1, 64))
        cache = drafter.new_cache(1, 64)
        hidden, _ = drafter.draft_forward(prompts, drafter.features(out), cache)
        cache.commit(torch.tensor([6]))
        drafter.compute_logits = failing_logits
        with pytest.raises(RuntimeError, match="drafter failed"):
            draft_tree(drafter, cache, TreeRoot(torch.tensor([7]), real_logits(hidden[:, -1]), hidden[:, -1]),
                       TreeShape(num_steps=4, topk=1, num_draft_tokens=5), kv_len=6)
    assert len(calls) == 2
    assert torch.equal(cache.lengths, torch.tensor([6]))


def _three_rows_after_a_prompt(tmp_path, kind: str) -> tuple:
    """``draft_tree``'s positional args for 3 rows whose drafter cache holds a 6-token prompt (no grad)."""
    target, drafter = _target_and_drafter(tmp_path, kind)
    prompts = torch.tensor([[3, 14, 15, 92, 65, 35], [8, 9, 79, 32, 38, 46], [1, 2, 3, 4, 5, 6]])
    out = target(prompts, target.new_cache(3, 64), aux_layers=drafter.aux_layers)
    cache = drafter.new_cache(3, 64)
    hidden, feedback = drafter.draft_forward(prompts, drafter.features(out), cache)
    cache.commit(torch.tensor([6, 6, 6]))
    return (drafter, cache, TreeRoot(torch.tensor([7, 11, 13]), drafter.compute_logits(hidden[:, -1]),
                                     None if feedback is None else feedback[:, -1]))


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
@pytest.mark.parametrize("rows", ["greedy", "sampled", "mixed"])
def test_chain_fast_path_builds_the_pool_paths_tree(tmp_path, kind, rows):
    """topk=1 skips the pool: same tokens, parents, depths, mask and q as the general path, same draws."""
    from spec_decode.drafting import DraftSampling, _draft_pool_tree, draft_tree
    sampled = {"greedy": None, "sampled": [True] * 3, "mixed": [True, False, True]}[rows]
    with torch.no_grad():
        args = _three_rows_after_a_prompt(tmp_path, kind)
        cache = args[1]

        def sampling():
            if sampled is None:
                return None
            gens = [torch.Generator().manual_seed(s) for s in range(3)]
            return DraftSampling(torch.tensor(sampled), torch.tensor([0.7, 1.0, 1.3]), None, None, gens,
                                 all_sampled=all(sampled))

        fast = draft_tree(*args, TreeShape(4, 1, 5), kv_len=6, sampling=sampling())
        ref = _draft_pool_tree(*args, TreeShape(4, 1, 5), kv_len=6, sampling=sampling())
    for name in ("tokens", "parents", "depth", "tree_mask"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    assert (fast.max_depth, fast.max_children) == (ref.max_depth, ref.max_children)
    assert (fast.draft_probs is None) == (ref.draft_probs is None)
    if ref.draft_probs is not None:
        assert torch.equal(fast.draft_probs, ref.draft_probs)
    assert torch.equal(cache.lengths, torch.tensor([6, 6, 6]))   # nothing speculative was committed


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
def test_chain_drafting_without_prepare_chain_builds_the_same_tree(tmp_path, kind):
    """A drafter without the optional ``prepare_chain`` drafts per call, to the same chain and q."""
    from spec_decode.drafting import DraftSampling, draft_tree
    with torch.no_grad():
        args = _three_rows_after_a_prompt(tmp_path, kind)
        drafter, cache = args[0], args[1]
        trees = []
        for d in (drafter, _WithoutPrepareChain(drafter)):
            gens = [torch.Generator().manual_seed(s) for s in range(3)]
            sampling = DraftSampling(torch.tensor([True, False, True]), torch.tensor([0.7, 1.0, 1.3]), None, None,
                                     gens)
            trees.append(draft_tree(d, *args[1:], TreeShape(4, 1, 5), kv_len=6, sampling=sampling))
            assert torch.equal(cache.lengths, torch.tensor([6, 6, 6]))   # nothing speculative was committed
    assert torch.equal(trees[0].tokens, trees[1].tokens)
    assert torch.equal(trees[0].draft_probs, trees[1].draft_probs)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
def test_a_cold_score_temperature_keeps_the_chain_of_first_choices(tmp_path, kind):
    """score_temperature -> 0 ranks every first choice above every sibling: a 4/2/5 tree is then the
    4/1/5 chain. At 1.0 (EAGLE-2's rule) the same tree keeps siblings, so the temperature is used."""
    from spec_decode.drafting import draft_tree
    with torch.no_grad():
        args = _three_rows_after_a_prompt(tmp_path, kind)
        chain = draft_tree(*args, TreeShape(4, 1, 5), kv_len=6)
        cold = draft_tree(*args, TreeShape(4, 2, 5, score_temperature=1e-4), kv_len=6)
        eagle2 = draft_tree(*args, TreeShape(4, 2, 5), kv_len=6)
    assert torch.equal(cold.tokens, chain.tokens) and torch.equal(cold.parents, chain.parents)
    assert torch.equal(cold.depth, chain.depth) and torch.equal(cold.tree_mask, chain.tree_mask)
    assert not torch.equal(eagle2.parents, chain.parents)   # random drafters are unsure: siblings win at 1.0


@pytest.mark.parametrize("value", [0, -0.5, float("nan"), float("inf"), "0.5", True])
def test_draft_tree_rejects_a_bad_score_temperature(value):
    """``draft_tree`` takes its score temperature in a ``TreeShape``, which checks it."""
    with pytest.raises(ValueError, match="score_temperature"):
        TreeShape(num_steps=2, topk=2, num_draft_tokens=4, score_temperature=value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_expansion_keeps_the_id_the_scored_expansion_ranks_first(dtype):
    """scores=False (the chain's argmax) keeps what log_softmax + topk(1) keeps: on exact ties (the
    lowest index, as topk), on NaN/Inf rows (sanitized first) and on every-NaN rows."""
    from spec_decode.drafting import _Expansion
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 3, 257, generator=g) * 4).to(dtype)
    logits[0, 0, [5, 77, 200]] = 50.0                  # a three-way tie at the top
    logits[1, 1, [9, 10]] = float("inf")               # two +Inf: both sanitize to the same bound
    logits[2, 2, :] = float("nan")                     # every entry NaN: a uniform row, id 0
    logits[3, 0, 4] = float("nan")
    logits[3, 0, [100, 101]] = 30.0
    scored = _Expansion(logits.clone(), 1, None)
    chain = _Expansion(logits.clone(), 1, None, scores=False)
    assert chain.lp is None and chain.ids.shape == scored.ids.shape == (6, 3, 1)
    assert torch.equal(chain.ids, scored.ids)
    assert [chain.ids[0, 0, 0].item(), chain.ids[1, 1, 0].item(), chain.ids[2, 2, 0].item()] == [5, 9, 0]
    assert chain.ids[3, 0, 0].item() == 100


def _chain_calls(drafter, cache, tokens, feature, kv_len, prepared: bool):
    """Three one-token calls after the committed rows, by ``prepare_chain`` or by advancing the lengths."""
    blocks = drafter.prepare_chain(cache, 3, kv_len) if prepared else None
    hiddens = []
    for d in range(3):
        if prepared:
            hidden, fb = drafter.draft_forward(tokens[:, d:d + 1], feature, cache, block=blocks[d])
        else:
            hidden, fb = drafter.draft_forward(tokens[:, d:d + 1], feature, cache,
                                               kv_len=None if kv_len is None else kv_len + d + 1)
            cache.lengths += 1
        hiddens.append(hidden)
        feature = fb
    if not prepared:
        cache.lengths -= 3
    return hiddens


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_len", [6, None])
def test_prepared_chain_calls_give_the_bits_of_calls_that_build_their_own_inputs(tmp_path, kind, dtype, kv_len):
    """``prepare_chain`` builds every call's positions and masks at once: same hidden states and the
    same K/V written, bit for bit, for rows with different committed lengths."""
    target, drafter = _target_and_drafter(tmp_path, kind)
    target, drafter = target.to(dtype), drafter.to(dtype)
    prompts = torch.tensor([[3, 14, 15, 92, 65, 35], [8, 9, 79, 32, 38, 46]])
    with torch.no_grad():
        out = target(prompts, target.new_cache(2, 64), aux_layers=drafter.aux_layers)
        base = drafter.new_cache(2, 64)
        hidden, feedback = drafter.draft_forward(prompts, drafter.features(out), base)
        base.commit(torch.tensor([6, 4]))
        feature = None if feedback is None else feedback[:, -1:]
        tokens = torch.tensor([[7, 21, 5], [11, 2, 40]])
        runs = {}
        for prepared in (False, True):
            cache = type(base)(base.k.clone(), base.v.clone(), base.lengths.clone())
            runs[prepared] = (_chain_calls(drafter, cache, tokens, feature, kv_len, prepared), cache)
    (old, old_cache), (new, new_cache) = runs[False], runs[True]
    for a, b in zip(old, new):
        assert a.dtype == dtype and torch.equal(a, b)
    assert torch.equal(old_cache.k, new_cache.k) and torch.equal(old_cache.v, new_cache.v)
    assert torch.equal(new_cache.lengths, torch.tensor([6, 4]))   # prepare_chain never moves them


def test_a_prepared_block_comes_alone_and_fits_its_cache(tmp_path):
    target, drafter = _target_and_drafter(tmp_path, "eagle")
    with torch.no_grad():
        cache = drafter.new_cache(1, 16)
        cache.lengths += 4
        block = drafter.prepare_chain(cache, 2, 4)[0]
        tok, feat = torch.tensor([[3]]), torch.zeros(1, 1, drafter.config.hidden_size)
        for extra in ({"kv_len": 5}, {"position_ids": torch.tensor([[4]])}, {"input_lens": torch.tensor([1])}):
            with pytest.raises(ValueError, match="comes alone"):
                drafter.draft_forward(tok, feat, cache, block=block, **extra)
        with pytest.raises(ValueError, match="one causal token"):
            drafter.draft_forward(torch.tensor([[3, 4]]), feat.expand(1, 2, -1), cache, block=block)
        with pytest.raises(ValueError, match="block must be a LayerInputs"):
            drafter.draft_forward(tok, feat, cache, block="depth 1")
        with pytest.raises(ValueError, match="another cache"):
            drafter.draft_forward(torch.tensor([[3], [4]]), feat.expand(2, 1, -1), drafter.new_cache(2, 16),
                                  block=block)
        with pytest.raises(ValueError, match="num_calls must be >= 1"):
            drafter.prepare_chain(cache, 0, 4)
        with pytest.raises(ValueError, match="does not fit the cache"):
            drafter.prepare_chain(cache, 13, 4)
