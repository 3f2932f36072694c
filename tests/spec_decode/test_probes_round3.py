"""Hostile probes, round 3 (issue #51), the decoder's and the loaders' part: a temperature that vanishes in
float32, memory that follows the request, unsupported devices, and loader errors that name the file and
the key. Each repro failed before the fix; the samplers' part is in tests/samplers, the CLI's in
test_bench_cli."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spec_decode import SpecDecoder, Transformer
from spec_decode.fixtures import DRAFT_SUBDIR, EAGLE3_SUBDIR, EAGLE_SUBDIR, TARGET_SUBDIR, find_fixtures_dir
from spec_decode.models import ModelConfig
from spec_decode.models.eagle import load_drafter

FX = find_fixtures_dir()
PROMPT = [5, 9, 14, 3, 22, 7]
needs_fixtures = pytest.mark.skipif(FX is None or not (FX / TARGET_SUBDIR).is_dir(), reason="no shipped fixtures")


@pytest.fixture(scope="module")
def target():
    return Transformer.from_pretrained(FX / TARGET_SUBDIR, dtype=torch.float32)


@pytest.fixture(scope="module")
def eagle(target):
    return load_drafter(FX / EAGLE_SUBDIR, target, method="eagle")


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


@needs_fixtures
def test_a_lookup_step_verifies_a_bounded_number_of_drafts(target):
    """``lookup_tokens=10**18`` made each lookup step verify every remaining token."""
    from spec_decode.lookup import MAX_LOOKUP_DRAFTS

    plain = SpecDecoder(target, None, method="none")
    lookup = SpecDecoder(target, None, method="none", lookup_ngram=1, lookup_tokens=10**18)
    prompt = [5, 9, 14] * 4
    want = plain.generate([prompt], max_new_tokens=160, ignore_eos=True)[0].token_ids
    got = lookup.generate([prompt], max_new_tokens=160, ignore_eos=True)[0].token_ids
    assert got == want
    depths = [d for d, was in zip(lookup.last_stats.depths, lookup.last_stats.lookup) if was]
    assert depths and max(depths) <= MAX_LOOKUP_DRAFTS


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


# ---------------------------------------------------------------- loader errors name the file and the key
@pytest.fixture
def ckpt(tmp_path):
    """A copy of the shipped target, with ``edit(config dict)`` rewriting its config.json."""
    if FX is None:
        pytest.skip("no shipped fixtures")
    path = shutil.copytree(FX / TARGET_SUBDIR, tmp_path / "target")

    def edit(change, name="config.json"):
        file = path / name
        data = json.loads(file.read_text()) if file.exists() else {}
        file.write_text(change(data) if callable(change) and change.__name__ == "raw" else json.dumps({**data, **change}))
        return path
    return edit


def test_an_integer_past_pythons_digit_limit_names_the_file(ckpt):
    """A 5001-digit integer in config.json raised "Exceeds the limit (4300 digits)" naming no file."""
    def raw(data):
        return json.dumps(data)[:-1] + ', "x": ' + "9" * 5001 + "}"
    path = ckpt(raw)
    with pytest.raises(ValueError, match=f"{path / 'config.json'}.*not valid JSON"):
        Transformer.from_pretrained(path)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_a_rope_dict_that_is_not_a_dict_names_the_key(ckpt, key):
    """``rope_parameters: "x"`` named the file but not the key."""
    path = ckpt({key: "x"})
    with pytest.raises(ValueError, match=f"config.json: {key} must be a dict or null"):
        Transformer.from_pretrained(path)


def test_an_eos_id_outside_the_vocabulary_names_the_file(ckpt):
    """``eos_token_id: 99999`` in generation_config.json (vocabulary 4096) was accepted."""
    path = ckpt({"eos_token_id": 99999}, "generation_config.json")
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id 99999 is outside the vocabulary"):
        Transformer.from_pretrained(path)


@pytest.mark.parametrize("change, named", [({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
                                           ({"architectures": ["Qwen3ForCausalLM"]}, "Qwen3ForCausalLM"),
                                           ({"model_type": "qwen3"}, "qwen3")])
def test_an_architecture_neither_llama_nor_qwen2_is_refused_naming_it(ckpt, change, named):
    """These loaded as a Llama."""
    path = ckpt(change)
    with pytest.raises(ValueError, match=f"config.json: .*'{named}'.*not supported"):
        Transformer.from_pretrained(path)


def test_supported_architectures_and_drafter_heads_still_load():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    for arch, model_type in (("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2")):
        ModelConfig.from_hf_dict({**base, "architectures": [arch], "model_type": model_type})
    ModelConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLMEagle3"]}, drafter=True)
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        ModelConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLMEagle3"]})


@needs_fixtures
@pytest.mark.parametrize("method, subdir", [("eagle", EAGLE_SUBDIR), ("eagle3", EAGLE3_SUBDIR),
                                            ("draft_model", DRAFT_SUBDIR)])
def test_the_shipped_fixtures_still_load(method, subdir):
    dec = SpecDecoder.from_pretrained(FX / TARGET_SUBDIR, FX / subdir, method=method, dtype="fp32", device="cpu")
    assert dec.generate([PROMPT], max_new_tokens=3, ignore_eos=True)[0].token_ids


# ---------------------------------------------------------------- what docs/spec_decode.md now says of NanEvent
@needs_fixtures
@pytest.mark.parametrize("policy, recorded", [("off", False), ("sanitize", True), ("guard", True)])
def test_every_policy_but_off_records_nan_events(target, eagle, policy, recorded):
    from spec_decode import NanFault

    dec = SpecDecoder(target, eagle, nan_policy=policy)
    fault = NanFault(request=0, step=1, site="target_logits", columns=[3])
    out = dec.generate([PROMPT], max_new_tokens=4, ignore_eos=True, faults=[fault])[0]
    assert bool(out.nan_events) is recorded
