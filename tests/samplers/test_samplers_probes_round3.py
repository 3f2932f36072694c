"""Hostile probes, round 3 (issue #51), the samplers' part: a temperature that vanishes in float32, numbers
too large for their type, and meta tensors. Each repro failed before the fix."""

from __future__ import annotations

import pytest
import torch

from samplers import SamplingParams, coupled_sample, coupled_scores, logits_to_probs, sample, tree_verify

LOGITS = torch.tensor([[0.0, 5.0, 1.0]])   # argmax 1; id 0 is what a NaN row used to give
SEEDS, POSITIONS = torch.tensor([7]), torch.tensor([3])
TINY = 1e-46   # > 0 in Python, 0 in float32

# the same temperature as a scalar, a list and a tensor of each float dtype that can hold it
TINY_FORMS = {"scalar": TINY, "list": [TINY], "tensor_f64": torch.tensor([TINY], dtype=torch.float64),
              "tensor_0d_f64": torch.tensor(TINY, dtype=torch.float64)}


def _gen():
    return torch.Generator().manual_seed(0)


SAMPLERS = {
    "sample": lambda t: sample(LOGITS, temperature=t, generator=_gen()),
    "coupled_sample": lambda t: coupled_sample(LOGITS, SEEDS, POSITIONS, temperature=t),
    "coupled_scores": lambda t: coupled_scores(LOGITS, SEEDS, POSITIONS, temperature=t).argmax(-1),
    "logits_to_probs": lambda t: logits_to_probs(LOGITS, temperature=t).argmax(-1),
}


@pytest.mark.parametrize("form", list(TINY_FORMS))
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_a_temperature_that_is_0_in_float32_is_greedy(sampler, form):
    """``sample(..., temperature=1e-46)`` returned id 0 (the scaled logits were 0/0 = NaN); now greedy, as a 0."""
    assert SAMPLERS[sampler](TINY_FORMS[form]).tolist() == [1]


def test_a_vanishing_temperature_gives_the_greedy_one_hot_and_host_facts():
    assert logits_to_probs(LOGITS, temperature=TINY).tolist() == [[0.0, 1.0, 0.0]]
    params = SamplingParams.build(2, [TINY, 0.0])
    assert params.all_greedy and not params.all_sampled and params.temperature.tolist() == [0.0, 0.0]
    mixed = SamplingParams.build(2, [TINY, 1.0])
    assert not mixed.all_greedy and not mixed.all_sampled


def test_tree_verify_takes_a_vanishing_temperature_as_greedy():
    tokens, parents = torch.tensor([[0, 1, 2]]), torch.tensor([[-1, 0, 1]])
    logits = torch.randn(1, 3, 5, generator=_gen())
    greedy = tree_verify(tokens, parents, logits, temperature=0.0)
    tiny = tree_verify(tokens, parents, logits, temperature=TINY, generator=_gen())
    assert torch.equal(greedy.output_token_ids, tiny.output_token_ids)


@pytest.mark.parametrize("temperature", [1e39, [1.0, 1e39], 10**400], ids=["1e39", "list_1e39", "10**400"])
def test_a_temperature_past_float32_is_rejected_naming_it(temperature):
    """Past float32's range a temperature is inf there, as a tensor already was; 10**400 raised OverflowError."""
    with pytest.raises(ValueError, match=r"temperature(\[1\])? must be a finite number >= 0 in float32"):
        sample(torch.zeros(2, 3), temperature=temperature)


@pytest.mark.parametrize("top_k, name", [(2**63, "top_k"), (1e300, "top_k"), ([1, 2**64], r"top_k\[1\]"),
                                         (float("inf"), "top_k"), (10**5000, "top_k")],
                         ids=["2**63", "1e300", "list_2**64", "inf", "10**5000"])
def test_a_top_k_too_large_for_int64_is_rejected_naming_it(top_k, name):
    """These raised "Overflow when unpacking long long", naming nothing."""
    with pytest.raises(ValueError, match=name + r" must be an int in \[0, 2\*\*63\)"):
        sample(torch.zeros(2, 3), top_k=top_k)


def test_the_largest_int64_top_k_still_disables_nothing_it_should_not():
    assert sample(LOGITS, top_k=2**63 - 1, temperature=0.0).tolist() == [1]


META_CALLS = {
    "coupled_sample": lambda m: coupled_sample(m, SEEDS.to("meta"), POSITIONS.to("meta")),
    "coupled_scores": lambda m: coupled_scores(m, SEEDS.to("meta"), POSITIONS.to("meta")),
    "sample": lambda m: sample(m),
    "logits_to_probs": lambda m: logits_to_probs(m),
}


@pytest.mark.parametrize("call", list(META_CALLS))
def test_meta_tensors_are_rejected_naming_the_argument(call):
    """``coupled_sample`` on meta tensors raised "Tensor.item() cannot be called on meta tensors"."""
    with pytest.raises(ValueError, match="logits is a meta tensor"):
        META_CALLS[call](LOGITS.to("meta"))
