"""``spec_decode.lookup``: the incremental n-gram index against a brute-force scan of the context."""
from __future__ import annotations

import random

import pytest

from spec_decode.lookup import ContextLookup, check_lookup_args, check_lookup_max


def brute_drafts(ctx: list[int], n: int, k: int) -> list[int]:
    """The module docstring's rule by a backward scan: the latest earlier occurrence of the last n tokens."""
    L = len(ctx)
    if k < 1 or L <= n:
        return []
    for s in range(L - n - 1, -1, -1):   # an occurrence ending before position L - 1 has a token after it
        if ctx[s:s + n] == ctx[L - n:]:
            start, out = s + n, []
            for j in range(k):
                out.append(ctx[start + j] if start + j < L else out[j - (L - start)])
            return out
    return []


def _stop_at_end(ctx, n, k):
    """A wrong rule (drafts stop at the context's end) that the comparison must catch."""
    for s in range(len(ctx) - n - 1, -1, -1):
        if ctx[s:s + n] == ctx[len(ctx) - n:]:
            return ctx[s + n:s + n + k]
    return []


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("alphabet", [2, 3, 7])
def test_drafts_match_a_brute_force_scan_at_every_context_length(n, alphabet):
    rng = random.Random(n * 100 + alphabet)
    for _ in range(20):
        ctx = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        lookup = ContextLookup(n)
        for L in range(len(ctx) + 1):
            for k in (1, 3, 8, 13):
                assert lookup.drafts(k) == brute_drafts(ctx[:L], n, k), (ctx[:L], n, k)
            if L < len(ctx):
                lookup.extend(ctx[L:L + 1])


def test_the_comparison_catches_drafts_that_stop_at_the_context_end():
    lookup = ContextLookup(2, [1, 2, 3, 1, 2, 3])
    assert lookup.drafts(5) == brute_drafts(lookup.tokens, 2, 5) == [1, 2, 3, 1, 2]
    assert _stop_at_end(lookup.tokens, 2, 5) == [1, 2, 3] != lookup.drafts(5)


def test_extend_in_chunks_equals_token_by_token():
    rng = random.Random(7)
    ctx = [rng.randrange(4) for _ in range(60)]
    whole, pieces = ContextLookup(3, ctx), ContextLookup(3)
    i = 0
    while i < len(ctx):
        step = rng.randrange(1, 6)
        pieces.extend(ctx[i:i + step])
        i += step
    assert pieces.tokens == whole.tokens == ctx and len(whole) == len(ctx)
    assert [pieces.drafts(k) for k in range(10)] == [whole.drafts(k) for k in range(10)]


@pytest.mark.parametrize("ctx, n, k, expected", [
    ([1, 2, 3, 1, 2, 3], 2, 5, [1, 2, 3, 1, 2]),        # a loop continues with its period
    ([4, 4, 4], 2, 4, [4, 4, 4, 4]),                    # an occurrence overlapping the suffix: period 1
    ([1, 2, 5, 1, 2, 6, 1, 2], 2, 4, [6, 1, 2, 6]),     # the latest occurrence wins
    ([1, 2, 3, 4], 2, 3, []),                           # the last n-gram never occurred before
    ([1, 2], 2, 3, []),                                 # nothing before the n-gram
    ([1, 2, 1, 2], 2, 0, []),                           # no budget
    ([9, 8, 7, 9, 8], 2, 2, [7, 9]),                    # inside the context: no repetition needed
])
def test_examples(ctx, n, k, expected):
    assert ContextLookup(n, ctx).drafts(k) == expected


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3", None])
def test_ngram_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="ngram must be an int >= 1"):
        ContextLookup(bad)


@pytest.mark.parametrize("ngram, tokens, name", [(-1, 8, "lookup_ngram"), (True, 8, "lookup_ngram"),
                                                  (1.5, 8, "lookup_ngram"), (3, 0, "lookup_tokens"),
                                                  (3, False, "lookup_tokens"), (3, "8", "lookup_tokens"),
                                                  (3, "bogus", "lookup_tokens"), (-1, "auto", "lookup_ngram")])
def test_check_lookup_args_names_the_bad_argument(ngram, tokens, name):
    with pytest.raises(ValueError, match=name):
        check_lookup_args(ngram, tokens)
    assert check_lookup_args(0, 1) == (0, 1)
    assert check_lookup_args(3, "auto") == (3, "auto")


def test_check_lookup_max_caps_auto_only():
    assert check_lookup_max(None, 8) is None and check_lookup_max(11, "auto") == 11
    for bad, tokens in ((0, "auto"), (True, "auto"), (2.0, "auto"), (11, 8)):
        with pytest.raises(ValueError, match="lookup_max_tokens"):
            check_lookup_max(bad, tokens)
