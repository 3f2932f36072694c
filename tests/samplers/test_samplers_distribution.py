"""Distribution preservation: sample, chain and tree verification emit the target's law.

100k rows of the same distribution per call, vocab 6, chi-square at ALPHA = 1e-6 (see
samplers_testlib). Every test is paired with a mutant, a plausible wrong implementation
patched into the real code path, that the same statistic must reject.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import samplers.rejection as rejection_mod
import samplers.draws as draws_mod
import samplers.probs as probs_mod
import samplers.tree as tree_mod
from samplers import chain_speculative_sampling, logits_to_probs, sample, sample_without_replacement, tree_verify
from samplers_testlib import (
    NUM_SAMPLES,
    chi_square,
    conditional_chi_square,
    draw,
    reference_probs,
    softmax_table,
)

V = 6
LOGITS = [2.0, 1.4, 0.9, 0.2, -0.6, -1.3]  # no ties: the reference needs none

PARAMS = {
    "plain": dict(temperature=1.0),
    "temperature": dict(temperature=0.6),
    "top_k": dict(temperature=1.2, top_k=4),
    "top_p": dict(temperature=1.3, top_p=0.75),
    "top_k_top_p": dict(temperature=0.8, top_k=5, top_p=0.85),
    "top_k_top_p_min_p": dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.08),
}
# chain and tree runs are costlier: temperature alone, then temperature + top-k + top-p
VERIFY_PARAMS = ["temperature", "top_k_top_p"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- sample


def _sample_stat(params):
    logits = torch.tensor(LOGITS).expand(NUM_SAMPLES, V).contiguous()
    ids = sample(logits, generator=_gen(1), **params)
    return chi_square(ids, reference_probs(LOGITS, **params), V)


@pytest.mark.parametrize("name", list(PARAMS))
def test_sample_matches_processed_distribution(name):
    result = _sample_stat(PARAMS[name])
    assert result.passes, str(result)


def _top_p_excluding_boundary(z, top_k, top_p):
    """Mutant: top-p keeps tokens while the INCLUSIVE cumsum is < p (drops the boundary token)."""
    ordered = z.sort(-1, descending=True).values
    sorted_probs = ordered.softmax(-1)
    keep = sorted_probs.cumsum(-1) < top_p.unsqueeze(-1)
    count = keep.sum(-1, keepdim=True).clamp(min=1)
    return z.masked_fill(z < ordered.gather(-1, count - 1), float("-inf"))


def test_sample_mutant_top_p_is_rejected(monkeypatch):
    monkeypatch.setattr(probs_mod, "top_k_top_p", _top_p_excluding_boundary)
    result = _sample_stat(PARAMS["top_p"])
    assert not result.passes, f"mutant not detected: {result}"


# ----------------------------------------------------------------------------- chain


def _at_temperature(q: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distribution q re-tempered: normalise(q ** (1 / temperature)). [..., V] -> [..., V]."""
    z = q.log() / temperature
    return (z - z.max(-1, keepdim=True).values).softmax(-1)


def _chain_setup(params, with_draft_probs, seed=0, draw_temperature=1.0):
    """K = 2 chain; target and draft at position 1 depend on the first token.

    The drafts are drawn from q re-tempered at ``draw_temperature``; 1.0 is the honest
    setup, anything else a mutant whose draft_probs are not what the drafts came from.
    """
    rng = np.random.default_rng(seed)
    g = _gen(seed + 10)
    logits0 = torch.tensor(rng.normal(size=V) * 1.5, dtype=torch.float32)
    logits1 = torch.tensor(rng.normal(size=(V, V)) * 1.5, dtype=torch.float32)  # [a, V]
    logits2 = torch.tensor(rng.normal(size=V), dtype=torch.float32)
    t0 = logits_to_probs(logits0[None], **params)[0]
    t1 = logits_to_probs(logits1, **params)  # [V, V]: target given the first token
    t2 = logits_to_probs(logits2[None], **params)[0]
    q0 = torch.tensor(softmax_table(rng, 1, V)[0], dtype=torch.float32)
    q1 = torch.tensor(softmax_table(rng, V, V), dtype=torch.float32)
    d0 = draw(_at_temperature(q0, draw_temperature).expand(NUM_SAMPLES, V), g)  # drafts drawn from q
    d1 = draw(_at_temperature(q1[d0], draw_temperature), g)
    target = torch.stack([t0.expand(NUM_SAMPLES, V), t1[d0], t2.expand(NUM_SAMPLES, V)], 1)
    draft = torch.stack([q0.expand(NUM_SAMPLES, V), q1[d0]], 1) if with_draft_probs else None
    return draft, torch.stack([d0, d1], 1), target, t0.double().numpy(), t1.double().numpy()


