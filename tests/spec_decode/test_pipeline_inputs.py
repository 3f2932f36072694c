"""Hostile input to ``SpecDecoder``: each probe gives a ValueError naming the argument, or the documented result."""
from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

from spec_decode import SpecDecoder, Transformer
from spec_decode.fixtures import EAGLE_SUBDIR, TARGET_SUBDIR
from spec_decode.step import StepHooks

from shipped_models import FX, PROMPT, eagle, needs_fixtures, target  # noqa: F401 (fixtures)

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


# ---------------------------------------------------------------- on the shipped models (issue #51)


# ---------------------------------------------------------------- a temperature that is 0 in float32
@needs_fixtures
@pytest.mark.parametrize("temperature", [1e-46, [1e-46], torch.tensor([1e-46], dtype=torch.float64)],
                         ids=["scalar", "list", "tensor"])
def test_generate_takes_a_vanishing_temperature_as_greedy(target, eagle, temperature):
    """``generate(..., temperature=1e-46)`` returned id 0 (the shipped EOS) with "stop"."""
    dec = SpecDecoder(target, eagle)
    greedy = dec.generate([PROMPT], max_new_tokens=8, temperature=0.0)[0]
    tiny = dec.generate([PROMPT], max_new_tokens=8, temperature=temperature, seed=3)[0]
    assert (tiny.token_ids, tiny.finish_reason) == (greedy.token_ids, greedy.finish_reason)
    assert tiny.token_ids[0] != 0


# ---------------------------------------------------------------- memory that follows the request
@needs_fixtures
def test_auto_depth_checks_the_tree_capacity(target, eagle):
    """``num_steps="auto", num_draft_tokens=300000`` was accepted: the CPU chain holds at most 9 nodes."""
    with pytest.raises(ValueError, match=r"num_draft_tokens must be an int in \[2, 9\] for num_steps='auto'"):
        SpecDecoder(target, eagle, num_steps="auto", num_draft_tokens=300000)
    assert SpecDecoder(target, eagle, num_steps="auto", num_draft_tokens=9).max_steps == 8


@needs_fixtures
@pytest.mark.parametrize("shape, name", [(dict(num_steps=100000, topk=1), "num_steps"),
                                         (dict(num_steps=2, topk=2000, num_draft_tokens=2000), "num_draft_tokens")])
def test_a_tree_past_the_targets_positions_is_refused_before_any_cache(target, eagle, monkeypatch, shape, name):
    """``num_steps=100000`` sized a 1.2 GB cache and drafted past max_position_embeddings (1024)."""
    monkeypatch.setattr(Transformer, "new_cache", lambda *a, **k: pytest.fail("a cache was allocated"))
    with pytest.raises(ValueError, match=f"{name}.*max_position_embeddings \\(1024\\)"):
        SpecDecoder(target, eagle, **shape)


# ---------------------------------------------------------------- numbers too large for their type
@needs_fixtures
@pytest.mark.parametrize("kw, name", [(dict(tree_score_temperature=10**400), "tree_score_temperature"),
                                      (dict(tree_score_temperature=1e-46), "tree_score_temperature"),
                                      (dict(num_steps=10**5000), "num_steps"),
                                      (dict(num_steps=2, topk=10**5000), "topk")],
                         ids=["tst_10**400", "tst_1e-46", "num_steps_10**5000", "topk_10**5000"])
def test_a_decoder_argument_too_large_for_its_type_is_named(target, eagle, kw, name):
    """10**400 raised OverflowError; a 5001-digit int failed formatting its own message."""
    with pytest.raises(ValueError, match=name):
        SpecDecoder(target, eagle, **kw)


@needs_fixtures
@pytest.mark.parametrize("kw, name", [(dict(top_k=2**63), "top_k"), (dict(temperature=10**400), "temperature"),
                                      (dict(top_k=[1, 2**64]), r"top_k\[1\]")], ids=["top_k", "temperature", "list"])
def test_generate_names_a_sampling_argument_too_large_for_its_type(target, eagle, kw, name):
    with pytest.raises(ValueError, match=name):
        SpecDecoder(target, eagle).generate([PROMPT, PROMPT], max_new_tokens=2, **kw)


# ---------------------------------------------------------------- devices
@needs_fixtures
@pytest.mark.parametrize("device", ["meta", "mps", "xpu"])
def test_an_unsupported_device_is_a_value_error_naming_device(device):
    """``device="meta"`` loaded, then ``generate`` raised; mps a RuntimeError, xpu an AssertionError."""
    with pytest.raises(ValueError, match=f"device must be cpu or cuda.*{device}"):
        SpecDecoder.from_pretrained(FX / TARGET_SUBDIR, FX / EAGLE_SUBDIR, device=device)


@needs_fixtures
def test_a_decoder_over_a_meta_model_names_device(target):
    with torch.device("meta"):
        on_meta = Transformer(target.config)
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        SpecDecoder(on_meta, None, method="none")
