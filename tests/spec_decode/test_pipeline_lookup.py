"""``SpecDecoder(lookup_ngram=...)``: steps that verify drafts copied from the requests' contexts."""
from __future__ import annotations

import pytest
import torch

from conftest import AVX2_LIKE, FLAT
from spec_decode import NanFault, SpecDecoder, Transformer
from spec_decode.fixtures import TARGET_SUBDIR, find_fixtures_dir
from spec_decode.lookup import ContextLookup

# Each prompt holds every token of the tiny vocabulary (97), so with lookup_ngram=1 every context has
# lookup drafts at every step (random models rarely accept them: the shipped target's test below does).
PROMPTS = [torch.randperm(97, generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
MAX_NEW = 20


class ScriptedLookup(SpecDecoder):
    """Takes lookup drafts on the scripted steps only (a cycle of bools): any mix of lookup and drafted
    steps, to reach every catch-up pattern (a drafted step after lookup steps catches up on all)."""

    def __init__(self, *args, pattern, **kwargs):
        super().__init__(*args, **kwargs)
        self.pattern = pattern
        self.made: list[bool] = []   # per step: whether it got lookup drafts

    def lookup_drafts(self, state):
        tree = super().lookup_drafts(state) if self.pattern[len(self.made) % len(self.pattern)] else None
        self.made.append(tree is not None)
        return tree


@pytest.fixture(scope="module")
def ar(random_models):
    dec = SpecDecoder(random_models["target"], None, method="none")
    return [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=MAX_NEW)]


def decoder(random_models, method, cls=SpecDecoder, **kw):
    tree = {} if method == "none" else dict(num_steps=3, topk=1, num_draft_tokens=4)
    return cls(random_models["target"], random_models[method], method=method, **{**tree, **kw})


PATTERNS = {"always": [True], "alternate": [True, False], "backlog": [True, True, True, False], "never": [False]}


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model", "none"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_lookup_is_lossless_whatever_the_mix_of_steps(random_models, ar, method, batch, pattern):
    dec = script = decoder(random_models, method, ScriptedLookup, lookup_ngram=1, lookup_tokens=5,
                           pattern=PATTERNS[pattern])
    out = []
    for i in range(0, len(PROMPTS), batch):
        before = len(script.made)
        out += [r.token_ids for r in dec.generate(PROMPTS[i:i + batch], max_new_tokens=MAX_NEW)]
        stats = dec.last_stats
        assert stats.lookup == script.made[before:]
        assert len(stats.lookup) == len(stats.depths) == len(stats.step_s)
        assert stats.host_copies == len(stats.step_s) + 1   # still one host copy per step
    assert out == ar
    # every scripted lookup step got drafts (every token occurred before) but a last step with one token left
    scripted = [PATTERNS[pattern][s % len(PATTERNS[pattern])] for s in range(len(script.made))]
    assert sum(script.made) >= sum(scripted) - len(PROMPTS) // batch and sum(script.made) <= sum(scripted)


def test_a_lookup_step_needs_no_drafter_call(random_models):
    dec = decoder(random_models, "eagle", ScriptedLookup, lookup_ngram=1, lookup_tokens=5, pattern=[True, False])
    calls = []
    forward = dec.drafter.draft_forward
    dec.drafter.draft_forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        dec.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
    finally:
        del dec.drafter.draft_forward
    stats = dec.last_stats
    drafted = [d for d, lookup in zip(stats.depths, stats.lookup) if not lookup and d > 0]
    assert stats.lookup[0] and drafted
    assert len(calls) == sum(drafted)   # each drafted step: its catch-up and depth - 1 calls


def test_lookup_drafts_are_cut_to_the_tokens_left(random_models):
    dec = decoder(random_models, "eagle", lookup_ngram=1, lookup_tokens=8)
    out = dec.generate(PROMPTS[:2], max_new_tokens=4)
    stats = dec.last_stats
    assert stats.lookup[0] and stats.depths[0] == 2   # 3 tokens left after the prefill's: at most 2 drafts
    assert all(len(r.token_ids) == 4 for r in out)
    dec.trim_last_steps = False
    assert [r.token_ids for r in dec.generate(PROMPTS[:2], max_new_tokens=4)] == [r.token_ids for r in out]
    assert dec.last_stats.depths[0] == 4   # untrimmed, still no more drafts than max_new_tokens


def test_a_request_without_drafts_makes_the_step_draft_as_configured(random_models, ar):
    fresh = [30, 31, 32, 33]   # no token repeats
    alone = SpecDecoder(random_models["target"], None, method="none").generate([fresh], max_new_tokens=MAX_NEW)[0]
    assert not ContextLookup(1, fresh + alone.token_ids[:1]).drafts(1)   # its first step has no lookup drafts
    dec = decoder(random_models, "eagle", lookup_ngram=1)
    out = dec.generate([PROMPTS[0], fresh], max_new_tokens=MAX_NEW)
    assert not dec.last_stats.lookup[0]
    assert [r.token_ids for r in out] == [ar[0], alone.token_ids]


@pytest.mark.parametrize("temperature", [1.0, [0.0, 1.0]], ids=["sampled", "mixed"])
def test_batches_with_sampled_requests_never_take_lookup_steps(random_models, temperature):
    dec = decoder(random_models, "eagle", lookup_ngram=1)
    with_lookup = dec.generate(PROMPTS[:2], max_new_tokens=MAX_NEW, temperature=temperature, seed=[1, 2])
    assert not any(dec.last_stats.lookup)
    plain = decoder(random_models, "eagle").generate(PROMPTS[:2], max_new_tokens=MAX_NEW, temperature=temperature,
                                              seed=[1, 2])
    assert [r.token_ids for r in with_lookup] == [r.token_ids for r in plain]


def test_the_depth_controller_is_neither_asked_nor_told_of_lookup_steps(random_models):
    dec = ScriptedLookup(random_models["target"], random_models["eagle"], method="eagle", num_steps="auto", topk=1,
                         num_draft_tokens=5, lookup_ngram=1, pattern=[True, False, False])
    recorded = []   # the lookup flag of each recorded step (record runs after the step's stats)
    record, choose = dec.depth_controller.record, dec.depth_controller.choose
    dec.depth_controller.record = lambda *a: recorded.append(dec.last_stats.lookup[-1]) or record(*a)
    asked = []   # choose's side effects (its step count, probe schedule and retime) belong to drafted steps
    dec.depth_controller.choose = lambda regime: asked.append(regime) or choose(regime)
    dec.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert any(dec.last_stats.lookup) and recorded and not any(recorded)
    assert len(asked) == dec.last_stats.lookup.count(False)


def test_abort_stops_only_the_corrupted_request_at_a_lookup_step(random_models, ar):
    dec = decoder(random_models, "eagle", lookup_ngram=1, nan_policy="abort")
    out = dec.generate(PROMPTS, max_new_tokens=MAX_NEW, faults=[NanFault(request=1, step=1, site="target_logits")])
    assert dec.last_stats.lookup[0]   # step 1 verified lookup drafts
    assert out[1].finish_reason == "nan_abort"
    assert [out[0].token_ids, out[2].token_ids] == [ar[0], ar[2]]


@pytest.mark.parametrize("kw, name", [(dict(lookup_ngram=-1), "lookup_ngram"), (dict(lookup_ngram=1.5), "lookup_ngram"),
                                      (dict(lookup_tokens=0), "lookup_tokens")])
def test_bad_lookup_arguments_are_named(random_models, kw, name):
    with pytest.raises(ValueError, match=name):
        decoder(random_models, "eagle", **kw)


def test_from_pretrained_passes_the_lookup_arguments(safespec_tiny_target_path, safespec_tiny_eagle_path):
    dec = SpecDecoder.from_pretrained(safespec_tiny_target_path, safespec_tiny_eagle_path, dtype=torch.float32,
                                      num_steps=4, topk=1, num_draft_tokens=5, lookup_ngram=3, lookup_tokens=6)
    assert (dec.lookup_ngram, dec.lookup_tokens) == (3, 6)


@pytest.mark.slow
def test_on_the_shipped_target_a_looping_output_is_drafted_by_lookup(safespec_tiny_target_path, safespec_tiny_eagle_path,
                                                                   safespec_tiny_prompts):
    """The shipped target loops on some prompts (`import os` over and over): lookup steps accept deep there,
    and the drafter, caught up on their tokens at the next drafted step, drafts on as before (the same output)."""
    kw = dict(dtype=torch.float32, num_steps=4, topk=1, num_draft_tokens=5)
    prompts = [p["token_ids"] for p in safespec_tiny_prompts[:8]]
    plain = SpecDecoder.from_pretrained(safespec_tiny_target_path, safespec_tiny_eagle_path, **kw)
    lookup = SpecDecoder.from_pretrained(safespec_tiny_target_path, safespec_tiny_eagle_path, lookup_ngram=3,
                                         lookup_tokens=8, **kw)
    steps, tokens, emitted = {}, {}, []
    for name, dec in (("plain", plain), ("lookup", lookup)):
        steps[name], tokens[name] = 0, []
        for p in prompts:
            out = dec.generate([p], max_new_tokens=64)[0]
            steps[name] += len(dec.last_stats.step_s)
            tokens[name].append(out.token_ids)
            if name == "lookup":
                emitted += [n for n, lk in zip(out.accepted_lengths, dec.last_stats.lookup) if lk]
    assert tokens["lookup"] == tokens["plain"]   # greedy fp32: both are ar's
    assert steps["lookup"] < steps["plain"]
    assert len(emitted) > 10 and sum(emitted) / len(emitted) > 3


# ---------------------------------------------------------------- a bounded lookup step on the shipped target
FX = find_fixtures_dir()
needs_fixtures = pytest.mark.skipif(FX is None or not (FX / TARGET_SUBDIR).is_dir(), reason="no shipped fixtures")


@pytest.fixture(scope="module")
def target():
    return Transformer.from_pretrained(FX / TARGET_SUBDIR, dtype=torch.float32)


@needs_fixtures
def test_a_lookup_step_verifies_a_bounded_number_of_drafts(target):
    """``lookup_tokens=10**18`` made each lookup step verify every remaining token."""
    from spec_decode.lookup import MAX_LOOKUP_DRAFTS

    plain = SpecDecoder(target, None, method="none")
    lookup = SpecDecoder(target, None, method="none", lookup_ngram=1, lookup_tokens=10**18)
    prompt = [5, 9, 14] * 4
    want = plain.generate([prompt], max_new_tokens=160, ignore_eos=True)[0].token_ids
    got = lookup.generate([prompt], max_new_tokens=160, ignore_eos=True)[0].token_ids
    assert got == want
    depths = [d for d, was in zip(lookup.last_stats.depths, lookup.last_stats.lookup) if was]
    assert depths and max(depths) <= MAX_LOOKUP_DRAFTS


# ---------------------------------------------------------------- lookup_tokens="auto"
@needs_fixtures
@pytest.mark.parametrize("curve, fits", [(AVX2_LIKE, lambda most: most <= 5), (FLAT, lambda most: most > 5)],
                         ids=["avx2-like", "flat"])
def test_auto_gives_plain_greedy_output_in_blocks_the_costs_pay_for(target, verify_cost_curve, curve, fits):
    """A looping output: most lookup drafts pass. Where a block past 6 rows costs two plain steps the
    steps verify at most 5 drafts; where the cost is nearly flat up to the cap, they verify more."""
    calls = verify_cost_curve(curve)
    plain = SpecDecoder(target, None, method="none")
    auto = SpecDecoder(target, None, method="none", lookup_ngram=1, lookup_tokens="auto", lookup_max_tokens=11)
    assert auto.lookup_costs is None and not calls   # nothing measured at construction
    prompt = [5, 9, 14] * 4
    for _ in range(2):
        want = plain.generate([prompt], max_new_tokens=48, ignore_eos=True)[0].token_ids
        assert auto.generate([prompt], max_new_tokens=48, ignore_eos=True)[0].token_ids == want
    assert len(calls) == 2   # one calibration (its warm-up and timed passes) for both calls
    assert auto.lookup_costs == {n: curve(n) / curve(1) for n in range(1, 13)}
    depths = [d for d, was in zip(auto.last_stats.depths, auto.last_stats.lookup) if was]
    assert depths and fits(max(depths)) and 1 <= auto.lookup_auto.last_drafts <= 11


@pytest.mark.parametrize("pattern", ["always", "alternate"])
def test_auto_is_lossless_with_one_host_read_per_step(random_models, ar, verify_cost_curve, host_reads, pattern):
    verify_cost_curve(AVX2_LIKE)
    dec = decoder(random_models, "eagle", ScriptedLookup, lookup_ngram=1, lookup_tokens="auto",
                  pattern=PATTERNS[pattern])
    assert [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=MAX_NEW)] == ar   # calibrates
    host_reads.clear()
    assert [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=MAX_NEW)] == ar
    stats = dec.last_stats
    assert any(stats.lookup) and stats.host_copies == len(stats.step_s) + 1
    assert host_reads == ["tolist"] * stats.host_copies   # the pass rate reads only the step's host copy
    assert sum(dec.lookup_auto.pass_rate.tries.values()) > 0


