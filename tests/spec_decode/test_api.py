"""The 1.0 API contract: device defaults, generation arguments users know from HF/vLLM/SGLang,
errors that say what to do, bounded buffers and seeds that do not depend on timing (issue #40)."""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil
import sys

import pytest
import torch

from samplers import logits_to_probs, sample
from spec_decode import NanFault
from spec_decode.models.checkpoint import read_eos_token_ids
from spec_decode.dtypes import resolve_device, resolve_dtype
from spec_decode.models.eagle import Eagle3Head, load_drafter
from spec_decode.models import Transformer
from spec_decode.pipeline import DEFAULT_TREE_SHAPES, DepthController, SpecDecoder, default_tree_shape

from tiny_models import make_tiny_eagle, make_tiny_eagle3, make_tiny_target

PROMPTS = [[5, 9, 14, 3, 22, 7], [1, 2, 3, 4, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def tdir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def target(tdir):
    return Transformer.from_pretrained(tdir, dtype=torch.float32)


@pytest.fixture(scope="module")
def eagle(target):
    return make_tiny_eagle(target)


# ---------------------------------------------------------------- 1. defaults that fit the device
def test_default_shape_is_the_devices():
    dec_cpu = default_tree_shape("cpu")
    assert dec_cpu == DEFAULT_TREE_SHAPES["cpu"] == (5, 1, 6)
    assert default_tree_shape("cuda") == (5, 4, 8)
    assert default_tree_shape("cpu", num_steps=3) == (3, 1, 4)       # a valid chain, not 3/1/6
    assert default_tree_shape("cuda", topk=2) == (5, 2, 8)
    assert default_tree_shape("cpu", num_steps="auto") == ("auto", 1, 6)


def test_decoder_reads_its_default_shape(target, eagle):
    dec = SpecDecoder(target, eagle)
    assert (dec.num_steps, dec.topk, dec.num_draft_tokens) == (5, 1, 6)
    explicit = SpecDecoder(target, eagle, num_steps=5, topk=4, num_draft_tokens=8)
    assert (explicit.num_steps, explicit.topk, explicit.num_draft_tokens) == (5, 4, 8)


# ---------------------------------------------------------------- 2. generation arguments
def _greedy(dec, **kw):
    return [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=24, **kw)]


def test_generate_stops_at_eos_unless_ignore_eos(target, eagle, monkeypatch):
    dec = SpecDecoder(target, eagle)
    full = _greedy(dec, ignore_eos=True)
    eos = full[0][5]
    monkeypatch.setattr(target, "eos_token_ids", (eos,))
    assert dec.eos_token_ids == (eos,)
    res = dec.generate(PROMPTS, max_new_tokens=24)
    assert res[0].token_ids == full[0][:full[0].index(eos) + 1] and res[0].finish_reason == "stop"
    assert [r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)] == full
    with pytest.raises(ValueError, match="ignore_eos"):
        dec.generate(PROMPTS, max_new_tokens=4, ignore_eos="yes")


def test_eos_ids_come_from_generation_config_first(tdir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tdir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = 7
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_eos_token_ids(d) == (7,)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert read_eos_token_ids(d) == (3, 4)
    assert Transformer.from_pretrained(d, dtype="fp32").eos_token_ids == (3, 4)


def test_shipped_target_stops_at_its_eos():
    dec = SpecDecoder.from_pretrained("fixtures/models/tiny-target", method="none", dtype="fp32", device="cpu")
    assert dec.eos_token_ids == (0,)


def test_min_p_one_is_greedy(target, eagle):
    dec = SpecDecoder(target, eagle)
    sampled = _greedy(dec, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True)
    assert sampled == _greedy(dec, ignore_eos=True)
    with pytest.raises(ValueError, match=r"min_p\[1\]"):
        dec.generate(PROMPTS, max_new_tokens=4, temperature=1.0, min_p=[0.1, 1.5])


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("float16", torch.float16), ("fp16", torch.float16),
                                         ("half", torch.float16), ("float32", torch.float32),
                                         ("fp32", torch.float32), ("float", torch.float32),
                                         (torch.float16, torch.float16)])
def test_dtype_names(name, dtype):
    assert resolve_dtype(name) == dtype


@pytest.mark.parametrize("bad", ["int8", "", "bf32", torch.int32, 16, None])
def test_bad_dtype_names_the_argument(bad, tdir):
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad)


def test_from_pretrained_takes_dtype_names(tdir):
    dec = SpecDecoder.from_pretrained(tdir, method="none", dtype="bf16")
    assert dec.target.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        SpecDecoder.from_pretrained(tdir, method="none", dtype="bfloat17")


