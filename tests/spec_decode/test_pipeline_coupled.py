"""Coupled sampling in the decoder (``draft_sampling="coupled"``): seeded sampled tokens are a function of
(prompt, parameters, seed) alone, whatever drafted them, and they follow the target's law.

Law: the first four tokens of many seeded copies of one prompt against the exact joint law (the
enumeration of ``test_pipeline_distribution``), for ``method="none"`` (the reference, whose first
token is a draw from the target's own softmax), a chain and a tree; mutants of the noise (not
Gumbel, keyed without the position) must be rejected. Invariance: token for token, in fp32, every
method's seeded output equals ``method="none"``'s, alone, batched, reordered and mixed with greedy
requests; a mutant keying the noise by batch row must break it.
"""
from __future__ import annotations

import random

import pytest
import torch

import samplers.coupled as coupled_mod
from spec_decode import SpecDecoder
from spec_decode.models import Transformer
from spec_decode.pipeline import DepthController
from test_pipeline_distribution import CHAIN, PROMPT, TREE, chi_square_rejects, exact_joint, rejects, sample_counts
from tiny_models import make_tiny_eagle, make_tiny_eagle3, make_tiny_target

PROMPTS = [[5, 9, 14, 3, 22, 7], [1, 2, 3, 4, 1, 2, 3, 4], [7, 7, 7], [40, 41, 42, 43, 44]]
MAX_NEW = 24


# ------------------------------------------------------------------ the law
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from test_pipeline_distribution import V

    path = make_tiny_target(tmp_path_factory.mktemp("coupled_law"), seed=3, vocab_size=V, num_hidden_layers=2)
    target = Transformer.from_pretrained(path, dtype=torch.float32)
    return target, make_tiny_eagle(target, seed=4)


def _coupled(target, head, shape):
    if shape is None:
        return SpecDecoder(target, None, method="none", draft_sampling="coupled")
    return SpecDecoder(target, head, method="eagle", draft_sampling="coupled", **shape)


SHAPES = {"none": None, "chain": CHAIN, "tree": TREE}


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.slow
def test_coupled_tokens_follow_the_target_law(small, name):
    target, head = small
    counts, _ = sample_counts(_coupled(target, head, SHAPES[name]), seed=17)
    assert rejects(counts, exact_joint(target)) == (False, False)


@pytest.mark.slow
def test_first_token_of_method_none_is_a_draw_from_the_softmax(small):
    target, _ = small
    counts, _ = sample_counts(_coupled(target, None, None), seed=23)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = target(ids, target.new_cache(1, len(PROMPT))).logits[0, -1].double()
    assert not chi_square_rejects(counts.sum((1, 2, 3)), torch.softmax(logits, -1))


def _mutant_exponential_noise(u):
    return u.log_().neg_()


def _mutant_without_position(seeds, positions):
    return coupled_mod._stream(coupled_mod._stream(seeds, torch.zeros_like(seeds)), torch.zeros_like(positions))


@pytest.mark.parametrize("attr, mutant", [("gumbel", _mutant_exponential_noise),
                                          ("position_keys", _mutant_without_position)])
@pytest.mark.parametrize("name", ["none", "chain"])
@pytest.mark.slow
def test_noise_mutants_are_rejected(small, monkeypatch, attr, mutant, name):
    target, head = small
    monkeypatch.setattr(coupled_mod, attr, mutant)
    counts, _ = sample_counts(_coupled(target, head, SHAPES[name]), seed=17)
    assert any(rejects(counts, exact_joint(target)))


# ------------------------------------------------------------------ invariance
@pytest.fixture(scope="module")
def coupled_models(tmp_path_factory):
    """Random fp32 models of their own (not ``random_models``): an EAGLE-3 head with a 64-token draft vocabulary,
    and a one-layer draft LM of seed 7 that ``draft_model`` drafts with (not the target itself)."""
    d = tmp_path_factory.mktemp("coupled_inv")
    target = Transformer.from_pretrained(make_tiny_target(d), dtype=torch.float32)
    draft = Transformer.from_pretrained(make_tiny_target(d, name="draft", seed=7, num_hidden_layers=1),
                                        dtype=torch.float32)
    return dict(target=target, eagle=make_tiny_eagle(target), eagle3=make_tiny_eagle3(target, draft_vocab_size=64),
                draft=draft)


METHODS = {
    "chain": ("eagle", dict(num_steps=5, topk=1, num_draft_tokens=6)),
    "tree_5_4_8": ("eagle", dict(num_steps=5, topk=4, num_draft_tokens=8)),
    "tree_4_2_8_t05": ("eagle", dict(num_steps=4, topk=2, num_draft_tokens=8, tree_score_temperature=0.5)),
    "auto": ("eagle", dict(num_steps="auto", num_draft_tokens=6)),
    "chain_lookup": ("eagle", dict(num_steps=5, topk=1, num_draft_tokens=6, lookup_ngram=1)),
    "lookup_only": ("none", dict(lookup_ngram=1)),
    "eagle3": ("eagle3", dict(num_steps=4, topk=2, num_draft_tokens=8)),
    "draft_model": ("draft_model", dict(num_steps=3, topk=2, num_draft_tokens=6)),
}
SAMPLING = {
    "t1": dict(temperature=1.0),
    "t07_top_p": dict(temperature=0.7, top_p=0.9),
    "mixed": dict(temperature=[1.0, 0.0, 0.7, 0.0], top_p=[None, None, 0.9, None]),
}
SEEDS = [11, 12, 13, 14]


