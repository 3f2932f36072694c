"""Hostile input to ``SpecDecoder``: each probe gives a ValueError naming the argument, or the documented result."""
from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

from spec_decode import SpecDecoder
from spec_decode.step import StepHooks

PROMPTS = [[1, 2, 3, 4, 5], [7, 8]]
TREE = dict(num_steps=3, topk=3, num_draft_tokens=7)


def _eagle(random_models, **kw):
    return SpecDecoder(random_models["target"], random_models["eagle"], method="eagle", **{**TREE, **kw})


@pytest.mark.parametrize("prompts, kw, match", [
    (PROMPTS, dict(max_new_tokens=math.inf), "max_new_tokens"),
    (PROMPTS, dict(max_new_tokens=2.5), "max_new_tokens"),
    (PROMPTS, dict(max_new_tokens="8"), "max_new_tokens"),
    ([list(range(1, 90)) * 12], dict(max_new_tokens=4), "max_position_embeddings"),
    (PROMPTS, dict(max_new_tokens=4, request_ids=["a", "a"]), "unique"),
    (PROMPTS, dict(max_new_tokens=4, request_ids="ab"), "request_ids"),
    (PROMPTS, dict(max_new_tokens=4, request_ids=["a"]), "request_ids"),
    (PROMPTS, dict(max_new_tokens=4, seed=-1), "seed"),
    (PROMPTS, dict(max_new_tokens=4, seed=[1]), "seed"),
    (PROMPTS, dict(max_new_tokens=4, seed="7"), "seed"),
    (PROMPTS, dict(max_new_tokens=4, stop_token_ids="0"), "stop_token_ids"),
    (PROMPTS, dict(max_new_tokens=4, stop_token_ids=[0.5]), "stop_token_ids"),
    (PROMPTS, dict(max_new_tokens=4, temperature=math.inf), "temperature"),
    (PROMPTS, dict(max_new_tokens=4, temperature=[0.0, math.nan]), "temperature"),
    ("hello", dict(max_new_tokens=4), "prompt_token_ids"),
    (["ab", "cd"], dict(max_new_tokens=4), r"prompt_token_ids\[0\]"),
    ([[1, True]], dict(max_new_tokens=4), "outside"),
])
def test_bad_generate_inputs_name_the_argument(random_models, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        _eagle(random_models).generate(prompts, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(topk=62, num_draft_tokens=8), "topk"),
    (dict(draft_sampling="beam"), "draft_sampling"),
    (dict(num_steps="deep"), "num_steps"),
    (dict(num_steps=True), "num_steps"),
])
def test_bad_decoder_options_name_the_argument(random_models, kw, match):
    with pytest.raises(ValueError, match=match):
        SpecDecoder(random_models["target"], random_models["eagle3"], method="eagle3", **{**TREE, **kw})


def test_a_drafter_of_another_method_is_rejected(random_models):
    """An EAGLE-3 head run as EAGLE-1 drafts from the wrong features at half the acceptance."""
    with pytest.raises(ValueError, match="EagleHead"):
        SpecDecoder(random_models["target"], random_models["eagle3"], method="eagle", **TREE)
    with pytest.raises(ValueError, match="Eagle3Head"):
        SpecDecoder(random_models["target"], random_models["eagle"], method="eagle3", **TREE)
    with pytest.raises(ValueError, match="Transformer"):
        SpecDecoder(random_models["target"], random_models["eagle"], method="draft_model", **TREE)


def test_documented_forms_are_accepted(random_models):
    dec = _eagle(random_models)
    out = dec.generate(PROMPTS, max_new_tokens=8, stop_token_ids=0, faults=None, seed=torch.Generator().manual_seed(1),
                       temperature=None, top_k=None, top_p=None)
    assert all(len(r.token_ids) <= 8 and r.finish_reason in ("stop", "length") for r in out)
    assert all(0 not in r.token_ids[:-1] for r in out)   # 0 stops the request where it appears
    out = dec.generate(PROMPTS, max_new_tokens=8.0, stop_token_ids=[[3], []], request_ids=("x", 7))
    assert [r.request_id for r in out] == ["x", "7"]


def test_host_syncs_is_deprecated_in_favour_of_a_measured_count(random_models):
    dec = _eagle(random_models)
    dec.generate(PROMPTS, max_new_tokens=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = dec.last_stats.host_syncs
    assert old == dec.last_stats.host_copies == 1 + len(dec.last_stats.step_s)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


def test_phase_timer_is_deprecated_in_favour_of_the_hooks(random_models):
    from spec_decode.step import no_timer

    dec = _eagle(random_models)
    timer = lambda name: contextlib.nullcontext()   # noqa: E731
    with pytest.warns(DeprecationWarning, match="hooks"):
        dec.phase_timer = timer
    assert dec.hooks.timer is timer
    with pytest.warns(DeprecationWarning, match="hooks.timer"):
        assert dec.phase_timer is timer
    dec.hooks = StepHooks()
    assert dec.hooks.timer is no_timer


def test_the_timer_hook_sees_every_phase_of_a_step(random_models):
    from spec_decode.step import PHASES

    seen = []
    dec = _eagle(random_models)
    dec.hooks = StepHooks(timer=lambda name: (seen.append(name), contextlib.nullcontext())[1])
    dec.generate(PROMPTS, max_new_tokens=6)
    depths = dec.last_stats.depths
    assert len(depths) == len(dec.last_stats.step_s) and depths[0] > 0
    # a plain step (a greedy batch's last, with one token left) has no drafting phase
    expected = [name for d in depths for name in PHASES if d > 0 or name != "drafting"]
    assert seen == expected
