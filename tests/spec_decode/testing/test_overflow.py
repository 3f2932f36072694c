"""The real fp16 overflow (``spec_decode.testing.overflow``) on the trained tiny target, no injected fault.

fp16: NaN logits in the request that holds the trigger token, none in the others; bf16/fp32: finite;
sequences without the trigger: bit-identical to the unmodified model. Exactly-per-row/per-branch NaN
holds because fp16 models run attention with ``exact_nan`` (no 0 * NaN leak from masked K/V rows).
Pipeline level: the NaN policy acts on this real fault (raise names the request, abort isolates it).
"""

from __future__ import annotations

import pytest
import torch

from spec_decode.dtypes import DTYPES
from spec_decode.models import Transformer
from spec_decode.testing.overflow import (
    DEFAULT_MAGNITUDE,
    FP16_MAX,
    find_trigger_token_id,
    plant_massive_activation,
    remove_massive_activation,
)


@pytest.fixture(scope="module")
def trigger_id(safespec_tiny_target_path) -> int:
    return find_trigger_token_id(safespec_tiny_target_path)


@pytest.fixture(scope="module")
def clean_prompts(safespec_tiny_prompts, trigger_id) -> list[list[int]]:
    """Held-out prompts that do not contain the trigger token."""
    out = [p["token_ids"] for p in safespec_tiny_prompts if trigger_id not in p["token_ids"]]
    assert len(out) >= 8
    return out


@pytest.fixture(scope="module")
def planted_models(safespec_tiny_target_path, trigger_id):
    """{dtype name: (base model, planted model)} loaded from the trained target."""
    out = {}
    for name, dtype in DTYPES.items():
        base = Transformer.from_pretrained(safespec_tiny_target_path, dtype=dtype)
        planted = Transformer.from_pretrained(safespec_tiny_target_path, dtype=dtype)
        plant_massive_activation(planted, trigger_id)
        out[name] = (base, planted)
    return out


def forward(model: Transformer, ids: torch.Tensor, tree_mask=None, prefix=None) -> torch.Tensor:
    """Logits of a block `ids` [B, T] after an optional committed `prefix` [B, P]. Shape: [B, T, V] float32."""
    B, T = ids.shape
    P = 0 if prefix is None else prefix.shape[1]
    cache = model.new_cache(B, P + T)
    with torch.no_grad():
        if prefix is not None:
            model(prefix, cache)
            cache.commit(torch.full((B,), P))
        return model(ids, cache, tree_mask=tree_mask).logits.float()


def nan_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] bool: the row holds a NaN."""
    return torch.isnan(logits).any(-1)


def test_magnitude_overflows_fp16_only():
    assert DEFAULT_MAGNITUDE > FP16_MAX
    x = torch.tensor([DEFAULT_MAGNITUDE])
    assert torch.isinf(x.half()).all()
    assert torch.isfinite(x.bfloat16()).all() and torch.isfinite(x).all()


def test_plant_changes_exactly_one_entry(planted_models, trigger_id):
    base, planted = planted_models["fp32"]
    changed = {k for k, v in base.state_dict().items() if not torch.equal(v, planted.state_dict()[k])}
    assert changed == {"embed_tokens.weight"}
    diff = (base.embed_tokens.weight != planted.embed_tokens.weight).nonzero().tolist()
    assert diff == [[trigger_id, 0]]


@pytest.mark.parametrize("pos", [0, 17, -1])
def test_fp16_trigger_poisons_its_request_only(planted_models, clean_prompts, trigger_id, pos):
    """Batch of 2: request 0 holds the trigger, request 1 does not and must equal the base model."""
    base, planted = planted_models["fp16"]
    ids = torch.tensor([clean_prompts[0][:48], clean_prompts[1][:48]])
    pos = pos % 48
    ids[0, pos] = trigger_id
    got, ref = forward(planted, ids), forward(base, ids)
    assert torch.isfinite(ref).all()  # the unmodified model runs finite in fp16
    assert nan_rows(got)[0, pos:].all()
    assert not nan_rows(got)[1].any()
    assert torch.equal(got[1], ref[1])


def test_fp16_committed_prefix_before_the_trigger_stays_finite(planted_models, clean_prompts, trigger_id):
    """The trigger arrives in a later block: the earlier block's logits are unaffected."""
    base, planted = planted_models["fp16"]
    prefix = torch.tensor([clean_prompts[2][:32]])
    block = torch.tensor([clean_prompts[3][:4]])
    block[0, 0] = trigger_id
    cache = planted.new_cache(1, 36)
    with torch.no_grad():
        first = planted(prefix, cache).logits
        cache.commit(torch.tensor([32]))
        second = planted(block, cache).logits
        ref = base(prefix, base.new_cache(1, 32)).logits
    assert torch.equal(first, ref)
    assert nan_rows(second).all()