def _chain_stats(params, with_draft_probs, draw_temperature=1.0):
    draft, ids, target, t0, t1 = _chain_setup(params, with_draft_probs, draw_temperature=draw_temperature)
    res = chain_speculative_sampling(draft, ids, target, generator=_gen(2))
    first, second = res.output_token_ids[:, 0], res.output_token_ids[:, 1]
    return chi_square(first, t0, V), conditional_chi_square(first, second, res.num_emitted >= 2, t1, V)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("name", VERIFY_PARAMS)
def test_chain_preserves_target_distribution(name, with_draft_probs):
    first, second = _chain_stats(PARAMS[name], with_draft_probs)
    assert first.passes, f"first token: {first}"
    assert second.passes, f"second token given first: {second}"


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "deterministic"])
def test_chain_mutant_without_residual_is_rejected(monkeypatch, with_draft_probs):
    # Mutant: on rejection sample from p instead of normalise(max(p - q, 0)).
    monkeypatch.setattr(rejection_mod, "residual", lambda p, q: p)
    first, _second = _chain_stats(PARAMS["plain"], with_draft_probs)
    assert not first.passes, f"mutant not detected: {first}"


def test_chain_mutant_draft_probs_at_another_temperature_is_rejected():
    # Mutant: drafts drawn at temperature 0.7, draft_probs recorded at temperature 1.
    first, second = _chain_stats(PARAMS["plain"], True, draw_temperature=0.7)
    assert not (first.passes and second.passes), f"mutant not detected: {first}; {second}"


# ----------------------------------------------------------------------------- tree

# root 0 -> children 1, 2 (siblings); 1 -> 3, 4; 2 -> 5
PARENTS = [-1, 0, 0, 1, 1, 2]


def _tree_setup(with_draft_probs, seed=0):
    """Per-row trees whose target (and drafter) at a depth-1 node depend on its token."""
    rng = np.random.default_rng(seed)
    g = _gen(seed + 20)
    n = len(PARENTS)
    logits0 = rng.normal(size=V) * 1.5
    logits1 = rng.normal(size=(V, V)) * 1.5  # target logits after first token a
    logits_deep = rng.normal(size=V)
    q0 = torch.tensor(softmax_table(rng, 1, V)[0], dtype=torch.float32)
    q1 = torch.tensor(softmax_table(rng, V, V), dtype=torch.float32)
    rows = NUM_SAMPLES
    if with_draft_probs:
        # children drawn i.i.d. (with replacement) from the drafter at their parent
        t1, t2 = draw(q0.expand(rows, V), g), draw(q0.expand(rows, V), g)
        t3, t4, t5 = draw(q1[t1], g), draw(q1[t1], g), draw(q1[t2], g)
    else:
        # deterministic drafts: any choice of children, here two distinct tokens
        pair = torch.stack([torch.randperm(V, generator=g)[:2] for _ in range(64)])
        t1, t2 = pair[torch.arange(rows) % 64].unbind(1)
        t3, t4, t5 = (torch.randint(0, V, (rows,), generator=g) for _ in range(3))
    tokens = torch.stack([torch.zeros_like(t1), t1, t2, t3, t4, t5], 1)
    l1 = torch.tensor(logits1, dtype=torch.float32)
    deep = torch.tensor(logits_deep, dtype=torch.float32).expand(rows, V)
    target = torch.stack(
        [torch.tensor(logits0, dtype=torch.float32).expand(rows, V), l1[t1], l1[t2], deep, deep, deep], 1
    )
    draft = None
    if with_draft_probs:
        qd = torch.full((rows, V), 1.0 / V)
        draft = torch.stack([q0.expand(rows, V), q1[t1], q1[t2], qd, qd, qd], 1)
    parents = torch.tensor(PARENTS).expand(rows, n).contiguous()
    return tokens, parents, target, draft, logits0, logits1


