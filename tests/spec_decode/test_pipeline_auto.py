"""``num_steps="auto"``: the depth chooser, and losslessness at every depth it may pick (0 included)."""
from __future__ import annotations

import itertools

import pytest

from spec_decode import SpecDecoder
from spec_decode.pipeline import DepthController

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22]]


@pytest.fixture(scope="module")
def ar(random_models):
    dec = SpecDecoder(random_models["target"], None, method="none")
    return [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=24)]


class Scripted:
    """A stand-in controller that replays fixed depths, to reach every catch-up pattern."""

    def __init__(self, depths):
        self.depths = itertools.cycle(depths)
        self.chosen = []

    def choose(self, regime):
        self.chosen.append(next(self.depths))
        return self.chosen[-1]

    def record(self, *args):
        pass


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
@pytest.mark.parametrize("depths", [[3, 0, 0, 2, 0, 1], [0, 0, 0, 3], [1]], ids=["mixed", "backlog", "shallow"])
def test_any_depth_sequence_is_lossless(random_models, ar, method, depths):
    """Plain steps queue their tokens for the drafter; the next speculative step catches up on all."""
    dec = SpecDecoder(random_models["target"], random_models[method], method=method, num_steps="auto", topk=3,
                      num_draft_tokens=7)
    dec.depth_controller = Scripted(depths)
    out = dec.generate(PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in out] == ar
    ran, chosen = dec.last_stats.depths, dec.depth_controller.chosen
    assert set(depths) <= set(ran)
    # a step runs the chosen depth, or less where the batch cannot use it (its last steps)
    assert len(ran) == len(chosen) and all(r <= c for r, c in zip(ran, chosen))


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_the_last_steps_draft_no_deeper_than_the_tokens_left(random_models, max_new, method):
    """With r tokens left a step drafts at most r - 1 (r = 1: a plain step); the output is AR's."""
    dec = SpecDecoder(random_models["target"], random_models[method], method=method, num_steps=4, topk=1, num_draft_tokens=5)
    plain = SpecDecoder(random_models["target"], None, method="none")
    out = dec.generate([PROMPTS[0]], max_new_tokens=max_new)[0]
    assert out.token_ids == plain.generate([PROMPTS[0]], max_new_tokens=max_new)[0].token_ids
    left = max_new - 1   # the prefill emits the first token
    assert len(dec.last_stats.depths) == len(out.accepted_lengths)
    for depth, emitted in zip(dec.last_stats.depths, out.accepted_lengths):
        assert depth == min(4, left - 1)
        assert emitted <= left
        left -= emitted
    assert left == 0


def test_sampled_requests_keep_their_depth_to_the_end(random_models):
    """The cap would change a sampled request's draws with its batch: sampled batches keep the depth."""
    dec = SpecDecoder(random_models["target"], random_models["eagle"], method="eagle", num_steps=4, topk=1, num_draft_tokens=5)
    dec.generate([PROMPTS[0]], max_new_tokens=7, temperature=1.0, seed=3)
    assert set(dec.last_stats.depths) == {4}
    dec.generate(PROMPTS[:2], max_new_tokens=7, temperature=[0.0, 1.0], seed=3)
    assert set(dec.last_stats.depths) == {4}


def test_a_capped_step_is_not_reported_to_the_controller(random_models):
    dec = SpecDecoder(random_models["target"], random_models["eagle"], method="eagle", num_steps="auto", topk=1,
                      num_draft_tokens=5)
    dec.depth_controller = Recorder([4])
    dec.generate([PROMPTS[0]], max_new_tokens=12)
    ran, chosen = dec.last_stats.depths, dec.depth_controller.chosen
    assert any(r < c for r, c in zip(ran, chosen))   # the request's last steps were capped...
    assert [d for d, _ in dec.depth_controller.records] == [r for r, c in zip(ran, chosen) if r == c]   # ...unrecorded


def test_auto_is_lossless_and_reports_its_mode(random_models, ar):
    dec = SpecDecoder(random_models["target"], random_models["draft_model"], method="draft_model", num_steps="auto", topk=2,
                      num_draft_tokens=6)
    assert dec.num_steps == "auto" and dec.max_steps == 5
    for _ in range(2):   # statistics carry over between calls
        out = dec.generate(PROMPTS, max_new_tokens=24)
        assert [r.token_ids for r in out] == ar
    assert set(dec.last_stats.depths) <= set(range(6))


def test_auto_without_a_drafter_decodes_plainly(random_models, ar):
    """method="none" ignores num_steps="auto": every step is a plain step (it used to crash)."""
    dec = SpecDecoder(random_models["target"], None, method="none", num_steps="auto", num_draft_tokens=4)
    out = dec.generate(PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in out] == ar
    assert set(dec.last_stats.depths) == {0}


def _controller_after(acceptance, step_time, max_depth=4, steps=40):
    """Feed a controller synthetic steps: ``acceptance`` drafts accepted (capped by depth), fixed times."""
    ctl = DepthController(max_depth)
    for _ in range(steps):
        d = ctl.choose("greedy")
        ctl.record(d, step_time(d), [1 + min(acceptance, d)], "greedy")
    return ctl


