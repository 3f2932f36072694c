"""Choosing the drafting depth of each step under ``num_steps="auto"``: ``DepthController``."""

from __future__ import annotations

import math
import statistics
from collections import deque

from samplers import SamplingParams


def sampling_regime(sampling: SamplingParams) -> str:
    """Acceptance differs between greedy and sampled batches; the controller keeps them apart."""
    return "greedy" if sampling.all_greedy else "sampled"


class DepthController:
    """Chooses the drafting depth of each step (``num_steps="auto"``), down to 0: a plain target step.

    It keeps, per regime (all-greedy batches vs batches with sampled requests):

    * **step costs measured side by side.** A shared machine's speed drifts within minutes and
      jitters from step to step by more than neighbouring depths differ (docs/performance.md has
      the figures). So costs are never compared across time: every probe (a step at a depth other
      than the current choice) is compared with the steps at the choice just before and just
      after it, as ``log(t_probe / mean(t_before, t_after))``. Between drafting depths, each such
      ratio over the depth difference is one sample of the cost's slope per depth (a depth adds
      one drafter call and one verify row, so a step's log cost is close to linear in its
      depth); the slope is the median of the last ``cost_window`` samples, so one step slowed by
      a neighbour's burst moves nothing. A plain step's cost relative to the drafting depths
      comes the same way from plain steps next to drafting ones;
    * the acceptance survival ``P(accepted drafts >= j)``, from a per-level pass rate: a step run at
      depth ``d`` that accepted ``a`` drafts passed levels ``1..a`` and, if ``a < d``, failed level
      ``a + 1``; levels above ``d`` are unobserved (censored), so every depth's data counts. A level
      seen rarely leans on the pooled rate of all levels (``_DepthStats.pass_rates``).

    Each step it picks the depth with the best expected tokens per unit of cost,
    ``(1 + sum_{j<=d} P(A >= j)) / c(d)``. Exploration: the first steps run the deepest depth
    (acceptance data for every level), a plain step, and depth 1; their times seed the slope and
    the plain step's cost. Plain steps are not chosen before ``MIN_FIRST_LEVEL_TRIES`` drafted
    steps (until then the best drafting depth runs). Then a neighbour of the current choice runs
    once every ``probe_every`` steps, the depth above and the depth below in turn (one direction at
    the ends; from plain steps, the best drafting depth, whose steps observe every level); the interval
    doubles (up to ``4 * probe_every``) while probes leave the choice unchanged and resets when it
    changes. Near the best depth the rate is flat, so a probe costs little. A depth's first timed
    step is not used (its first calls at new shapes build their kernels, so it runs slow).
    A step whose time the decoder marks unrepresentative (``seconds=None``: it caught up a backlog)
    runs again at the same depth right after, so that a probe after plain steps still gets timed.
    Statistics persist across ``generate`` calls.
    """

    def __init__(self, max_depth: int, probe_every: int = 8, cost_window: int = 15):
        self.max_depth, self.probe_every, self.cost_window = max_depth, probe_every, cost_window
        self._stats: dict[str, _DepthStats] = {}

    def _state(self, regime: str) -> "_DepthStats":
        return self._stats.setdefault(regime, _DepthStats(self.max_depth, self.probe_every, self.cost_window))

    def choose(self, regime: str) -> int:
        st = self._state(regime)
        st.steps += 1
        return self._pick(st)

    def _pick(self, st: "_DepthStats") -> int:
        for depth in (self.max_depth, 0, 1):   # exploration: the deepest depth, a plain step, depth 1
            if depth <= self.max_depth and st.seed_time[depth] is None:
                return depth
        if st.retime is not None:   # the last step at this depth was not timed: time it now
            depth, st.retime = st.retime, None
            return depth
        rates = st.log_rates()   # once per step: it takes the medians of the cost samples
        best = _best_depth(rates)
        if best == 0 and st.tries[1] < MIN_FIRST_LEVEL_TRIES:   # too few drafts seen to give up drafting
            best = _best_depth(rates, drafting=True)
        if best != st.last_best:
            st.last_best, st.interval, st.next_probe = best, self.probe_every, st.steps + self.probe_every
        if st.steps >= st.next_probe:
            st.interval = min(2 * st.interval, 4 * self.probe_every)
            st.next_probe = st.steps + st.interval
            return st.neighbour(best, rates)
        return best

    def record(self, depth: int, seconds: float | None, emitted: list[int], regime: str) -> None:
        """One step's outcome: its depth, wall time, and tokens emitted per request.

        ``seconds=None``: acceptance only. The decoder passes it for a step whose drafter catch-up
        fed more tokens than one step can emit (the first step after the prefill, or after a run of
        plain steps): such a step costs more than its depth does in steady state, and recording it
        would keep the controller away from that depth (and, after plain steps, from drafting).
        """
        st = self._state(regime)
        if seconds is not None:
            st.observe(depth, seconds)
        else:
            st.previous = st.pending = None   # no side-by-side comparison across an untimed step
            if depth > 0:
                st.retime = depth   # run it once more, now without the backlog, so that probes count
        if depth == 0:
            return
        for n in emitted:
            accepted = n - 1
            for level in range(1, min(accepted, depth) + 1):
                st.tries[level] += 1
                st.passes[level] += 1
            if accepted < depth:
                st.tries[accepted + 1] += 1


