"""The draft/verify loop on small random models: losslessness, batching, NaN policies, bad input.

Random models accept few EAGLE drafts, so acceptance-heavy paths (tree commits off the first
path, long accepted chains) are exercised with ``method="draft_model"`` and the target as its own
drafter, which proposes exactly the target's greedy tokens. Trained fixtures test acceptance.
"""
from __future__ import annotations

import math

import pytest
import torch

from numerics import NanLogitsError
from spec_decode import NanFault, SpecDecoder
from spec_decode.models import KVCache, Transformer

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22]]
TREE = dict(num_steps=3, topk=3, num_draft_tokens=7)
CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)


def _decoder(random_models, method, drafter=None, **kw):
    if drafter is None and method != "none":
        drafter = random_models[{"eagle": "eagle", "eagle3": "eagle3", "draft_model": "draft"}[method]]
    return SpecDecoder(random_models["target"], drafter, method=method, **kw)


def _tokens(results):
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def ar_greedy(random_models):
    return _tokens(_decoder(random_models, "none").generate(PROMPTS, max_new_tokens=24))


# ------------------------------------------------------------------ greedy losslessness
@pytest.mark.parametrize("shape", [TREE, CHAIN, dict(num_steps=5, topk=4, num_draft_tokens=8)],
                         ids=["tree", "chain", "default"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_greedy_speculative_equals_autoregressive_batched(random_models, ar_greedy, method, shape):
    out = _decoder(random_models, method, nan_policy="raise", **shape).generate(PROMPTS, max_new_tokens=24)
    assert _tokens(out) == ar_greedy
    assert all(r.finish_reason == "length" for r in out)


@pytest.mark.parametrize("shape", [TREE, CHAIN, dict(num_steps=6, topk=1, num_draft_tokens=7)],
                         ids=["tree", "chain", "deep_chain"])
def test_greedy_self_draft_accepts_deep_paths_and_stays_lossless(random_models, ar_greedy, shape):
    """The target drafting for itself: every greedy draft is right, so trees commit deep paths."""
    dec = _decoder(random_models, "draft_model", drafter=random_models["target"], nan_policy="raise", **shape)
    out = dec.generate(PROMPTS, max_new_tokens=24)
    assert _tokens(out) == ar_greedy
    lengths = [n for r in out for n in r.accepted_lengths[:-1]]   # the last step may be cut short
    # A chain's drafts are all right. A tree keeps the best-scored nodes, which need not include
    # the full-depth greedy node, but depth >= 2 means a commit of nodes off the first index path.
    deepest = shape["num_steps"] + 1 if shape["topk"] == 1 else 3
    assert max(lengths) >= deepest
    assert sum(lengths) / len(lengths) > 2.5



def test_greedy_trees_verify_without_the_sampling_walk(random_models, ar_greedy, monkeypatch):
    """All-greedy tree steps go through ``greedy_tree_verify`` with the drafter's mask (lossless, and no
    ``tree_verify`` call); a batch with a sampled request still walks with ``tree_verify``."""
    import spec_decode.step as step   # verify looks the verifiers up in spec_decode.step

    seen = []
    for name in ("greedy_tree_verify", "tree_verify"):
        orig = getattr(step, name)
        monkeypatch.setattr(step, name, lambda *a, _o=orig, _n=name, **k: seen.append(_n) or _o(*a, **k))
    dec = _decoder(random_models, "draft_model", drafter=random_models["target"], **TREE)
    assert _tokens(dec.generate(PROMPTS, max_new_tokens=24)) == ar_greedy
    assert seen and set(seen) == {"greedy_tree_verify"}
    seen.clear()
    dec.generate(PROMPTS, max_new_tokens=8, temperature=[0.0, 1.0, 0.0, 0.0], seed=3)
    assert set(seen) == {"tree_verify"}


@pytest.mark.parametrize("temp", [0.5, 1e-3, 4.0])
def test_greedy_trees_scored_at_any_temperature_stay_lossless(random_models, ar_greedy, temp):
    """tree_score_temperature changes which candidates a greedy tree keeps, never the output."""
    dec = _decoder(random_models, "eagle", nan_policy="raise", num_steps=4, topk=2, num_draft_tokens=6,
                   tree_score_temperature=temp)
    assert dec.tree_score_temperature == temp
    assert _tokens(dec.generate(PROMPTS, max_new_tokens=24)) == ar_greedy


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), None])
def test_a_bad_tree_score_temperature_is_refused_by_name(random_models, value):
    with pytest.raises(ValueError, match="tree_score_temperature"):
        _decoder(random_models, "eagle", **TREE, tree_score_temperature=value)