@pytest.mark.parametrize("pos", [17, -1])
def test_fp16_nan_exactly_from_the_trigger_on(planted_models, clean_prompts, trigger_id, pos):
    base, planted = planted_models["fp16"]
    ids = torch.tensor([clean_prompts[0]])
    T = ids.shape[1]
    pos = pos % T
    ids[0, pos] = trigger_id
    got, ref = forward(planted, ids), forward(base, ids)
    want_nan = torch.arange(T) >= pos
    assert torch.equal(nan_rows(got)[0], want_nan)
    assert torch.equal(got[0, :pos], ref[0, :pos])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_trigger_stays_finite_in_bf16_and_fp32(planted_models, clean_prompts, trigger_id, dtype):
    base, planted = planted_models[dtype]
    ids = torch.tensor([clean_prompts[1][:48]])
    ids[0, 5] = trigger_id
    got, ref = forward(planted, ids), forward(base, ids)
    assert torch.isfinite(got).all()
    assert torch.equal(got[0, :5], ref[0, :5])  # causal: positions before the trigger cannot see it
    # the planted activation does act on the trigger position (it is a real edit, not a no-op)
    assert not torch.equal(got[0, 5], ref[0, 5])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_without_trigger_outputs_equal_the_base_model(planted_models, clean_prompts, dtype):
    base, planted = planted_models[dtype]
    for prompt in clean_prompts[:2]:
        ids = torch.tensor([prompt[:48]])
        assert torch.equal(forward(planted, ids), forward(base, ids))


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:
    """Self-or-ancestor mask [N, N] of a parent list (-1 for the root)."""
    N = len(parents)
    mask = torch.eye(N, dtype=torch.bool)
    for i in range(N):
        j = parents[i]
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_fp16_nan_exactly_on_tree_branches_with_the_trigger(planted_models, clean_prompts, trigger_id):
    """Batch of 2 verify trees after a committed prefix; only request 0's tree holds the trigger.

    Tree (node: parent): 0:-1, 1:0, 2:0, 3:1, 4:1, 5:2, 6:3, 7:5; the trigger is node 1, so NaN must be
    exactly on nodes {1, 3, 4, 6} of request 0 and nowhere in request 1.
    """
    base, planted = planted_models["fp16"]
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    mask = tree_mask_from_parents(parents).expand(2, -1, -1)
    prefix = torch.tensor([clean_prompts[2][:32], clean_prompts[3][:32]])
    tokens = torch.tensor([clean_prompts[4][:8], clean_prompts[5][:8]])
    tokens[0, 1] = trigger_id
    got, ref = forward(planted, tokens, mask, prefix), forward(base, tokens, mask, prefix)
    want = torch.zeros(2, 8, dtype=torch.bool)
    want[0, [1, 3, 4, 6]] = True
    assert torch.equal(nan_rows(got), want)
    assert torch.equal(got[~want], ref[~want])


def test_remove_restores_the_model(safespec_tiny_target_path, trigger_id, clean_prompts):
    model = Transformer.from_pretrained(safespec_tiny_target_path, dtype=torch.float32)
    before = model.embed_tokens.weight.clone()
    planted = plant_massive_activation(model, trigger_id, channel=3, magnitude=1e5)
    assert planted.channel == 3 and planted.magnitude == 1e5
    remove_massive_activation(model, planted)
    assert torch.equal(model.embed_tokens.weight, before)


