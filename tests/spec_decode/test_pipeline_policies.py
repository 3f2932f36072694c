"""The pipeline's NaN policies (guard, abort) and per-request randomness, on small random models.

What must hold: a request's tokens depend only on its own seed, prompt and parameters; ``guard``
sanitizes a partly corrupted row and finishes only a request with a dead row; the other requests
are bit-identical to a run that never had the corrupted one.
"""
from __future__ import annotations

import pytest
import torch

from numerics import NanPolicy
from spec_decode import NanFault, SpecDecoder
from spec_decode.models import Transformer

from shipped_models import PROMPT, eagle, needs_fixtures, target  # noqa: F401 (fixtures)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22]]
TREE = dict(num_steps=3, topk=3, num_draft_tokens=7)
SEEDS = [101, 202, 303, 404]


@pytest.fixture(scope="module")
def models_by_dtype(tmp_path_factory):
    """{"fp32" | "bf16": (random target, its EAGLE head)}: the same weights loaded in each dtype."""
    from tiny_models import make_tiny_eagle, make_tiny_target

    root = tmp_path_factory.mktemp("policy_models")
    tdir = make_tiny_target(root, seed=0)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        target = Transformer.from_pretrained(tdir, dtype=dtype)
        out[name] = (target, make_tiny_eagle(target, root / f"eagle_{name}", seed=1))
    return out


def _decoder(models_by_dtype, dtype="fp32", **kw):
    target, head = models_by_dtype[dtype]
    return SpecDecoder(target, head, method="eagle", **{**TREE, **kw})


def _without(seq, i):
    return [x for j, x in enumerate(seq) if j != i]


def _tokens(results):
    return [r.token_ids for r in results]


def test_guard_is_the_default_policy(models_by_dtype, monkeypatch):
    monkeypatch.delenv("SAFESPEC_NAN_POLICY", raising=False)
    assert _decoder(models_by_dtype).nan_policy is NanPolicy.GUARD
    monkeypatch.setenv("SAFESPEC_NAN_POLICY", "sanitize")
    assert _decoder(models_by_dtype).nan_policy is NanPolicy.SANITIZE


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_guard_sanitizes_a_partial_nan_row_and_continues(models_by_dtype, dtype, caplog):
    clean = _decoder(models_by_dtype, dtype, nan_policy="guard").generate(PROMPTS, max_new_tokens=16)
    fault = NanFault(request=1, step=2, site="target_logits", columns=[3, 50])
    with caplog.at_level("WARNING", logger="safespec.spec_decode"):
        out = _decoder(models_by_dtype, dtype, nan_policy="guard").generate(PROMPTS, max_new_tokens=16, faults=[fault])
    assert out[1].finish_reason == "length" and len(out[1].token_ids) == 16
    events = [(e.step, e.site, e.kind, e.count, e.dead_rows) for e in out[1].nan_events]
    assert events == [(2, "target_logits", "nan", TREE["num_draft_tokens"] * 2, 0)]
    assert all(0 <= t < 97 for t in out[1].token_ids)
    assert _tokens(_without(out, 1)) == _tokens(_without(clean, 1))
    assert [r.getMessage() for r in caplog.records if r.name == "safespec.spec_decode"][0].count("'1'") == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("site", ["target_logits", "kv_cache"])
def test_guard_finishes_only_the_request_with_a_dead_row(models_by_dtype, dtype, site):
    fault = NanFault(request=1, step=2, site=site)
    out = _decoder(models_by_dtype, dtype, nan_policy="guard").generate(PROMPTS, max_new_tokens=16, faults=[fault])
    assert out[1].finish_reason == "nan_abort"
    assert out[1].nan_events[-1].site == "target_logits" and out[1].nan_events[-1].dead_rows > 0
    clean = _decoder(models_by_dtype, dtype, nan_policy="guard").generate(_without(PROMPTS, 1), max_new_tokens=16)
    assert _tokens(_without(out, 1)) == _tokens(clean)
    assert all(r.finish_reason == "length" and not r.nan_events for r in _without(out, 1))


