"""``lookup_tokens="auto"``: each lookup step's draft count chosen from this machine's verify costs.

The rule: a lookup step that verifies ``n`` drafts runs a verify block of ``n + 1`` rows, costing
``c(n + 1)`` one-row blocks (``spec_decode.verify_cost``), and emits ``E(n) = sum_{j=0..n} p^j``
tokens in expectation when each draft passes with probability ``p`` given that the ones before it
passed. ``choose_lookup_drafts`` picks the ``n`` in ``1..max_drafts`` with the most expected tokens
per cost, ``E(n) / c(n + 1)``. Where a block grows costly past some row count (an AVX2 CPU's kernel
streams the weights once per smaller block of rows than an AVX-512 one's), the choice stays below
it unless nearly every draft passes; where the cost is flat, it takes the whole flat stretch.

``p`` is measured by the decoder from its own lookup steps (``LookupPassRate``): a step that verified
``d`` drafts of which a request accepted ``a`` saw ``a`` passes, and one failure when ``a < d``. Lookup
drafts pass alike at every level (a context that loops keeps looping), so the levels are pooled, and
the count starts from ``PRIOR_PASS_RATE`` weighted as ``PRIOR_TRIES`` tries. Greedy and sampled
(coupled) batches accept differently and are kept apart, as ``depth.DepthController`` does.
"""

from __future__ import annotations

from typing import Mapping

from spec_decode.verify_cost import measure_verify_costs
AUTO_MAX_LOOKUP_DRAFTS = 16
"""The most drafts a ``lookup_tokens="auto"`` step verifies unless ``lookup_max_tokens`` says otherwise: the
calibration measures every block up to it, and past it a looping context's gain per draft is small."""
PRIOR_PASS_RATE = 0.5   # a coin flip: the first steps' drafts are as likely to pass as not
PRIOR_TRIES = 4         # few, so that a handful of lookup steps outweighs the prior


def expected_tokens(num_drafts: int, pass_rate: float) -> float:
    """``E(n) = sum_{j=0..n} p^j``: the tokens a step that verifies ``n`` drafts emits in expectation."""
    return sum(pass_rate ** j for j in range(num_drafts + 1))


def nondecreasing_fit(costs: Mapping[int, float]) -> dict[int, float]:
    """The least-squares nondecreasing fit of ``costs`` (``{rows: c(rows)}``) over its rows in order, by pooling
    adjacent violators: a block of more rows never does less work, so a dip in a measured curve is timing
    noise, which the choice would otherwise chase (picking the block that happened to time fast)."""
    rows = sorted(costs)
    pools: list[list[float]] = []   # [sum, count] of each run of rows fitted to one value
    for r in rows:
        pools.append([costs[r], 1])
        while len(pools) > 1 and pools[-2][0] * pools[-1][1] > pools[-1][0] * pools[-2][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    fitted = [total / count for total, count in pools for _ in range(int(count))]
    return dict(zip(rows, fitted))


def relative_to_one_row(costs: Mapping[int, float]) -> dict[int, float]:
    """``costs`` divided by its 1-row cost, so ``c(1) == 1.0`` again after a fit that pooled the first rows
    (a 2-row block timing faster than one row). Dividing every cost by one number changes no choice."""
    return {rows: cost / costs[1] for rows, cost in costs.items()}


def choose_lookup_drafts(costs: Mapping[int, float], pass_rate: float, max_drafts: int) -> int:
    """The draft count ``n`` in ``1..max_drafts`` maximizing ``E(n) / c(n + 1)`` (ties: the fewest).

    ``costs``: ``{rows: c(rows)}`` relative to one row (``verify_cost.measure_verify_costs``); row counts
    it lacks are not chosen, so ``n`` stays below the first missing one (``costs`` must hold 2 rows).
    """
    if 2 not in costs:
        raise ValueError(f"costs must hold the cost of a 2-row block, got rows {sorted(costs)}")
    survive, expected = pass_rate, 1.0 + pass_rate   # p^n and E(n), kept as n grows: one pass per step
    best, best_rate = 1, expected / costs[2]
    for n in range(2, max_drafts + 1):
        if n + 1 not in costs:
            break
        survive *= pass_rate
        expected += survive
        if expected / costs[n + 1] > best_rate:
            best, best_rate = n, expected / costs[n + 1]
    return best


class LookupPassRate:
    """Per regime (``depth.sampling_regime``), the lookup drafts' pooled pass rate, shrunk towards the prior."""

    def __init__(self):
        self.passes: dict[str, int] = {}
        self.tries: dict[str, int] = {}

    def record(self, regime: str, drafts: int, emitted: list[int]) -> None:
        """One lookup step of ``drafts`` drafts: ``emitted`` tokens per request (accepted drafts + 1), host ints."""
        passes = sum(n - 1 for n in emitted)
        failures = sum(1 for n in emitted if n - 1 < drafts)
        self.passes[regime] = self.passes.get(regime, 0) + passes
        self.tries[regime] = self.tries.get(regime, 0) + passes + failures

    def rate(self, regime: str) -> float:
        """``(passes + PRIOR_TRIES * PRIOR_PASS_RATE) / (tries + PRIOR_TRIES)`` of ``regime``."""
        return ((self.passes.get(regime, 0) + PRIOR_TRIES * PRIOR_PASS_RATE)
                / (self.tries.get(regime, 0) + PRIOR_TRIES))


class LookupAuto:
    """A decoder's ``lookup_tokens="auto"`` state: the verify costs (measured at the first ``calibrate``),
    the pass rates, and ``last_drafts``, the draft count the last ``choose`` gave."""

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.costs: dict[int, float] | None = None
        self.pass_rate = LookupPassRate()
        self.last_drafts: int | None = None

    def calibrate(self, target) -> dict[int, float]:
        """The costs of blocks of 1 to ``max_drafts + 1`` rows of ``target``: measured (or read from the
        disk cache) at the first call only, then made nondecreasing in the rows (``nondecreasing_fit``) and
        relative to one row again (``relative_to_one_row``)."""
        if self.costs is None:
            measured = measure_verify_costs(target, range(1, self.max_drafts + 2))
            self.costs = relative_to_one_row(nondecreasing_fit(measured))
        return self.costs

    def choose(self, regime: str) -> int:
        """The drafts the next lookup step of a ``regime`` batch may verify (``choose_lookup_drafts``)."""
        if self.costs is None:
            raise RuntimeError("LookupAuto.choose before calibrate: the verify costs are not measured yet")
        self.last_drafts = choose_lookup_drafts(self.costs, self.pass_rate.rate(regime), self.max_drafts)
        return self.last_drafts