def _decoder(coupled_models, name):
    if name == "none":
        return SpecDecoder(coupled_models["target"], None, method="none", draft_sampling="coupled")
    method, shape = METHODS[name]
    drafter = {"eagle": coupled_models["eagle"], "eagle3": coupled_models["eagle3"],
               "draft_model": coupled_models["draft"], "none": None}[method]
    return SpecDecoder(coupled_models["target"], drafter, method=method, draft_sampling="coupled", **shape)


def _per_request(kw, i):
    return {k: v[i] if isinstance(v, list) else v for k, v in kw.items()}


def _run(dec, prompts, kw, seeds):
    return [r.token_ids for r in dec.generate(prompts, max_new_tokens=MAX_NEW, seed=seeds, ignore_eos=True, **kw)]


@pytest.fixture(scope="module")
def reference(coupled_models):
    dec = _decoder(coupled_models, "none")
    return {case: _run(dec, PROMPTS, kw, SEEDS) for case, kw in SAMPLING.items()}


@pytest.mark.parametrize("case", SAMPLING)
@pytest.mark.parametrize("name", METHODS)
def test_every_method_gives_the_reference_tokens(coupled_models, reference, name, case):
    dec, kw = _decoder(coupled_models, name), SAMPLING[case]
    assert _run(dec, PROMPTS, kw, SEEDS) == reference[case], "batched"
    order = [2, 0, 3, 1]
    reordered = _run(dec, [PROMPTS[i] for i in order], _reorder(kw, order), [SEEDS[i] for i in order])
    assert reordered == [reference[case][i] for i in order], "reordered"
    i = 2
    assert _run(dec, [PROMPTS[i]], _per_request(kw, i), [SEEDS[i]]) == [reference[case][i]], "alone"


def _reorder(kw, order):
    return {k: [v[i] for i in order] if isinstance(v, list) else v for k, v in kw.items()}


@pytest.mark.parametrize("name, temperature", [("chain_lookup", 1.0), ("lookup_only", 0.3)])
def test_speculation_really_ran(coupled_models, name, temperature):
    """The invariance is not vacuous: drafts were accepted at a temperature, and lookup steps served
    sampled requests (repetitive prompts, so that their last tokens occurred before). Lookup alone
    drafts what followed in the context, which the random target's draws match only when they
    repeat: a lower temperature makes its outputs loop."""
    prompts, kw = [[7, 7, 7, 7], [1, 2, 1, 2, 1, 2]], dict(temperature=temperature, min_p=0.2)
    dec = _decoder(coupled_models, name)
    out = dec.generate(prompts, max_new_tokens=MAX_NEW, seed=SEEDS[:2], ignore_eos=True, **kw)
    assert any(dec.last_stats.lookup)
    assert max(n for r in out for n in r.accepted_lengths) > 1
    assert [r.token_ids for r in out] == _run(_decoder(coupled_models, "none"), prompts, kw, SEEDS[:2])


def _mutant_keyed_by_row(seeds, positions):
    rows = torch.arange(seeds.shape[0], device=seeds.device).view(seeds.shape)
    return coupled_mod._stream(coupled_mod._stream(rows, torch.zeros_like(rows)), positions)


def test_noise_keyed_by_batch_row_breaks_the_invariance(coupled_models, reference, monkeypatch):
    monkeypatch.setattr(coupled_mod, "position_keys", _mutant_keyed_by_row)
    dec = _decoder(coupled_models, "chain")
    kw = SAMPLING["t1"]
    batched = _run(dec, PROMPTS, kw, SEEDS)
    alone = [_run(dec, [PROMPTS[i]], kw, [SEEDS[i]])[0] for i in range(len(PROMPTS))]
    assert batched != alone


def test_auto_depth_may_follow_timing_under_coupled(coupled_models, reference, monkeypatch):
    rng = random.Random(0)
    monkeypatch.setattr(DepthController, "choose", lambda self, regime: rng.randint(0, self.max_depth))
    dec = _decoder(coupled_models, "auto")
    assert _run(dec, PROMPTS, SAMPLING["t1"], SEEDS) == reference["t1"]
    assert len(set(dec.last_stats.depths)) > 1


def test_greedy_requests_are_unchanged(coupled_models):
    coupled = _decoder(coupled_models, "tree_5_4_8")
    plain = SpecDecoder(coupled_models["target"], coupled_models["eagle"], num_steps=5, topk=4, num_draft_tokens=8)
    assert _run(coupled, PROMPTS, {}, None) == _run(plain, PROMPTS, {}, None)


def test_seed_none_draws_one_seed_per_request(coupled_models):
    dec = _decoder(coupled_models, "chain")
    torch.manual_seed(0)
    first = _run(dec, PROMPTS, SAMPLING["t1"], None)
    torch.manual_seed(0)
    assert _run(dec, PROMPTS, SAMPLING["t1"], None) == first
    assert len({tuple(t) for t in first}) == len(first)


@pytest.mark.parametrize("name", ["tree_5_4_8", "chain_lookup", "lookup_only", "eagle3"])
def test_one_host_sync_per_step_under_coupled(coupled_models, host_reads, name):
    """The noise, coupled drafts and coupled verification read nothing back: one host copy per step."""
    dec = _decoder(coupled_models, name)
    dec.generate([[7, 7, 7, 7], [1, 2, 1, 2, 1, 2]], max_new_tokens=12, temperature=[1.0, 0.7], seed=[3, 4],
                 ignore_eos=True)
    steps = 1 + len(dec.last_stats.step_s)
    assert host_reads == ["tolist"] * steps