@pytest.mark.parametrize("policy", ["abort", "guard"])
def test_abort_isolation_holds_at_temperature_one(models_by_dtype, policy):
    """Per-request generators: the survivors sample exactly what they sample without the aborted one."""
    kw = dict(max_new_tokens=16, temperature=[1.0, 1.0, 0.7, 1.3], top_p=[None, 0.9, None, 0.95])
    out = _decoder(models_by_dtype, nan_policy=policy).generate(
        PROMPTS, seed=SEEDS, faults=[NanFault(request=1, step=2, site="target_logits")], **kw)
    assert out[1].finish_reason == "nan_abort"
    clean = _decoder(models_by_dtype, nan_policy=policy).generate(
        _without(PROMPTS, 1), seed=_without(SEEDS, 1),
        **{k: _without(v, 1) for k, v in kw.items() if isinstance(v, list)}, max_new_tokens=16)
    assert _tokens(_without(out, 1)) == _tokens(clean)


@pytest.mark.parametrize("draft_sampling", ["auto", "greedy"])
def test_a_request_samples_the_same_tokens_alone_or_in_any_batch(models_by_dtype, draft_sampling):
    dec = _decoder(models_by_dtype, draft_sampling=draft_sampling)
    batched = dec.generate(PROMPTS, max_new_tokens=20, temperature=1.0, seed=SEEDS)
    for i in (0, 2):
        alone = dec.generate([PROMPTS[i]], max_new_tokens=20, temperature=1.0, seed=[SEEDS[i]])
        assert alone[0].token_ids == batched[i].token_ids
    reordered = dec.generate(PROMPTS[::-1], max_new_tokens=20, temperature=1.0, seed=SEEDS[::-1])
    assert _tokens(reordered[::-1]) == _tokens(batched)


def test_seeds_in_every_form(models_by_dtype):
    dec = _decoder(models_by_dtype)
    kw = dict(max_new_tokens=12, temperature=1.0)
    by_int = dec.generate(PROMPTS, seed=5, **kw)
    assert _tokens(by_int) == _tokens(dec.generate(PROMPTS, seed=[5, 6, 7, 8], **kw))   # int: seed + i
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert _tokens(dec.generate(PROMPTS, seed=g1, **kw)) == _tokens(dec.generate(PROMPTS, seed=g2, **kw))
    assert _tokens(dec.generate(PROMPTS, seed=6, **kw)) != _tokens(by_int)


def test_sampled_drafts_are_recorded_and_greedy_rows_are_untouched(models_by_dtype):
    """In a mixed batch the greedy requests still equal plain greedy decoding, under every mode."""
    target, _ = models_by_dtype["fp32"]
    ar = SpecDecoder(target, None, method="none").generate(PROMPTS, max_new_tokens=20)
    for mode in ("auto", "greedy", "sampled"):
        dec = _decoder(models_by_dtype, draft_sampling=mode)
        assert dec.draft_sampling == mode
        out = dec.generate(PROMPTS, max_new_tokens=20, temperature=[0.0, 1.0, 0.0, 1.0], seed=SEEDS)
        assert out[0].token_ids == ar[0].token_ids and out[2].token_ids == ar[2].token_ids


# ---------------------------------------------------------------- what docs/spec_decode.md says of NanEvent


@needs_fixtures
@pytest.mark.parametrize("policy, recorded", [("off", False), ("sanitize", True), ("guard", True)])
def test_every_policy_but_off_records_nan_events(target, eagle, policy, recorded):
    from spec_decode import NanFault

    dec = SpecDecoder(target, eagle, nan_policy=policy)
    fault = NanFault(request=0, step=1, site="target_logits", columns=[3])
    out = dec.generate([PROMPT], max_new_tokens=4, ignore_eos=True, faults=[fault])[0]
    assert bool(out.nan_events) is recorded