def _tree_stats(params, with_draft_probs):
    tokens, parents, target, draft, logits0, logits1 = _tree_setup(with_draft_probs)
    res = tree_verify(tokens, parents, target, draft_probs=draft, generator=_gen(3), **params)
    first, second = res.output_token_ids[:, 0], res.output_token_ids[:, 1]
    t0 = reference_probs(logits0, **params)
    t1 = np.stack([reference_probs(row, **params) for row in logits1])
    return chi_square(first, t0, V), conditional_chi_square(first, second, res.num_emitted >= 2, t1, V)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("name", VERIFY_PARAMS)
def test_tree_preserves_target_distribution(name, with_draft_probs):
    first, second = _tree_stats(PARAMS[name], with_draft_probs)
    assert first.passes, f"first token: {first}"
    assert second.passes, f"second token given first: {second}"


def test_tree_mutant_rejection_without_residual_is_rejected(monkeypatch):
    # Mutant: after a rejected child, keep testing the next sibling against the unchanged p.
    monkeypatch.setattr(rejection_mod, "residual", lambda p, q: p)
    first, _second = _tree_stats(PARAMS["plain"], with_draft_probs=True)
    assert not first.passes, f"mutant not detected: {first}"


def _follow_sample_fresh_draw(p, is_child, walk):
    """Mutant: when no child matches x, emit a FRESH draw from p instead of x."""
    x = draws_mod.race_sample(p, walk.generator)
    child, has = tree_mod._first_true(is_child & (walk.tokens == x.unsqueeze(1)))
    fresh = draws_mod.race_sample(p, walk.generator)
    return child, has, torch.where(has, x, fresh)


def test_tree_mutant_fresh_draw_on_miss_is_rejected(monkeypatch):
    monkeypatch.setattr(tree_mod, "follow_sample", _follow_sample_fresh_draw)
    first, _second = _tree_stats(PARAMS["plain"], with_draft_probs=False)
    assert not first.passes, f"mutant not detected: {first}"


# ----------------------------------------------------------------------------- tree, children without replacement

# root 0 -> 1, 2, 3 (three distinct siblings); 1 -> 4, 5; 2 -> 6, 7; 3 has none. Depth 2.
WOR_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2]
GREEDY_EVERY = 11  # rows r % 11 == 0 are greedy (temperature 0), in the same batch


