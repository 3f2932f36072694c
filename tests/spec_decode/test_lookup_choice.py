"""``spec_decode.lookup_choice``: the draft count of a ``lookup_tokens="auto"`` step from costs and pass rate."""
from __future__ import annotations

import pytest

from conftest import AVX2_LIKE, FLAT
from spec_decode.lookup_choice import (LookupAuto, LookupPassRate, choose_lookup_drafts, expected_tokens,
                                      nondecreasing_fit, relative_to_one_row)

ROWS = range(1, 13)   # a lookup step of up to 11 drafts, as spec-bench's eagle3_lookup


def costs_of(curve) -> dict[int, float]:
    return {n: curve(n) / curve(1) for n in ROWS}


def always_the_most(costs, pass_rate, max_drafts):
    """A mutant that ignores the costs: every step verifies the cap."""
    return max_drafts


def follows_the_costs(choose) -> bool:
    """The rule's checks on synthetic curves: True when ``choose`` passes them all."""
    return (choose(costs_of(AVX2_LIKE), 0.9, 11) <= 5       # a block past 6 rows costs two steps: stay in one
            and choose(costs_of(AVX2_LIKE), 1.0, 11) <= 5   # even when every draft passes
            and choose(costs_of(FLAT), 0.9, 11) == 11       # one flat block up to 12 rows: fill it
            and choose(costs_of(FLAT), 0.2, 11) <= 2)       # few drafts pass: few are verified


def test_the_choice_follows_the_cost_curve():
    assert follows_the_costs(choose_lookup_drafts)


def test_a_chooser_that_ignores_the_costs_is_caught():
    assert not follows_the_costs(always_the_most)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("curve", [AVX2_LIKE, FLAT, lambda n: n ** 0.5], ids=["avx2", "flat", "sqrt"])
def test_the_choice_is_the_best_rate_by_brute_force(curve, p):
    costs = costs_of(curve)
    rates = {n: expected_tokens(n, p) / costs[n + 1] for n in range(1, 12)}
    best = max(rates.values())
    assert choose_lookup_drafts(costs, p, 11) == min(n for n, r in rates.items() if r == best)


def test_the_choice_stays_within_the_measured_rows_and_the_cap():
    costs = costs_of(FLAT)
    assert choose_lookup_drafts(costs, 1.0, 64) == 11   # no cost for 13 rows: 11 drafts at most
    assert choose_lookup_drafts(costs, 1.0, 4) == 4
    with pytest.raises(ValueError, match="costs"):
        choose_lookup_drafts({1: 1.0}, 0.5, 4)


def test_expected_tokens():
    assert expected_tokens(0, 0.5) == 1
    assert expected_tokens(3, 0.5) == pytest.approx(1.875)
    assert expected_tokens(5, 1.0) == 6


def test_the_pass_rate_counts_passes_and_first_failures_per_regime():
    rate = LookupPassRate()
    prior = rate.rate("greedy")
    rate.record("greedy", 4, [5, 5, 5])   # every draft of 3 requests passed
    assert rate.rate("greedy") > prior and rate.rate("sampled") == prior
    rate.record("sampled", 4, [1, 1])     # the first draft failed, twice
    assert rate.rate("sampled") < prior
    assert (rate.passes, rate.tries) == ({"greedy": 12, "sampled": 0}, {"greedy": 12, "sampled": 2})
    rate.record("greedy", 4, [3])         # 2 passes, then a failure
    assert (rate.passes["greedy"], rate.tries["greedy"]) == (14, 15)


def test_lookup_auto_calibrates_once_and_chooses_from_its_pass_rate(verify_cost_curve, tiny_target):
    calls = verify_cost_curve(AVX2_LIKE)
    auto = LookupAuto(11)
    with pytest.raises(RuntimeError, match="calibrate"):
        auto.choose("greedy")
    costs = auto.calibrate(tiny_target)
    assert auto.calibrate(tiny_target) is costs and sorted(costs) == list(ROWS)
    assert len(calls) == 2   # the warm-up pass and the timed one, once
    assert auto.choose("greedy") <= 5 and auto.last_drafts == auto.choose("greedy")
    auto.costs = costs_of(FLAT)   # each row costs a little: only drafts likely to pass are worth it
    assert auto.choose("greedy") > 1
    for _ in range(20):
        auto.pass_rate.record("greedy", 1, [1])   # every first draft fails
    assert auto.choose("greedy") == 1 and auto.choose("sampled") > 1


def test_the_fit_pools_dips_and_keeps_a_rising_curve():
    rising = {1: 1.0, 2: 1.1, 3: 1.1, 4: 1.5}
    assert nondecreasing_fit(rising) == rising
    fitted = nondecreasing_fit({1: 1.0, 2: 1.44, 3: 1.39, 4: 1.31, 5: 1.7})
    assert fitted == pytest.approx({1: 1.0, 2: (1.44 + 1.39 + 1.31) / 3, 3: (1.44 + 1.39 + 1.31) / 3,
                                    4: (1.44 + 1.39 + 1.31) / 3, 5: 1.7})
    noisy = {n: c for n, c in zip(range(1, 13), (1, 1.14, 1.4, 1.2, 1.63, 1.47, 1.85, 2.08, 2.18, 2.3, 2.42, 2.75))}
    values = list(nondecreasing_fit(noisy).values())
    assert values == sorted(values) and sum(values) == pytest.approx(sum(noisy.values()))   # least squares keeps the mean


def test_lookup_auto_never_chases_a_block_that_timed_fast(verify_cost_curve, tiny_target):
    """A measured dip (6 rows timing faster than 5) is noise: the raw curve's choice lands on it; the decoder's
    costs are the fitted curve, where no block costs less than a smaller one."""
    dip = lambda n: {5: 1.6, 6: 1.3}.get(n, 1.0 + 0.3 * (n - 1) if n < 5 else 2.0 + 0.2 * (n - 7))   # noqa: E731
    verify_cost_curve(dip)
    raw = {n: dip(n) / dip(1) for n in ROWS}
    assert choose_lookup_drafts(raw, 0.95, 11) == 5   # the dip wins on the raw curve
    auto = LookupAuto(11)
    costs = auto.calibrate(tiny_target)
    assert list(costs.values()) == sorted(costs.values()) and costs[6] > raw[6]   # the dip is pooled away


def test_costs_stay_relative_to_one_row_when_two_rows_timed_faster(verify_cost_curve, tiny_target):
    """Noise can time a 2-row block below one row; the fit pools them below 1.0, and the decoder's costs are
    divided back to ``c(1) == 1.0`` (results.json's contract) without changing the choice."""
    fast_two = lambda n: {1: 1.0, 2: 0.9}.get(n, 1.0 + 0.1 * n)   # noqa: E731
    verify_cost_curve(fast_two)
    pooled = nondecreasing_fit({n: fast_two(n) for n in ROWS})
    assert pooled[1] == pytest.approx(0.95)   # what the fit alone gives
    costs = LookupAuto(11).calibrate(tiny_target)
    assert costs[1] == 1.0 and costs == pytest.approx(relative_to_one_row(pooled))
    assert list(costs.values()) == sorted(costs.values())
    for p in (0.2, 0.6, 0.95):
        assert choose_lookup_drafts(costs, p, 11) == choose_lookup_drafts(pooled, p, 11)
