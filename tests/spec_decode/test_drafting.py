"""Tree plumbing: ancestor masks and the EAGLE-2 selection, against plain-Python references."""
from __future__ import annotations

import random

import pytest
import torch

from spec_decode.drafting import ancestor_mask


def _naive_ancestors(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    out = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            out[i][j] = True
            j = parents[j]
    return out


def _random_forest(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(0, i) for i in range(1, n)]


@pytest.mark.parametrize("n", [1, 2, 5, 9, 17])
def test_ancestor_mask_matches_a_naive_walk(n):
    rng = random.Random(n)
    forests = [_random_forest(n, rng) for _ in range(6)] + [list(range(-1, n - 1))]   # + a chain
    got = ancestor_mask(torch.tensor(forests), max(n - 1, 0))   # n - 1 bounds every depth
    assert got.tolist() == [_naive_ancestors(f) for f in forests]


def test_ancestor_mask_of_a_deep_chain_sees_every_ancestor():
    """Depth 6: a doubling hop (hop = hop[hop], an earlier bug) skipped the ancestors 3 and 5 steps up."""
    parents = torch.arange(-1, 6)[None]
    mask = ancestor_mask(parents, 6)
    assert torch.equal(mask[0], torch.tril(torch.ones(7, 7, dtype=torch.bool)))


def test_ancestor_mask_with_padding_nodes():
    parents = torch.tensor([[-1, 0, -1, 1, -1]])          # nodes 2 and 4 are padding
    mask = ancestor_mask(parents, 2)[0]
    assert mask[3].tolist() == [True, True, False, True, False]
    assert mask[2].tolist() == [False, False, True, False, False]
