"""Distribution preservation: sample, chain and tree verification emit the target's law.

100k rows of the same distribution per call, vocab 6, chi-square at ALPHA = 1e-6 (see
samplers_testlib). Every test is paired with a mutant, a plausible wrong implementation
patched into the real code path, that the same statistic must reject.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import samplers.probs as probs_mod
import samplers.tree as tree_mod
import samplers.verify as verify_mod
from samplers import chain_speculative_sampling, logits_to_probs, sample, tree_verify
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
    monkeypatch.setattr(probs_mod, "_top_k_top_p", _top_p_excluding_boundary)
    result = _sample_stat(PARAMS["top_p"])
    assert not result.passes, f"mutant not detected: {result}"


# ----------------------------------------------------------------------------- chain


def _chain_setup(params, with_draft_probs, seed=0):
    """K = 2 chain; target and draft at position 1 depend on the first token."""
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
    d0 = draw(q0.expand(NUM_SAMPLES, V), g)  # drafts really drawn from q
    d1 = draw(q1[d0], g)
    target = torch.stack([t0.expand(NUM_SAMPLES, V), t1[d0], t2.expand(NUM_SAMPLES, V)], 1)
    draft = torch.stack([q0.expand(NUM_SAMPLES, V), q1[d0]], 1) if with_draft_probs else None
    return draft, torch.stack([d0, d1], 1), target, t0.double().numpy(), t1.double().numpy()


def _chain_stats(params, with_draft_probs):
    draft, ids, target, t0, t1 = _chain_setup(params, with_draft_probs)
    out, _accepted, emitted = chain_speculative_sampling(draft, ids, target, generator=_gen(2))
    first, second = out[:, 0], out[:, 1]
    return chi_square(first, t0, V), conditional_chi_square(first, second, emitted >= 1, t1, V)


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("name", VERIFY_PARAMS)
def test_chain_preserves_target_distribution(name, with_draft_probs):
    first, second = _chain_stats(PARAMS[name], with_draft_probs)
    assert first.passes, f"first token: {first}"
    assert second.passes, f"second token given first: {second}"


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "deterministic"])
def test_chain_mutant_without_residual_is_rejected(monkeypatch, with_draft_probs):
    # Mutant: on rejection sample from p instead of normalise(max(p - q, 0)).
    monkeypatch.setattr(verify_mod, "_residual_weights", lambda p, q: p)
    first, _second = _chain_stats(PARAMS["plain"], with_draft_probs)
    assert not first.passes, f"mutant not detected: {first}"


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
    monkeypatch.setattr(tree_mod, "_residual", lambda p, q: p)
    first, _second = _tree_stats(PARAMS["plain"], with_draft_probs=True)
    assert not first.passes, f"mutant not detected: {first}"


def _follow_sample_fresh_draw(p, is_child, walk):
    """Mutant: when no child matches x, emit a FRESH draw from p instead of x."""
    x = probs_mod.race_sample(p, walk.generator)
    child, has = tree_mod._first_true(is_child & (walk.tokens == x.unsqueeze(1)))
    fresh = probs_mod.race_sample(p, walk.generator)
    return child, has, torch.where(has, x, fresh)


def test_tree_mutant_fresh_draw_on_miss_is_rejected(monkeypatch):
    monkeypatch.setattr(tree_mod, "_follow_sample", _follow_sample_fresh_draw)
    first, _second = _tree_stats(PARAMS["plain"], with_draft_probs=False)
    assert not first.passes, f"mutant not detected: {first}"
