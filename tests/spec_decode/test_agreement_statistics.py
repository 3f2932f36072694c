"""The agreement stage's statistics (fixtures/fixtures_metrics.py): a head's step-1 agreement with its
standard error over prompts, and two heads' paired difference, each against hand-computed values and
against simulated evaluations, where the error a head would report with positions taken as independent
is caught far too small."""
from __future__ import annotations

import random
import statistics

import pytest

from tiny_models import load_smollm2_heads_script


@pytest.fixture(scope="module")
def metrics():
    load_smollm2_heads_script()   # puts fixtures/ on sys.path
    import fixtures_metrics

    return fixtures_metrics


def test_agreement_and_its_error_by_hand(metrics):
    counts = [("a", 8, 10), ("b", 2, 10), ("c", 5, 10)]
    # p = 15 / 30; residuals 3, -3, 0; sqrt(3 / 2 * 18) / 30
    assert metrics.agreement_with_error(counts) == {"step1_agreement": 0.5, "positions": 30,
                                                    "standard_error": round(27 ** 0.5 / 30, 4)}
    assert metrics.agreement_with_error(counts[:1])["standard_error"] is None   # one prompt: no spread to see


def test_paired_difference_by_hand(metrics):
    head = [("a", 8, 10), ("b", 2, 10), ("c", 5, 10)]
    base = [("a", 6, 10), ("b", 2, 10), ("c", 4, 10)]
    # d = 2, 0, 1; difference 3 / 30; residuals 1, -1, 0; sqrt(3 / 2 * 2) / 30
    error = round(3 ** 0.5 / 30, 4)
    assert metrics.paired_difference(head, base) == {"difference": 0.1, "standard_error": error,
                                                     "z": round(0.1 / error, 2)}
    assert metrics.paired_difference(head, head) == {"difference": 0.0, "standard_error": 0.0, "z": None}
    with pytest.raises(ValueError, match="different prompts or positions"):
        metrics.paired_difference(head, base[:2])


def _evaluations(rng: random.Random, prompts: int = 10, positions: int = 128, gain: float = 0.01):
    """One simulated evaluation set: each prompt its own difficulty (the spread that makes positions of a
    prompt alike), a baseline head, and a candidate that agrees ``gain`` more often on every position."""
    head, base = [], []
    for i in range(prompts):
        p = min(0.95, max(0.05, rng.gauss(0.55, 0.15)))
        b = c = 0
        for _ in range(positions):
            u = rng.random()
            b += u < p
            c += u < p + gain
        head.append((str(i), c, positions))
        base.append((str(i), b, positions))
    return head, base


def test_the_errors_match_the_spread_of_repeated_evaluations_and_independent_positions_do_not(metrics):
    """Over 400 simulated evaluation sets, the mean reported error is the actual spread of the estimates
    (within 15%), for the agreement and for the paired difference; the binomial error of positions taken
    as independent (a wrong implementation) is less than half the agreement's actual spread."""
    rng = random.Random(0)
    runs = [_evaluations(rng) for _ in range(400)]
    own = [metrics.agreement_with_error(head) for head, _ in runs]
    spread = statistics.stdev(o["step1_agreement"] for o in own)
    assert statistics.fmean(o["standard_error"] for o in own) == pytest.approx(spread, rel=0.15)
    naive = statistics.fmean((o["step1_agreement"] * (1 - o["step1_agreement"]) / o["positions"]) ** 0.5 for o in own)
    assert naive < 0.5 * spread
    pairs = [metrics.paired_difference(head, base) for head, base in runs]
    spread = statistics.stdev(p["difference"] for p in pairs)
    assert statistics.fmean(p["standard_error"] for p in pairs) == pytest.approx(spread, rel=0.15)
    # pairing is what makes a one-point gain visible: the unpaired error of the difference is far larger
    unpaired = statistics.fmean((metrics.agreement_with_error(h)["standard_error"] ** 2
                                 + metrics.agreement_with_error(b)["standard_error"] ** 2) ** 0.5 for h, b in runs)
    assert unpaired > 5 * spread


def test_a_candidate_ships_when_higher_everywhere_and_clearly_on_one_set(metrics):
    up = {"difference": 0.004, "standard_error": 0.004, "z": 1.0}
    clear = {"difference": 0.01, "standard_error": 0.004, "z": 2.5}
    down = {"difference": -0.001, "standard_error": 0.004, "z": -0.25}
    assert metrics.candidate_ships({"humaneval": clear, "chat": up, "chat_unseen_topics": up})
    assert not metrics.candidate_ships({"humaneval": up, "chat": up, "chat_unseen_topics": up})   # nothing clear
    assert not metrics.candidate_ships({"humaneval": clear, "chat": clear, "chat_unseen_topics": down})
    assert not metrics.candidate_ships({"humaneval": {"difference": 0.0, "standard_error": 0.0, "z": None}})
    assert not metrics.candidate_ships({})