def test_auto_leaves_coupled_sampled_output_exact(random_models, verify_cost_curve):
    """Coupled sampling: a sampled request's tokens are a function of its seed and position, whatever the
    drafts; lookup steps serve it, in the blocks the choice gives (a flat curve: the cap)."""
    verify_cost_curve(FLAT)
    prompts, kw = [[7, 7, 7, 7], [1, 2, 1, 2, 1, 2]], dict(temperature=0.3, min_p=0.2, seed=[11, 12], ignore_eos=True)
    want = SpecDecoder(random_models["target"], None, method="none", draft_sampling="coupled").generate(
        prompts, max_new_tokens=MAX_NEW, **kw)
    dec = SpecDecoder(random_models["target"], None, method="none", draft_sampling="coupled", lookup_ngram=1,
                      lookup_tokens="auto")
    got = dec.generate(prompts, max_new_tokens=MAX_NEW, **kw)
    assert any(dec.last_stats.lookup) and dec.lookup_auto.pass_rate.tries.get("sampled")
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@pytest.mark.parametrize("temperature", [1.0, [0.0, 1.0]], ids=["sampled", "mixed"])
def test_auto_takes_no_lookup_step_for_rejection_sampled_batches(random_models, verify_cost_curve, temperature):
    verify_cost_curve(FLAT)
    dec = decoder(random_models, "eagle", lookup_ngram=1, lookup_tokens="auto")
    got = dec.generate(PROMPTS[:2], max_new_tokens=MAX_NEW, temperature=temperature, seed=[1, 2])
    assert not any(dec.last_stats.lookup) and not dec.lookup_auto.pass_rate.tries
    plain = decoder(random_models, "eagle").generate(PROMPTS[:2], max_new_tokens=MAX_NEW, temperature=temperature,
                                                     seed=[1, 2])
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]