def test_greedy_single_request_equals_batched(random_models, ar_greedy):
    dec = _decoder(random_models, "eagle", **TREE)
    for i, p in enumerate(PROMPTS):
        assert _tokens(dec.generate([p], max_new_tokens=24)) == [ar_greedy[i]]


def test_requests_finish_independently(random_models, ar_greedy):
    max_new = [3, 24, 10, 1]
    stop = ar_greedy[2][4]
    out = _decoder(random_models, "eagle", **TREE).generate(PROMPTS, max_new_tokens=max_new,
                                                       stop_token_ids=[[], [], [stop], []])
    assert out[0].token_ids == ar_greedy[0][:3] and out[0].finish_reason == "length"
    assert out[1].token_ids == ar_greedy[1] and out[1].finish_reason == "length"
    cut = ar_greedy[2].index(stop) + 1
    assert out[2].token_ids == ar_greedy[2][:cut] and out[2].finish_reason == "stop"
    assert out[3].token_ids == ar_greedy[3][:1] and out[3].accepted_lengths == []


def test_one_host_sync_per_step(random_models, host_reads):
    """Count every tensor->host read during generate: one per step (the prefill included)."""
    dec = _decoder(random_models, "eagle", **TREE)
    dec.generate(PROMPTS, max_new_tokens=12)
    steps = 1 + len(dec.last_stats.step_s)
    assert dec.last_stats.host_copies == steps
    assert host_reads == ["tolist"] * steps


# ------------------------------------------------------------------ sampling
def test_seeded_sampling_is_deterministic(random_models):
    dec = _decoder(random_models, "eagle", **TREE)
    kw = dict(max_new_tokens=16, temperature=[1.0, 0.7, 0.0, 1.3], top_k=[None, 5, None, 0],
              top_p=[1.0, 0.9, 1.0, 0.8], seed=123)
    a, b = dec.generate(PROMPTS, **kw), dec.generate(PROMPTS, **kw)
    assert _tokens(a) == _tokens(b)
    c = dec.generate(PROMPTS, **{**kw, "seed": 124})
    assert _tokens(a) != _tokens(c)


def test_greedy_rows_stay_greedy_in_a_mixed_batch(random_models, ar_greedy):
    out = _decoder(random_models, "eagle", **TREE).generate(PROMPTS, max_new_tokens=24,
                                                      temperature=[0.0, 1.0, 0.0, 1.0], seed=7)
    assert out[0].token_ids == ar_greedy[0] and out[2].token_ids == ar_greedy[2]


# ------------------------------------------------------------------ NaN policies
def _run_with_fault(random_models, policy, fault, method="eagle", prompts=PROMPTS, **kw):
    dec = _decoder(random_models, method, nan_policy=policy, **TREE)
    return dec, dec.generate(prompts, max_new_tokens=16, faults=[fault], **kw)


@pytest.mark.parametrize("site", ["kv_cache", "target_logits"])
@pytest.mark.parametrize("method", ["eagle", "none"])
def test_abort_stops_only_the_corrupted_request(random_models, site, method):
    clean = _decoder(random_models, method, nan_policy="abort", **TREE).generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[3]], max_new_tokens=16)
    _, out = _run_with_fault(random_models, "abort", NanFault(request=1, step=2, site=site), method=method)
    assert out[1].finish_reason == "nan_abort"
    assert [e.site for e in out[1].nan_events] == ["target_logits"]
    assert len(out[1].token_ids) <= 1 + (TREE["num_steps"] + 1 if method == "eagle" else 1)
    # the others: bit-identical tokens to a run that never had the corrupted request
    assert _tokens([out[0], out[2], out[3]]) == _tokens(clean)
    assert all(not r.nan_events for r in (out[0], out[2], out[3]))


def test_abort_zeroes_the_corrupted_kv_slot(random_models, monkeypatch):
    seen = []
    orig = KVCache.reset_slots

    def spy(self, mask):
        seen.append(mask.tolist())
        orig(self, mask)
        assert torch.all(self.k[:, mask] == 0) and torch.all(self.v[:, mask] == 0)

    monkeypatch.setattr(KVCache, "reset_slots", spy)
    _run_with_fault(random_models, "abort", NanFault(request=2, step=1, site="kv_cache"))
    assert seen == [[False, False, True, False]] * 2   # the target's cache and the drafter's