def test_controller_explores_the_deepest_depth_then_a_plain_step():
    ctl = DepthController(4)
    first = ctl.choose("sampled")
    ctl.record(first, 2.0, [1], "sampled")   # a depth's first timed step is dropped: it runs again
    assert ctl.choose("sampled") == first
    ctl.record(first, 2.0, [1], "sampled")
    second = ctl.choose("sampled")
    assert (first, second) == (4, 0)


def test_controller_drops_to_plain_steps_when_drafts_never_pass():
    ctl = _controller_after(acceptance=0, step_time=lambda d: 1.0 + 0.3 * d)
    picks = [ctl.choose("greedy") for _ in range(15)]
    assert picks.count(0) >= 14   # at most one probe


def test_controller_drafts_deep_when_drafts_always_pass():
    ctl = _controller_after(acceptance=4, step_time=lambda d: 1.0 + 0.2 * d)
    assert ctl.choose("greedy") == 4


def test_controller_balances_acceptance_against_cost():
    # two drafts always pass, the third never: depth 2 gives 3 tokens for 1.4, depth 4 gives 3 for 1.8
    ctl = _controller_after(acceptance=2, step_time=lambda d: 1.0 + 0.2 * d)
    assert ctl.choose("greedy") == 2


def test_controller_keeps_regimes_apart():
    ctl = _controller_after(acceptance=4, step_time=lambda d: 1.0 + 0.2 * d)
    assert ctl.choose("sampled") == 4   # sampled batches start exploring afresh
    for _ in range(2):                  # the first timed step of a depth is dropped
        ctl.record(4, 1.8, [1], "sampled")
    assert ctl.choose("sampled") == 0 and ctl.choose("greedy") == 4


def test_controller_keeps_drafting_past_a_few_early_misses():
    """The first four drafted steps miss at level 1, then every one accepts 3 drafts. Plain steps
    observe no acceptance, so a controller that settled on them after four misses (it used to)
    would learn only from rare probes; it drafts until it has seen enough drafts."""
    cost = lambda d: 1.0 if d == 0 else 1.5 + 0.1 * d   # a drafting step costs 1.5x a plain one and up
    ctl, picks, drafted = DepthController(5), [], 0
    for _ in range(150):
        d = ctl.choose("greedy")
        drafted += d > 0
        accepted = 0 if drafted <= 4 else min(3, d)
        ctl.record(d, cost(d), [1 + accepted], "greedy")
        picks.append(d)
    late = picks[50:]
    assert late.count(3) >= 0.9 * len(late)


def test_controller_probes_its_best_drafting_depth_from_plain_steps():
    """Plain steps win (a drafting step costs 5x one), and the drafts would pay best deep. Probes
    from plain steps go to the best drafting depth, whose steps observe every level, not to depth 1,
    which observes only the first."""
    cost = lambda d: 1.0 if d == 0 else 5.0 + 0.01 * d
    ctl, picks = DepthController(5), []
    for _ in range(300):
        d = ctl.choose("greedy")
        ctl.record(d, cost(d), [1 + min(3, d)], "greedy")
        picks.append(d)
    late = picks[100:]
    assert late.count(0) >= 0.95 * len(late)
    assert set(late) - {0} and set(late) - {0} <= {3, 4, 5}


def test_controller_probes_less_often_while_the_choice_holds():
    # 30 steps: past the drafted steps it must see before it may settle on plain steps
    ctl = _controller_after(acceptance=0, step_time=lambda d: 1.0 + 0.3 * d, steps=30)
    picks = []
    for _ in range(400):
        d = ctl.choose("greedy")
        ctl.record(d, 1.0 + 0.3 * d, [1], "greedy")
        picks.append(d)
    probes = sum(1 for d in picks if d)
    assert 8 <= probes <= 16   # 8, 16, 32, 32 ... steps apart: not one probe every 8 steps (50)


def test_controller_keeps_acceptance_but_not_the_time_of_an_unrepresentative_step():
    ctl = DepthController(4)
    assert ctl.choose("greedy") == 4
    ctl.record(4, None, [5], "greedy")      # the prompt's catch-up: its time says nothing about depth 4
    assert ctl.choose("greedy") == 4        # so depth 4 runs (and is timed) again
    ctl.record(4, 5.0, [5], "greedy")       # a depth's first timed step builds its kernels: not used
    assert ctl.choose("greedy") == 4
    ctl.record(4, 1.8, [5], "greedy")
    assert ctl.choose("greedy") == 0
    for _ in range(2):                      # not used, then used
        ctl.record(0, 1.0, [1], "greedy")
    assert ctl.choose("greedy") == 1        # the shallowest drafting depth: the other end of the line
    for _ in range(2):
        ctl.record(1, 1.2, [1], "greedy")
    st = ctl._stats["greedy"]
    assert st.seed_time == [1.0, 1.2, None, None, 1.8]
    timing = lambda: (list(st.slopes), list(st.plain), st.pending, list(st.seed_time))
    before, tries = timing(), list(st.tries)
    ctl.record(4, None, [1], "greedy")      # untimed: its rejection at level 1 still counts
    assert timing() == before and st.tries[1] == tries[1] + 1 and st.passes[1] == 3
    assert ctl.choose("greedy") == 4        # and the same depth runs again, to be timed
    ctl.record(0, None, [1], "greedy")      # plain steps are never re-run for timing
    assert st.retime is None