def _draw_distinct(q: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """k successive draws without replacement, by torch.multinomial (not our sampler).

    Shape: q [n, V] -> [n, k]: draw one, zero it, renormalise, draw the next.
    """
    out = []
    for _ in range(k):
        x = draw(q, g)
        out.append(x)
        q = q.scatter(1, x.unsqueeze(1), 0.0)
        q = q / q.sum(1, keepdim=True)
    return torch.stack(out, 1)


def _wor_setup(draw_temperature=1.0, seed=1):
    """Batch of WOR trees, greedy and sampled rows mixed. Returns inputs and the exact laws.

    Children of node i are successive distinct draws from q at node i re-tempered at
    ``draw_temperature`` (1.0: honest; else a mutant whose draft_probs are not the
    distribution the drafts came from).
    """
    rng = np.random.default_rng(seed)
    g = _gen(seed + 40)
    rows = NUM_SAMPLES + NUM_SAMPLES // (GREEDY_EVERY - 1)
    logits0 = rng.normal(size=V) * 1.5
    logits1 = rng.normal(size=(V, V)) * 1.5  # target after first token a
    logits_deep = rng.normal(size=V)
    q0 = torch.tensor(softmax_table(rng, 1, V)[0], dtype=torch.float32)
    q1 = torch.tensor(softmax_table(rng, V, V), dtype=torch.float32)
    root_kids = _draw_distinct(_at_temperature(q0, draw_temperature).expand(rows, V), 3, g)  # [rows, 3]
    t1, t2, t3 = root_kids.unbind(1)
    t4, t5 = _draw_distinct(_at_temperature(q1[t1], draw_temperature), 2, g).unbind(1)
    t6, t7 = _draw_distinct(_at_temperature(q1[t2], draw_temperature), 2, g).unbind(1)
    tokens = torch.stack([torch.zeros_like(t1), t1, t2, t3, t4, t5, t6, t7], 1)
    l1 = torch.tensor(logits1, dtype=torch.float32)
    deep = torch.tensor(logits_deep, dtype=torch.float32).expand(rows, V)
    root = torch.tensor(logits0, dtype=torch.float32).expand(rows, V)
    target = torch.stack([root, l1[t1], l1[t2], l1[t3], deep, deep, deep, deep], 1)
    qd = torch.full((rows, V), 1.0 / V)  # leaves have no children: never read
    draft = torch.stack([q0.expand(rows, V), q1[t1], q1[t2], q1[t3], qd, qd, qd, qd], 1)
    parents = torch.tensor(WOR_PARENTS).expand(rows, len(WOR_PARENTS)).contiguous()
    greedy = torch.arange(rows) % GREEDY_EVERY == 0
    return tokens, parents, target, draft, greedy, (logits0, logits1, logits_deep)


def _wor_stats(params, draw_temperature=1.0, sibling_sampling="without_replacement"):
    tokens, parents, target, draft, greedy, (logits0, logits1, logits_deep) = _wor_setup(draw_temperature)
    temperature = torch.where(greedy, 0.0, params["temperature"])
    rest = {k: v for k, v in params.items() if k != "temperature"}
    res = tree_verify(tokens, parents, target, draft_probs=draft, sibling_sampling=sibling_sampling,
                      temperature=temperature, generator=_gen(5), max_depth=2, **rest)
    out, num = res.output_token_ids, res.num_emitted

    # greedy rows: exactly what greedy verification of those rows alone gives
    alone = tree_verify(tokens[greedy], parents[greedy], target[greedy], draft_probs=draft[greedy],
                        sibling_sampling=sibling_sampling, temperature=0.0, max_depth=2)
    assert torch.equal(out[greedy], alone.output_token_ids), "greedy rows differ in a mixed batch"

    s = ~greedy
    out, num = out[s], num[s]
    first, second, third = out[:, 0], out[:, 1], out[:, 2]
    t0 = reference_probs(logits0, **params)
    t1 = np.stack([reference_probs(row, **params) for row in logits1])
    t_deep = np.stack([reference_probs(logits_deep, **params)] * V)  # depth 2 does not depend on the path
    return (
        chi_square(first, t0, V),
        conditional_chi_square(first, second, num >= 2, t1, V),
        conditional_chi_square(second, third, num >= 3, t_deep, V),
    )


@pytest.mark.parametrize("name", VERIFY_PARAMS)
def test_tree_without_replacement_preserves_target_distribution(name):
    first, second, third = _wor_stats(PARAMS[name])
    assert first.passes, f"first token: {first}"
    assert second.passes, f"second token given first: {second}"
    assert third.passes, f"third token given second: {third}"


def _fails(stats) -> bool:
    return not all(s.passes for s in stats)


def test_tree_without_replacement_mutant_q_not_renormalised_is_rejected(monkeypatch):
    # Mutant (a): after a rejection q loses x but is not renormalised.
    monkeypatch.setattr(rejection_mod, "without_token", lambda q, x: q.scatter(1, x.unsqueeze(1), 0.0))
    stats = _wor_stats(PARAMS["plain"])
    assert _fails(stats), f"mutant not detected: {[str(s) for s in stats]}"


def test_tree_without_replacement_mutant_residual_skipped_is_rejected(monkeypatch):
    # Mutant (b): after a rejection p stays the target instead of normalise(max(p - q, 0)).
    monkeypatch.setattr(rejection_mod, "residual", lambda p, q: p)
    stats = _wor_stats(PARAMS["plain"])
    assert _fails(stats), f"mutant not detected: {[str(s) for s in stats]}"


def test_tree_without_replacement_mutant_draft_probs_at_another_temperature_is_rejected():
    # Mutant (c): children drawn at temperature 0.7, draft_probs recorded at temperature 1.
    stats = _wor_stats(PARAMS["plain"], draw_temperature=0.7)
    assert _fails(stats), f"mutant not detected: {[str(s) for s in stats]}"


def test_tree_without_replacement_mutant_with_replacement_rule_is_rejected():
    # Mutant: distinct children verified with SpecInfer's with-replacement rule (q never loses x).
    stats = _wor_stats(PARAMS["plain"], sibling_sampling="with_replacement")
    assert _fails(stats), f"mutant not detected: {[str(s) for s in stats]}"


# ----------------------------------------------------------------------------- sample_without_replacement


def _ordered_pair_law(q: np.ndarray) -> np.ndarray:
    """P(x1 = a, x2 = b) of two successive draws without replacement, flattened [V*V]."""
    law = q[:, None] * q[None, :] / (1.0 - q[:, None])
    np.fill_diagonal(law, 0.0)
    return law.reshape(-1)


def _pair_stat(draw_fn):
    rng = np.random.default_rng(7)
    q = softmax_table(rng, 1, V)[0]
    probs = torch.tensor(q, dtype=torch.float32).expand(NUM_SAMPLES, V).contiguous()
    ids = draw_fn(probs)
    assert ids.shape == (NUM_SAMPLES, 3) and ((ids >= 0) & (ids < V)).all()
    assert (ids[:, 0] != ids[:, 1]).all() and (ids[:, 1] != ids[:, 2]).all() and (ids[:, 0] != ids[:, 2]).all()
    return chi_square(ids[:, 0] * V + ids[:, 1], _ordered_pair_law(q.astype(np.float64)), V * V)


def test_sample_without_replacement_gives_successive_draws():
    result = _pair_stat(lambda p: sample_without_replacement(p, 3, _gen(9)))
    assert result.passes, str(result)


def test_sample_without_replacement_mutant_unordered_is_rejected():
    # Mutant: the k distinct ids returned sorted (the draw order lost).
    result = _pair_stat(lambda p: sample_without_replacement(p, 3, _gen(9)).sort(-1).values)
    assert not result.passes, f"mutant not detected: {result}"


def test_sample_without_replacement_short_rows_stay_in_range():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [float("nan"), 0.0, 0.0, 0.0, 1.0], [0.0] * 5])
    ids = sample_without_replacement(probs, 4, [_gen(s) for s in range(3)])
    assert sorted(ids[0, :2].tolist()) == [1, 3] and ids[0, 2:].tolist() == [0, 2]
    assert ids[1].tolist() == [4, 0, 1, 2]  # NaN counts as 0
    assert ids[2].tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- one generator per row


def _per_row_stat(seeds):
    logits = torch.tensor(LOGITS).expand(NUM_SAMPLES, V).contiguous()
    ids = sample(logits, generator=[_gen(int(s)) for s in seeds], **PARAMS["temperature"])
    return chi_square(ids, reference_probs(LOGITS, **PARAMS["temperature"]), V)


def test_sample_with_one_generator_per_row_matches_distribution():
    result = _per_row_stat(np.arange(NUM_SAMPLES) + 12345)
    assert result.passes, str(result)


def test_per_row_mutant_shared_seed_is_rejected():
    # Mutant: every row's generator seeded alike (rows then repeat one draw).
    result = _per_row_stat(np.full(NUM_SAMPLES, 12345))
    assert not result.passes, f"mutant not detected: {result}"