def test_works_on_transformers_models(safespec_tiny_target_path, clean_prompts, trigger_id):
    from transformers import LlamaForCausalLM

    ids = torch.tensor([clean_prompts[0][:24]])
    ids[0, 10] = trigger_id
    for dtype, expect_nan in ((torch.float16, True), (torch.float32, False)):
        model = LlamaForCausalLM.from_pretrained(safespec_tiny_target_path, dtype=dtype)
        plant_massive_activation(model, trigger_id)
        with torch.no_grad():
            logits = model(ids).logits.float()
        assert nan_rows(logits)[0, 10:].all() if expect_nan else torch.isfinite(logits).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(token_id=-1), "token_id"),
    (dict(token_id=10**6), "token_id"),
    (dict(token_id=5, channel=10**6), "channel"),
    (dict(token_id=5, magnitude=float("inf")), "magnitude"),
    (dict(token_id=5, magnitude=float("nan")), "magnitude"),
])
def test_bad_arguments(planted_models, kwargs, match):
    model = planted_models["fp32"][0]
    token_id = kwargs.pop("token_id")
    with pytest.raises(ValueError, match=match):
        plant_massive_activation(model, token_id, **kwargs)


def test_tied_embeddings_are_refused(safespec_tiny_target_path):
    model = Transformer.from_pretrained(safespec_tiny_target_path, dtype=torch.float32)
    model.lm_head.weight = model.embed_tokens.weight
    with pytest.raises(ValueError, match="ties"):
        plant_massive_activation(model, 5)


def test_trigger_text_must_be_one_token(safespec_tiny_target_path):
    with pytest.raises(ValueError, match="exactly 1"):
        find_trigger_token_id(safespec_tiny_target_path, " None None")


# ------------------------------------------------------------------ pipeline level, real fault


@pytest.fixture(scope="module")
def planted_decoder_factory(safespec_tiny_target_path, safespec_tiny_eagle_path, trigger_id):
    """Build SpecDecoders (EAGLE tree) whose target carries the planted activation."""
    from spec_decode import SpecDecoder

    def make(dtype, nan_policy):
        dec = SpecDecoder.from_pretrained(safespec_tiny_target_path, safespec_tiny_eagle_path, method="eagle",
                                          dtype=dtype, nan_policy=nan_policy)
        plant_massive_activation(dec.target, trigger_id)
        return dec

    return make


def batch_with_trigger(clean_prompts, trigger_id) -> list[list[int]]:
    """Three prompts; only the middle one holds the trigger."""
    poisoned = list(clean_prompts[1][:40])
    poisoned[20] = trigger_id
    return [clean_prompts[0][:40], poisoned, clean_prompts[2][:40]]


@pytest.mark.dtype_sensitive
def test_policy_raise_on_the_real_fault(planted_decoder_factory, clean_prompts, trigger_id, safespec_spec_dtype):
    from numerics import NanLogitsError

    dec = planted_decoder_factory(safespec_spec_dtype, "raise")
    prompts = batch_with_trigger(clean_prompts, trigger_id)
    if safespec_spec_dtype == torch.float16:
        with pytest.raises(NanLogitsError) as err:
            dec.generate(prompts, max_new_tokens=8, ignore_eos=True, request_ids=["a", "b", "c"])
        assert set(err.value.nan_counts) == {"b"}
    else:
        results = dec.generate(prompts, max_new_tokens=8, ignore_eos=True, request_ids=["a", "b", "c"])
        assert all(r.finish_reason == "length" and not r.nan_events for r in results)


@pytest.mark.dtype_sensitive
def test_policy_abort_isolates_the_real_fault(planted_decoder_factory, clean_prompts, trigger_id, safespec_spec_dtype):
    dec = planted_decoder_factory(safespec_spec_dtype, "abort")
    prompts = batch_with_trigger(clean_prompts, trigger_id)
    results = dec.generate(prompts, max_new_tokens=12, ignore_eos=True)
    alone = dec.generate([prompts[0], prompts[2]], max_new_tokens=12, ignore_eos=True)
    if safespec_spec_dtype == torch.float16:
        assert results[1].finish_reason == "nan_abort"
    else:
        assert results[1].finish_reason == "length"
    assert [results[0].token_ids, results[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    assert all(r.finish_reason == "length" for r in (results[0], results[2]))


@pytest.mark.dtype_sensitive
def test_policy_sanitize_records_the_real_fault(planted_decoder_factory, clean_prompts, trigger_id,
                                                safespec_spec_dtype):
    dec = planted_decoder_factory(safespec_spec_dtype, "sanitize")
    results = dec.generate(batch_with_trigger(clean_prompts, trigger_id), max_new_tokens=8, ignore_eos=True)   # sanitized noise may emit EOS
    assert not results[0].nan_events and not results[2].nan_events
    assert bool(results[1].nan_events) == (safespec_spec_dtype == torch.float16)
    assert all(r.finish_reason == "length" for r in results)