PRIOR_TRIES = 8   # pseudo-tries that pull a level's pass rate towards the pooled rate
# Drafted steps seen before plain steps may be chosen: even a good drafter misses most of its first
# few drafts now and then, and plain steps observe no acceptance to correct that guess.
MIN_FIRST_LEVEL_TRIES = 12


class _DepthStats:
    def __init__(self, max_depth: int, probe_every: int, cost_window: int):
        self.max_depth = max_depth
        self.last_best, self.interval, self.next_probe = -1, probe_every, 0
        self.probe_up = False   # the next probe's direction (flipped before each probe)
        self.retime: int | None = None   # a depth whose last step was not timed
        self.warm = [False] * (max_depth + 1)   # a depth's first timed step has run (and was not used)
        self.seed_time: list[float | None] = [None] * (max_depth + 1)   # exploration: first used time
        self.previous: tuple[int, float] | None = None   # the last timed step: (depth, seconds)
        self.pending: tuple[int, float, int, float] | None = None   # a probe awaiting its after-step
        self.slopes: deque = deque(maxlen=cost_window)   # log cost per depth, between drafting depths
        self.plain: deque = deque(maxlen=cost_window)    # (log c(0) - log c(d), d) samples, d >= 1
        self.tries = [0] * (max_depth + 1)
        self.passes = [0] * (max_depth + 1)
        self.steps = 0

    def observe(self, depth: int, seconds: float) -> None:
        """A timed step: seeds exploration, completes a pending probe, or opens one."""
        if not self.warm[depth]:
            self.warm[depth] = True
            self.previous = None
            return
        if self.seed_time[depth] is None:
            self.seed_time[depth] = seconds
            if all(self.seed_time[d] is not None for d in (0, 1, self.max_depth) if d <= self.max_depth):
                self._seed()
        if self.last_best < 0:   # still exploring
            self.previous = (depth, seconds)
            return
        best = self.last_best
        if depth == best:
            if self.pending is not None:
                probe, t_probe, ref, t_before = self.pending
                if ref == best:
                    self._relate(probe, ref, math.log(t_probe / ((t_before + seconds) / 2)))
                self.pending = None
        elif self.previous is not None and self.previous[0] == best:
            self.pending = (depth, seconds, best, self.previous[1])
        self.previous = (depth, seconds)

    def _seed(self) -> None:
        """First relations from the exploration's times (taken a few steps apart)."""
        t = self.seed_time
        if self.max_depth > 1:
            self._relate(self.max_depth, 1, math.log(t[self.max_depth] / t[1]))
        self._relate(0, 1, math.log(t[0] / t[1]))

    def _relate(self, a: int, b: int, log_ratio: float) -> None:
        """Record ``log c(a) - log c(b) = log_ratio``."""
        if a == b:
            return
        if a > 0 and b > 0:
            self.slopes.append(log_ratio / (a - b))
        elif a == 0:
            self.plain.append((log_ratio, b))
        else:
            self.plain.append((-log_ratio, a))

    def slope(self) -> float:
        """Log cost per depth between drafting depths (>= 0: a deeper step is never cheaper)."""
        return max(0.0, statistics.median(self.slopes)) if self.slopes else 0.0

    def log_costs(self) -> list[float]:
        """log c(d) for every depth, relative to depth 1 (log c(1) = 0)."""
        k = self.slope()
        plain = statistics.median(r + k * (d - 1) for r, d in self.plain) if self.plain else 0.0
        return [plain] + [k * (d - 1) for d in range(1, self.max_depth + 1)]

    def neighbour(self, best: int, rates: list[float]) -> int:
        """The depth to probe next: above and below ``best`` in turn (one direction at the ends).

        From plain steps (``best == 0``) the probe is the best drafting depth by ``rates``
        (``log_rates()``) instead of depth 1: plain steps observe no acceptance, and depth 1 only its
        first level, so a low early guess of the pass rates would never be corrected.
        """
        self.probe_up = not self.probe_up
        if best == 0:
            return _best_depth(rates, drafting=True)
        if best == self.max_depth or not self.probe_up:
            return best - 1
        return best + 1

    def pass_rates(self) -> list[float]:
        """P(level j passes | level j - 1 did), j = 1..max_depth, each level's rate shrunk towards
        the pooled rate of all levels by ``PRIOR_TRIES`` pseudo-tries. The deep levels are tried
        only at the deep depths: a shallow choice observes them rarely, and a rate from a few tries
        (or a coin-flip prior) would keep it shallow; the levels' rates are alike (a drafter is
        about as good at each depth), so the pooled rate is the better guess until they are seen."""
        pooled = (sum(self.passes) + 1) / (sum(self.tries) + 2)
        return [(self.passes[j] + PRIOR_TRIES * pooled) / (self.tries[j] + PRIOR_TRIES)
                for j in range(1, self.max_depth + 1)]

    def log_rates(self) -> list[float]:
        """log(expected tokens per step / cost) at every depth 0..max_depth (up to a constant)."""
        logs = self.log_costs()
        rates = [-logs[0]]
        survive, expected = 1.0, 1.0
        for d, rate in enumerate(self.pass_rates(), start=1):
            survive *= rate
            expected += survive
            rates.append(math.log(expected) - logs[d])
        return rates


def _best_depth(rates: list[float], drafting: bool = False) -> int:
    """The depth of the highest of ``log_rates()`` (ties: the shallowest); ``drafting``: not a plain step."""
    return max(range(1 if drafting else 0, len(rates)), key=rates.__getitem__)