def test_device_none_means_cuda_when_available(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(None) == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cuda:2"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("bad", ["gpu0", "cuda:x", 3.5])
def test_bad_device_names_the_argument(bad):
    with pytest.raises(ValueError, match="device"):
        resolve_device(bad)


# ---------------------------------------------------------------- 3. errors that say what to do
def test_hub_id_says_local_directories_only():
    with pytest.raises(FileNotFoundError, match="meta-llama/Llama-3.1-8B.*local directories only"):
        SpecDecoder.from_pretrained("meta-llama/Llama-3.1-8B", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B")


def test_missing_safetensors_names_the_extra(tdir, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'safespec\[models\]'):
        Transformer.from_pretrained(tdir)


def test_missing_tokenizers_names_the_extra(monkeypatch, tmp_path):
    from spec_decode.testing.overflow import find_trigger_token_id

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r'safespec\[hf\]'):
        find_trigger_token_id(tmp_path, "a")


@pytest.mark.parametrize("fn", [sample, logits_to_probs])
def test_return_nonfinite_under_policy_off(fn):
    x = torch.tensor([[0.0, 1.0, 2.0], [float("nan")] * 3, [float("inf"), 0.0, 1.0]])
    out = fn(x, nan_policy="off", return_nonfinite=True, temperature=0.0)
    assert out.nonfinite_rows.tolist() == [False, True, True]
    assert out.dead_rows.tolist() == [False, True, False]


@pytest.mark.parametrize("name, value, row", [
    ("temperature", [0.0, math.nan, 1.0], 1), ("temperature", [1.0, 1.0, math.inf], 2),
    ("temperature", [-1.0, 1.0, 1.0], 0), ("top_p", [0.5, 0.0, 1.0], 1), ("top_p", [2.0, 0.5, 1.0], 0),
    ("min_p", [0.0, 0.0, 1.5], 2),
])
def test_tensor_sampling_args_are_checked(name, value, row):
    logits = torch.randn(3, 11)
    with pytest.raises(ValueError, match=rf"{name}.*rows \[{row}\]"):
        sample(logits, **{name: torch.tensor(value)})


def test_negative_top_k_tensor_is_rejected():
    with pytest.raises(ValueError, match=r"top_k.*rows \[1\]"):
        sample(torch.randn(3, 11), top_k=torch.tensor([0, -1, 2]))


def test_generate_checks_tensor_temperatures(target, eagle):
    dec = SpecDecoder(target, eagle)
    with pytest.raises(ValueError, match=r"temperature.*rows \[1\]"):
        dec.generate(PROMPTS, max_new_tokens=4, temperature=torch.tensor([0.0, math.nan]))


@pytest.mark.parametrize("seed", [2**64, 2**63, -1, 1.5, "7"])
def test_bad_seeds_name_seed(target, eagle, seed):
    dec = SpecDecoder(target, eagle)
    with pytest.raises(ValueError, match="seed"):
        dec.generate(PROMPTS, max_new_tokens=4, temperature=1.0, seed=seed)


def test_seed_plus_request_index_must_stay_in_range(target, eagle):
    dec = SpecDecoder(target, eagle)
    dec.generate(PROMPTS[:1], max_new_tokens=2, temperature=1.0, seed=2**63 - 1)
    with pytest.raises(ValueError, match=r"seed.*request 1"):
        dec.generate(PROMPTS, max_new_tokens=2, temperature=1.0, seed=2**63 - 1)


@pytest.mark.parametrize("stop", [-1, 99999, [3, 97], [[1], [-2]]])
def test_stop_ids_outside_the_vocabulary(target, eagle, stop):
    dec = SpecDecoder(target, eagle)
    with pytest.raises(ValueError, match="stop_token_ids"):
        dec.generate(PROMPTS, max_new_tokens=2, stop_token_ids=stop)


@pytest.mark.parametrize("kw, name", [
    (dict(request=True, step=1, site="target_logits"), "request"),
    (dict(request=0, step=1.0, site="target_logits"), "step"),
    (dict(request=0, step=False, site="target_logits"), "step"),
    (dict(request=0, step=1, site="target_logits", value="nan"), "value"),
    (dict(request=0, step=1, site=["target_logits"]), "site"),
    (dict(request=0, step=1, site="target_logits", columns=[True]), "columns"),
])
def test_nan_fault_checks_its_field_types(kw, name):
    with pytest.raises(ValueError, match=f"NanFault.{name}"):
        NanFault(**kw)


# ---------------------------------------------------------------- EAGLE-3 heads at load time
def _eagle3_dir(target, tmp_path, edit_state=None, edit_config=None):
    d = tmp_path / "e3"
    make_tiny_eagle3(target, d, draft_vocab_size=64)
    if edit_state is not None:
        from safetensors.torch import load_file, save_file

        state = load_file(d / "model.safetensors")
        edit_state(state)
        save_file(state, d / "model.safetensors")
    if edit_config is not None:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _set(key, fn):
    def edit(d):
        d[key] = fn(d[key])
    return edit


def _duplicate_target(d2t):
    d2t = d2t.clone()
    d2t[1] = d2t[0] - 1   # draft id 1 -> the target id of draft id 0
    return d2t


@pytest.mark.parametrize("edit_state, edit_config, match", [
    (_set("d2t", _duplicate_target), None, "d2t maps several draft ids to target id"),
    (_set("d2t", lambda t: t + 1000), None, "d2t maps draft id .* outside the target's vocabulary"),
    (_set("d2t", lambda t: t - 5), None, "d2t maps draft id 0 to target id -5"),
    (_set("d2t", lambda t: t.float()), None, "d2t must be an integer tensor"),
    (_set("midlayer.hidden_norm.weight", lambda t: t.to(torch.int32)), None,
     "midlayer.hidden_norm.weight has dtype torch.int32.*floating-point"),
    (None, lambda c: c.update(draft_vocab_size=0), "draft_vocab_size"),
    (None, lambda c: c.update(draft_vocab_size="64"), "draft_vocab_size"),
    (None, lambda c: c.update(draft_vocab_size=True), "draft_vocab_size"),
    (None, lambda c: c.update(eagle_config=[1, 2, 3]), "eagle_config"),
])
def test_bad_eagle3_checkpoints_fail_at_load(target, tmp_path, edit_state, edit_config, match):
    d = _eagle3_dir(target, tmp_path, edit_state, edit_config)
    with pytest.raises(ValueError, match=match):
        load_drafter(d, target, method="eagle3")


def test_good_eagle3_checkpoint_still_loads(target, tmp_path):
    head = load_drafter(_eagle3_dir(target, tmp_path), target, method="eagle3")
    assert isinstance(head, Eagle3Head) and head.draft_vocab_size == 64


# ---------------------------------------------------------------- 4. bounded resources
def test_lookup_tokens_do_not_size_the_cache(target, eagle, monkeypatch):
    sizes = []
    new_cache = Transformer.new_cache

    def recording(self, batch_size, max_len, **kw):
        sizes.append(max_len)
        return new_cache(self, batch_size, max_len, **kw)

    monkeypatch.setattr(Transformer, "new_cache", recording)
    dec = SpecDecoder(target, eagle, lookup_ngram=2, lookup_tokens=10**6)
    out = dec.generate([[1, 2, 3, 1, 2, 3, 1, 2]], max_new_tokens=16, ignore_eos=True)
    assert len(out[0].token_ids) == 16
    assert max(sizes) <= 8 + 16 + 32, sizes


# ---------------------------------------------------------------- 5. seeds that do not depend on timing
def _jittery_choose(rng):
    """A depth controller whose choices follow a random clock, as wall-clock timing does."""
    def choose(self, regime):
        return rng.randint(0, self.max_depth)
    return choose


def test_auto_seeded_tokens_do_not_follow_timing(target, eagle, monkeypatch):
    outs = []
    for k in range(3):
        monkeypatch.setattr(DepthController, "choose", _jittery_choose(random.Random(k)))
        dec = SpecDecoder(target, eagle, num_steps="auto", num_draft_tokens=6)
        outs.append([r.token_ids for r in dec.generate(PROMPTS, max_new_tokens=24, temperature=1.0, seed=5,
                                                        ignore_eos=True)])
    assert outs[0] == outs[1] == outs[2]
    dec = SpecDecoder(target, eagle, num_steps="auto", num_draft_tokens=6)
    alone = dec.generate(PROMPTS[1:], max_new_tokens=24, temperature=1.0, seed=6, ignore_eos=True)
    mixed = dec.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=24, temperature=[0.0, 1.0], seed=[9, 6],
                         ignore_eos=True)
    assert alone[0].token_ids == outs[0][1] == mixed[1].token_ids


def test_auto_still_adapts_greedy_batches(target, eagle, monkeypatch):
    calls = itertools.count()

    def choose(self, regime):
        next(calls)
        return 1
    monkeypatch.setattr(DepthController, "choose", choose)
    dec = SpecDecoder(target, eagle, num_steps="auto", num_draft_tokens=6)
    dec.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert next(calls) > 0