def test_auto_without_lookup_steps_measures_nothing(random_models, verify_cost_curve):
    calls = verify_cost_curve(FLAT)
    dec = decoder(random_models, "eagle", lookup_tokens="auto")   # lookup_ngram=0: off
    dec.generate(PROMPTS[:1], max_new_tokens=4)
    assert not calls and dec.lookup_costs is None
    assert decoder(random_models, "eagle", lookup_ngram=1).lookup_costs is None   # a fixed lookup_tokens


@pytest.mark.parametrize("kw, name", [(dict(lookup_tokens="bogus"), "lookup_tokens"),
                                      (dict(lookup_tokens="AUTO"), "lookup_tokens"),
                                      (dict(lookup_tokens=0), "lookup_tokens"),
                                      (dict(lookup_tokens="auto", lookup_max_tokens=0), "lookup_max_tokens"),
                                      (dict(lookup_tokens="auto", lookup_max_tokens="8"), "lookup_max_tokens"),
                                      (dict(lookup_tokens=8, lookup_max_tokens=8), "lookup_max_tokens")])
def test_bad_auto_arguments_are_named(random_models, kw, name):
    with pytest.raises(ValueError, match=name):
        decoder(random_models, "eagle", lookup_ngram=1, **kw)


def test_auto_caps_at_the_library_default_or_lookup_max_tokens(random_models, safespec_tiny_target_path):
    from spec_decode.lookup import MAX_LOOKUP_DRAFTS
    from spec_decode.lookup_choice import AUTO_MAX_LOOKUP_DRAFTS

    assert decoder(random_models, "eagle", lookup_tokens="auto").lookup_max_drafts == AUTO_MAX_LOOKUP_DRAFTS
    assert decoder(random_models, "eagle", lookup_tokens="auto", lookup_max_tokens=10**6).lookup_max_drafts == \
        MAX_LOOKUP_DRAFTS
    dec = SpecDecoder.from_pretrained(safespec_tiny_target_path, method="none", dtype=torch.float32, lookup_ngram=3,
                                      lookup_tokens="auto", lookup_max_tokens=6)
    assert (dec.lookup_tokens, dec.lookup_max_drafts) == ("auto", 6)