def test_sanitize_keeps_going_and_isolates(random_models, caplog):
    clean = _decoder(random_models, "eagle", **TREE).generate(PROMPTS, max_new_tokens=16)
    with caplog.at_level("WARNING", logger="safespec.spec_decode"):
        _, out = _run_with_fault(random_models, "sanitize", NanFault(request=0, step=1, site="kv_cache"))
    warnings = [r for r in caplog.records if r.name == "safespec.spec_decode"]
    assert len(warnings) == 1 and "['0']" in warnings[0].getMessage()
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 16
    # The poisoned row stays in the cache, so every later step of request 0 is NaN (and so are
    # the EAGLE features its drafter gets): sanitize keeps ids valid, not the text meaningful.
    target_steps = [e.step for e in out[0].nan_events if e.site == "target_logits"]
    assert target_steps == list(range(1, len(out[0].accepted_lengths) + 1))
    assert {e.site for e in out[0].nan_events} == {"target_logits", "draft_logits"}
    assert all(0 <= t < 97 for t in out[0].token_ids)
    assert _tokens(out[1:]) == _tokens(clean[1:])


def test_raise_names_only_the_corrupted_request_and_keeps_partial_results(random_models):
    dec = _decoder(random_models, "eagle", nan_policy="raise", **TREE)
    with pytest.raises(NanLogitsError) as info:
        dec.generate(PROMPTS, max_new_tokens=16, request_ids=["a", "b", "c", "d"],
                     faults=[NanFault(request=2, step=3, site="target_logits")])
    err = info.value
    assert err.nan_counts.keys() == {"c"} and err.nan_counts["c"] > 0
    assert "'c'" in str(err) or "c:" in str(err) or " c" in str(err)
    assert "'a'" not in str(err) and "'b'" not in str(err)
    assert [r.request_id for r in err.results] == ["a", "b", "c", "d"]
    assert all(len(r.token_ids) >= 3 for r in err.results)


@pytest.mark.parametrize("site", ["draft_logits", "target_hidden"])
def test_drafter_side_faults_never_change_greedy_output(random_models, ar_greedy, site):
    """Verification is the safety net: a NaN draft can cost acceptance, never correctness."""
    dec = _decoder(random_models, "eagle", nan_policy="abort", **TREE)
    out = dec.generate(PROMPTS, max_new_tokens=24, faults=[NanFault(request=1, step=2, site=site)])
    assert _tokens(out) == ar_greedy
    assert all(r.finish_reason == "length" for r in out)
    if site == "draft_logits":
        assert [(e.step, e.site) for e in out[1].nan_events] == [(2, "draft_logits")]



@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_draft_and_target_counts_stay_apart(random_models, method, value):
    """NaN/Inf in the drafter's logits and in the target's are each reported at their own site, with their
    own count, kind and dead rows (the EAGLE-3 row over its reduced vocabulary), for the faulted request
    only; under ``sanitize`` nobody stops."""
    dec = _decoder(random_models, method, nan_policy="sanitize", **TREE)
    vd = dec.drafter.compute_logits(torch.zeros(1, random_models["target"].config.hidden_size)).shape[-1]
    kind = "nan" if math.isnan(value) else "inf"
    out = dec.generate(PROMPTS, max_new_tokens=8, faults=[NanFault(request=1, step=2, site="draft_logits", value=value),
                                                           NanFault(request=2, step=3, site="target_logits", value=value)])
    events = {r: [(e.step, e.site, e.kind, e.count, e.dead_rows) for e in out[r].nan_events] for r in range(4)}
    assert events == {0: [], 1: [(2, "draft_logits", kind, vd, 1)],
                      2: [(3, "target_logits", kind, TREE["num_draft_tokens"] * 97, TREE["num_draft_tokens"])], 3: []}
    assert all(r.finish_reason == "length" for r in out)


