"""Per-row generators: a row's random numbers come only from its own generator, so a
row's output never depends on its batch-mates (present, absent, or in another order)."""

from __future__ import annotations

import pytest
import torch

from samplers import (
    chain_speculative_sampling,
    row_uniform,
    sample,
    sample_without_replacement,
    tree_verify,
)

V = 13
SEEDS = [11, 22, 33, 44]


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _data(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        logits=torch.randn(b, V, generator=g) * 2,
        draft_probs=torch.randn(b, 3, V, generator=g).softmax(-1),
        target_probs=torch.randn(b, 4, V, generator=g).softmax(-1),
        draft_ids=torch.randint(0, V, (b, 3), generator=g),
        tree_logits=torch.randn(b, 7, V, generator=g),
        tree_q=torch.randn(b, 7, V, generator=g).softmax(-1),
        tokens=torch.randint(0, V, (b, 7), generator=g),
    )


# Trees of different shapes per row: row 0 is wide (3 siblings), row 1 deep, row 2 tiny,
# row 3 mixed. A row's draws must not depend on the others' sibling counts or depths.
PARENTS = torch.tensor([
    [-1, 0, 0, 0, 1, 1, 2],
    [-1, 0, 1, 2, 3, 4, 5],
    [-1, 0, -1, -1, -1, -1, -1],
    [-1, 0, 0, 1, 1, 3, 3],
])


def _run(kind, rows, gens):
    d = {k: v[rows] for k, v in _data(len(SEEDS)).items()}
    parents = PARENTS[rows]
    temperature = torch.tensor([0.9, 1.3, 0.7, 1.0])[rows]
    if kind == "sample":
        return (sample(d["logits"], temperature=temperature, top_k=6, generator=gens),)
    if kind == "chain":
        return tuple(chain_speculative_sampling(d["draft_probs"], d["draft_ids"], d["target_probs"], generator=gens))
    if kind == "without_replacement_draws":
        return (sample_without_replacement(d["tree_q"], 4, gens),)
    draft = None if kind == "tree_deterministic" else d["tree_q"]
    sibling = "without_replacement" if kind == "tree_without_replacement" else "with_replacement"
    res = tree_verify(d["tokens"], parents, d["tree_logits"], temperature=temperature, draft_probs=draft,
                      sibling_sampling=sibling, generator=gens, max_depth=6)
    return res.output_token_ids, res.accepted_node_ids, res.num_emitted


KINDS = ["sample", "chain", "without_replacement_draws", "tree_deterministic", "tree_with_replacement",
         "tree_without_replacement"]


@pytest.mark.parametrize("kind", KINDS)
def test_row_output_does_not_depend_on_batch_mates(kind):
    for trial in range(3):  # several steps, so generator states move on between calls
        seeds = [s + 1000 * trial for s in SEEDS]
        full_gens = _gens(seeds)
        full = _run(kind, [0, 1, 2, 3], full_gens)
        for row in range(len(SEEDS)):
            alone_gens = _gens([seeds[row]])
            alone = _run(kind, [row], alone_gens)
            for a, b in zip(full, alone):
                assert torch.equal(a[row], b[0]), f"{kind}: row {row} changed with its batch-mates"
            # same numbers consumed: the generator's state after the call matches too
            assert torch.equal(full_gens[row].get_state(), alone_gens[0].get_state())
        reordered = _run(kind, [3, 1, 0, 2], _gens([seeds[i] for i in (3, 1, 0, 2)]))
        for a, b in zip(full, reordered):
            assert torch.equal(a[[3, 1, 0, 2]], b)


def test_tree_tokens_independent_of_mates_without_max_depth():
    # Without max_depth the loop runs to the batch's deepest tree; a row's tokens still
    # only depend on its own generator.
    d = _data(4)
    full = tree_verify(d["tokens"], PARENTS, d["tree_logits"], temperature=1.0, draft_probs=d["tree_q"],
                       generator=_gens(SEEDS))
    alone = tree_verify(d["tokens"][2:3], PARENTS[2:3], d["tree_logits"][2:3], temperature=1.0,
                        draft_probs=d["tree_q"][2:3], generator=_gens(SEEDS[2:3]))
    assert torch.equal(full.output_token_ids[2, :2], alone.output_token_ids[0])


def test_row_uniform_single_generator_draws_at_once():
    u = row_uniform((3, 4), torch.Generator().manual_seed(5), device="cpu")
    ref = 1.0 - torch.rand((3, 4), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(u, ref) and u.dtype == torch.float64
    assert ((u > 0) & (u <= 1)).all()
    assert row_uniform((2,), None, device="cpu", dtype=torch.float32).dtype == torch.float32


def test_row_uniform_per_row():
    u = row_uniform((2, 5), _gens([1, 2]), device="cpu")
    for r, s in enumerate([1, 2]):
        ref = 1.0 - torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        assert torch.equal(u[r], ref)
    assert row_uniform((0, 5), [], device="cpu").shape == (0, 5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: row_uniform((3, 2), _gens([1, 2]), device="cpu"),
        lambda: row_uniform((2, 2), [torch.Generator(), 7], device="cpu"),
        lambda: sample(torch.randn(3, V), generator=_gens([1, 2])),
        lambda: chain_speculative_sampling(None, torch.zeros(2, 1, dtype=torch.long), torch.rand(2, 2, V),
                                           generator=_gens([1])),
        lambda: tree_verify(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[-1, 0, 0]] * 2),
                            torch.randn(2, 3, V), temperature=1.0, generator=_gens([1, 2, 3])),
        lambda: sample_without_replacement(torch.rand(2, V), 2, _gens([1])),
        lambda: sample(torch.randn(2, V), generator="seed"),
    ],
)
def test_bad_generator_sequence_names_generator(call):
    with pytest.raises(ValueError, match="generator"):
        call()
