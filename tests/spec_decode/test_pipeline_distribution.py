"""Pipeline-level exactness at temperature 1: speculative output follows the target's distribution.

The exact law of the first four new tokens is computed by enumerating every continuation with the
target (V=6, so 6**3 prefixes). The pipeline then samples many copies of one prompt in a single
batch. A chi-square test on (x1, x2) and on (x3, x4) must accept the real pipeline and reject a
plausible bug: committing the first ``num`` KV rows of the tree instead of the accepted path's.

False-failure rate: each chi-square test rejects a correct sampler with probability ALPHA = 1e-6.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

from spec_decode import SpecDecoder
from spec_decode.models import KVCache, Transformer
from tiny_models import make_tiny_eagle, make_tiny_target

pytestmark = pytest.mark.slow  # frequency tests over many sampled sequences

ALPHA = 1e-6
V = 6
PROMPT = [1, 2, 3]
NUM_SAMPLES = 30_000
TREE = dict(num_steps=3, topk=3, num_draft_tokens=7)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("dist"), seed=3, vocab_size=V, num_hidden_layers=2)
    target = Transformer.from_pretrained(path, dtype=torch.float32)
    return target, make_tiny_eagle(target, seed=4)


def exact_joint(target: Transformer) -> torch.Tensor:
    """P(x1, x2, x3, x4 | PROMPT) as a [V, V, V, V] float64 tensor."""
    prefixes = torch.tensor(list(itertools.product(range(V), repeat=3)))          # [V^3, 3]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], 1)
    cache = target.new_cache(len(ids), ids.shape[1])
    with torch.no_grad():
        logits = target(ids, cache).logits.double()
    p = torch.softmax(logits[:, len(PROMPT) - 1:], -1)                            # [V^3, 4, V]
    joint = torch.ones(len(prefixes), dtype=torch.float64)
    for j in range(3):
        joint = joint * p[torch.arange(len(prefixes)), j, prefixes[:, j]]
    joint = joint[:, None] * p[:, 3]                                               # [V^3, V]
    return joint.reshape(V, V, V, V)


def chi_square_rejects(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square at level ALPHA; cells expected < 5 are pooled into one."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    expected = probs * n
    small_cells = expected < 5
    obs = torch.cat([counts[~small_cells], counts[small_cells].sum()[None]])
    exp = torch.cat([expected[~small_cells], expected[small_cells].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat > chi2.ppf(1 - ALPHA, int(keep.sum()) - 1)


def sample_counts(decoder: SpecDecoder, seed: int, temperature=1.0) -> tuple[torch.Tensor, float]:
    """Counts of (x1, x2, x3, x4) over the requests with temperature 1, and the mean tokens per verify step.

    ``temperature`` may be a list (a mixed batch); its temperature-0 requests must all give the greedy
    continuation.
    """
    temps = temperature if isinstance(temperature, list) else [temperature] * NUM_SAMPLES
    out = decoder.generate([PROMPT] * len(temps), max_new_tokens=4, temperature=temps, seed=seed)
    greedy = {tuple(r.token_ids) for r, t in zip(out, temps) if t == 0}
    assert len(greedy) <= 1, "greedy requests in a sampled batch must all follow the argmax"
    out = [r for r, t in zip(out, temps) if t == 1.0]
    toks = torch.tensor([r.token_ids for r in out])                                # [n, 4]
    counts = torch.zeros(V, V, V, V, dtype=torch.long)
    counts.index_put_(tuple(toks.T), torch.ones(len(toks), dtype=torch.long), accumulate=True)
    steps = [n for r in out for n in r.accepted_lengths]
    return counts, sum(steps) / len(steps)


def rejects(counts, joint) -> tuple[bool, bool]:
    return (chi_square_rejects(counts.sum((2, 3)), joint.sum((2, 3))),
            chi_square_rejects(counts.sum((0, 1)), joint.sum((0, 1))))


# drafter -> the mean tokens per verify step must exceed this, so that verification really
# accepted drafts (random EAGLE head: about 1.45 measured; the target drafting for itself: 2.4).
DRAFTERS = {"none": 0.0, "eagle": 1.3, "self": 2.0}


def _decoder(target, head, drafter, draft_sampling="auto", **shape):
    shape = shape or TREE
    if drafter == "none":
        return SpecDecoder(target, None, method="none")
    if drafter == "eagle":
        return SpecDecoder(target, head, method="eagle", draft_sampling=draft_sampling, **shape)
    return SpecDecoder(target, target, method="draft_model", draft_sampling=draft_sampling, **shape)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_temperature_one_matches_the_target_distribution(small, drafter):
    target, head = small
    counts, mean_accepted = sample_counts(_decoder(target, head, drafter), seed=11)
    assert rejects(counts, exact_joint(target)) == (False, False)
    assert mean_accepted > DRAFTERS[drafter]


def test_mutant_committing_the_wrong_kv_rows_is_caught(small, monkeypatch):
    """Commit the tree's first rows instead of the accepted path: (x3, x4) must be rejected.

    The target drafts for itself with greedy (top-k) drafts, so siblings other than the first are
    accepted often. (With sampled drafts q equals p and every draft is accepted: the first four
    tokens would come from one step, before any commit matters.)
    """
    target, head = small
    original = KVCache.commit
    monkeypatch.setattr(KVCache, "commit", lambda self, num, rel_idx=None: original(self, num))
    counts, _ = sample_counts(_decoder(target, head, "self", draft_sampling="greedy"), seed=11)
    assert rejects(counts, exact_joint(target))[1]


# ------------------------------------------------------------------ sampled drafts
# Drafts drawn from the drafter's q (without replacement within a node), verified by recursive
# rejection. The random EAGLE head's q is far from p, so rejections (and second siblings) are common.
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
SAMPLED = {
    "chain": (CHAIN, 1.0),
    "tree": (TREE, 1.0),
    "mixed": (TREE, [1.0, 0.0] * (NUM_SAMPLES // 2) + [1.0] * (NUM_SAMPLES // 2)),
    "mixed_chain": (CHAIN, [1.0, 0.0] * (NUM_SAMPLES // 2) + [1.0] * (NUM_SAMPLES // 2)),
}


@pytest.mark.parametrize("case", SAMPLED)
def test_sampled_drafts_match_the_target_distribution(small, case):
    target, head = small
    shape, temps = SAMPLED[case]
    counts, mean_accepted = sample_counts(_decoder(target, head, "eagle", **shape), seed=5, temperature=temps)
    assert rejects(counts, exact_joint(target)) == (False, False)
    assert mean_accepted > 1.3


def _mutant_q_not_renormalised(monkeypatch):
    """After a rejected sibling, q keeps that sibling's mass (the with-replacement rule)."""
    from samplers import rejection
    monkeypatch.setattr(rejection, "without_token", lambda q, x: q)