class Recorder(Scripted):
    """Scripted depths; keeps what the decoder records."""

    def __init__(self, depths):
        super().__init__(depths)
        self.records = []

    def record(self, depth, seconds, emitted, regime):
        self.records.append((depth, seconds))


def test_decoder_does_not_time_steps_that_catch_up_a_backlog(random_models):
    """The first step (the prompt's catch-up) and the first after plain steps get seconds=None."""
    dec = SpecDecoder(random_models["target"], random_models["eagle"], method="eagle", num_steps="auto", topk=1,
                      num_draft_tokens=3)
    dec.depth_controller = Recorder([2, 2, 0, 0, 0, 2, 2])
    dec.generate([PROMPTS[0]], max_new_tokens=12)
    recs = dec.depth_controller.records
    untimed = [i for i, (_, seconds) in enumerate(recs) if seconds is None]
    assert untimed[0] == 0                                  # the prompt's catch-up
    assert all(recs[i][0] == 2 for i in untimed)            # plain steps are always timed
    assert all(recs[i - 1][0] == 0 for i in untimed[1:])    # later ones follow plain steps
    assert any(d == 2 and s is not None for d, s in recs)


def test_controller_compares_depths_at_the_machine_s_current_speed():
    """A shared machine slows down and speeds up while the controller sits at its choice: every depth
    slows alike, so the choice must hold, apart from one-step probes. A controller that compared
    the current time of its depth with the times the other depths had when they last ran would
    leave it for a while after every slowdown."""
    cost = lambda d: 1.0 + 0.25 * d                   # 2 drafts pass, the 3rd never: depth 2 is best
    ctl = DepthController(4)
    picks = []
    for step in range(1000):
        d = ctl.choose("greedy")
        speed = 1.6 if (step // 20) % 2 else 1.0      # 20 steps at 1.6x the time, 20 at 1x, ...
        ctl.record(d, speed * cost(d), [1 + min(2, d)], "greedy")
        picks.append(d)
    late = picks[60:]
    stays = sum(1 for a, b in zip(late, late[1:]) if a != 2 and b != 2)   # not one-step probes
    assert late.count(2) >= 0.9 * len(late) and stays <= 3


def test_controller_probes_both_sides_of_its_choice():
    """Neighbours above and below are probed in turn, so neither side's cost goes stale."""
    ctl = _controller_after(acceptance=2, step_time=lambda d: 1.0 + 0.2 * d, steps=60)
    picks = []
    for _ in range(200):
        d = ctl.choose("greedy")
        ctl.record(d, 1.0 + 0.2 * d, [1 + min(2, d)], "greedy")
        picks.append(d)
    assert picks.count(2) >= 190 and {1, 3} <= set(picks)


def test_slow_first_steps_at_a_depth_do_not_set_its_cost():
    """The first two steps at each depth run 5x slower (their first calls build kernels for new
    shapes). The first is dropped and the median outvotes the second once the depth has run
    twice more; an average of every timed step would keep the best depth, 3, looking dear for
    hundreds of steps, since probes come ever more rarely."""
    cost = lambda d: 1.0 + 0.25 * d                   # 3 drafts pass, the 4th never: depth 3 is best
    ctl = DepthController(5)
    runs, picks = [0] * 6, []
    for _ in range(400):
        d = ctl.choose("greedy")
        runs[d] += 1
        ctl.record(d, cost(d) * (5 if runs[d] <= 2 else 1), [1 + min(3, d)], "greedy")
        picks.append(d)
    late = picks[100:]
    assert late.count(3) >= 0.9 * len(late)


def test_one_slow_step_does_not_move_the_choice():
    """A neighbour's burst makes the step after a probe 10x slower, so that the probe looks 5x
    cheaper than its neighbours: the median of the slope samples ignores it (their mean would
    turn negative), and the choice holds."""
    cost = lambda d: 1.0 + 0.25 * d                   # 3 drafts pass, the 4th never: depth 3 is best
    ctl = _controller_after(acceptance=3, step_time=cost, max_depth=5, steps=200)
    st = ctl._stats["greedy"]
    slope = st.slope()
    while (d := ctl.choose("greedy")) == 3:           # run to the next probe
        ctl.record(d, cost(d), [4], "greedy")
    ctl.record(d, cost(d), [1 + min(3, d)], "greedy")
    assert ctl.choose("greedy") == 3
    ctl.record(3, 10 * cost(3), [4], "greedy")        # the probe's after-step, in a burst
    assert st.slope() == pytest.approx(slope, rel=0.1)
    picks = []
    for _ in range(30):
        d = ctl.choose("greedy")
        ctl.record(d, cost(d), [1 + min(3, d)], "greedy")
        picks.append(d)
    assert picks.count(3) >= 28   # probes aside