def test_inf_logits_are_sanitized_but_only_nan_triggers_the_policy(random_models):
    """-inf is a legitimate mask value and +inf clamps to 1e30; the policies count NaN only."""
    _, out = _run_with_fault(random_models, "abort", NanFault(request=3, step=1, site="target_logits", value=math.inf))
    assert out[3].finish_reason == "length"
    # recorded with its kind and a real count (7 tree rows x 97 entries), but it stops nothing
    assert [(e.step, e.site, e.kind, e.count) for e in out[3].nan_events] == [(1, "target_logits", "inf", 7 * 97)]
    assert all(0 <= t < 97 for t in out[3].token_ids)
    _, out = _run_with_fault(random_models, "abort", NanFault(request=3, step=1, site="kv_cache", value=math.inf))
    assert out[3].finish_reason == "nan_abort"   # inf keys give inf - inf = NaN in attention


# ------------------------------------------------------------------ loading and bad input
@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model", "none"])
def test_from_pretrained_every_method(random_models, ar_greedy, method):
    path = {"eagle": "eagle_dir", "eagle3": "eagle3_dir", "draft_model": "draft_dir", "none": None}[method]
    dec = SpecDecoder.from_pretrained(random_models["tdir"], random_models[path] if path else None, method=method,
                                      dtype=torch.float32, **TREE)
    assert _tokens(dec.generate(PROMPTS, max_new_tokens=24)) == ar_greedy


@pytest.mark.parametrize("prompts, kw, match", [
    ([[]], {}, "empty"),
    ([[1, 2, 97]], {}, "outside"),
    ([[1, -1]], {}, "outside"),
    ([], {}, "non-empty"),
    ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),
    ([[1, 2]], dict(temperature=-1.0), "temperature"),
    ([[1, 2]], dict(top_p=0.0), "top_p"),
    ([[1, 2]], dict(top_k=-2), "top_k"),
    ([[1, 2], [3]], dict(temperature=[0.0]), "temperature has 1 entries for 2"),
    ([[1, 2]], dict(faults=[NanFault(request=4, step=0, site="kv_cache")]), "request=4"),
])
def test_bad_generate_inputs_name_the_problem(random_models, prompts, kw, match):
    kw.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=match):
        _decoder(random_models, "eagle", **TREE).generate(prompts, **kw)


def test_bad_fault_sites_are_rejected():
    with pytest.raises(ValueError, match="site"):
        NanFault(request=0, step=0, site="attention")
    with pytest.raises(ValueError, match="NaN or"):
        NanFault(request=0, step=0, site="kv_cache", value=1.0)


def test_mismatched_drafters_are_rejected(random_models, tmp_path):
    from tiny_models import make_tiny_target

    other = make_tiny_target(tmp_path, name="v50", vocab_size=50)
    with pytest.raises(ValueError, match="vocab"):
        SpecDecoder.from_pretrained(random_models["tdir"], other, method="draft_model", dtype=torch.float32)
    wide = make_tiny_target(tmp_path, name="h48", hidden_size=48)
    wide_target = Transformer.from_pretrained(wide, dtype=torch.float32)
    with pytest.raises(ValueError, match="hidden"):
        SpecDecoder.from_pretrained(wide, random_models["eagle_dir"], method="eagle", dtype=torch.float32)
    assert wide_target.config.hidden_size == 48


def test_missing_checkpoint_files(random_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*local directories only"):
        SpecDecoder.from_pretrained(tmp_path / "nowhere", method="none")
    with pytest.raises(FileNotFoundError, match="config.json"):
        SpecDecoder.from_pretrained(tmp_path, method="none")
    with pytest.raises(FileNotFoundError):
        SpecDecoder.from_pretrained(random_models["tdir"], tmp_path / "no_head", method="eagle")


@pytest.mark.parametrize("kw, match", [
    (dict(method="beam"), "method"),
    (dict(method="eagle", num_draft_tokens=1), "num_draft_tokens"),
    (dict(method="eagle", topk=1, num_steps=3, num_draft_tokens=6), "num_draft_tokens"),
    (dict(method="eagle", num_steps=0), "num_steps"),
])
def test_bad_decoder_configs(random_models, kw, match):
    with pytest.raises(ValueError, match=match):
        SpecDecoder(random_models["target"], random_models["eagle"], **kw)


def test_methods_need_the_right_drafter(random_models):
    with pytest.raises(ValueError, match="needs draft_path"):
        SpecDecoder.from_pretrained(random_models["tdir"], None, method="eagle")
    with pytest.raises(ValueError, match="takes no drafter"):
        SpecDecoder(random_models["target"], random_models["eagle"], method="none")