def _mutant_residual_skipped(monkeypatch):
    """After a rejection, p stays p instead of normalise(max(p - q, 0))."""
    from samplers import rejection
    monkeypatch.setattr(rejection, "residual", lambda p, q: p)


def _mutant_probs_at_another_temperature(monkeypatch):
    """Drafts drawn at temperature 0.7, but q recorded (and verified) at temperature 1."""
    from spec_decode import drafting
    original = drafting.sample_without_replacement
    monkeypatch.setattr(drafting, "sample_without_replacement",
                        lambda q, k, generator=None: original(q ** (1 / 0.7), k, generator))


@pytest.mark.parametrize("mutant, case", [
    (_mutant_q_not_renormalised, "tree"),
    (_mutant_residual_skipped, "chain"),
    (_mutant_residual_skipped, "tree"),
    (_mutant_probs_at_another_temperature, "chain"),
    (_mutant_probs_at_another_temperature, "mixed"),
    (_mutant_residual_skipped, "mixed_chain"),
])
def test_sampled_draft_mutants_are_caught(small, monkeypatch, mutant, case):
    target, head = small
    shape, temps = SAMPLED[case]
    mutant(monkeypatch)
    counts, _ = sample_counts(_decoder(target, head, "eagle", **shape), seed=5, temperature=temps)
    assert any(rejects(counts, exact_joint(target)))
