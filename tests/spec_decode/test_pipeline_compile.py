"""``SpecDecoder(compile=True)``: compiled forwards, same losslessness, same one host copy per step.

Compiled models are separate objects (compile works in place), built once per module: compiling
costs tens of seconds on CPU.
"""
from __future__ import annotations

import pytest
import torch

from spec_decode import SpecDecoder
from spec_decode.models import Transformer

pytestmark = pytest.mark.slow  # torch.compile of the models

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A compiled tiny target and EAGLE head, and eager copies of the same weights."""
    from tiny_models import make_tiny_eagle, make_tiny_target

    root = tmp_path_factory.mktemp("compile_models")
    tdir = make_tiny_target(root, seed=0)
    eager_target = Transformer.from_pretrained(tdir, dtype=torch.float32)
    make_tiny_eagle(eager_target, root / "eagle")
    target = Transformer.from_pretrained(tdir, dtype=torch.float32)
    from spec_decode.models.eagle import load_drafter

    head = load_drafter(root / "eagle", target, method="eagle", dtype=torch.float32)
    eager_head = load_drafter(root / "eagle", eager_target, method="eagle", dtype=torch.float32)
    ar = SpecDecoder(target, None, method="none", compile=True)
    return dict(target=target, head=head, ar=ar, eager_target=eager_target, eager_head=eager_head,
                target_dir=tdir, head_dir=root / "eagle")


def _tokens(results):
    return [r.token_ids for r in results]


def test_compile_compiles_each_module_once_in_place(compiled):
    target, head = compiled["target"], compiled["head"]
    assert target._compiled_call_impl is not None
    SpecDecoder(target, head, method="eagle", compile=True)
    impl = head._compiled_call_impl
    assert impl is not None
    SpecDecoder(target, head, method="eagle", compile=True)   # a second decoder does not recompile
    assert head._compiled_call_impl is impl
    assert compiled["eager_target"]._compiled_call_impl is None


def test_compiled_greedy_speculation_equals_compiled_ar(compiled):
    """A tree shape (each new shape class costs another compilation; the chain path is the same code)."""
    ar = _tokens(compiled["ar"].generate(PROMPTS, max_new_tokens=16))
    dec = SpecDecoder(compiled["target"], compiled["head"], method="eagle", compile=True, nan_policy="raise",
                      num_steps=3, topk=2, num_draft_tokens=6)
    out = dec.generate(PROMPTS, max_new_tokens=16)
    assert _tokens(out) == ar
    assert dec.last_stats.host_copies == len(dec.last_stats.step_s) + 1   # one per step, plus the prefill's


def test_compiled_lookup_steps_equal_compiled_ar(compiled):
    """Lookup steps vary the verify block's length: the dynamic graphs take them (every prompt holds the whole
    vocabulary, so with lookup_ngram=1 every step but a last one verifies lookup drafts)."""
    prompts = [torch.randperm(97, generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    ar = _tokens(compiled["ar"].generate(prompts, max_new_tokens=12))
    dec = SpecDecoder(compiled["target"], compiled["head"], method="eagle", compile=True, num_steps=3, topk=1,
                      num_draft_tokens=4, lookup_ngram=1, lookup_tokens=5)
    assert _tokens(dec.generate(prompts, max_new_tokens=12)) == ar
    assert dec.last_stats.lookup[0]


def test_compiled_logits_match_eager(compiled):
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        got = compiled["target"](ids, compiled["target"].new_cache(1, 16)).logits
        want = compiled["eager_target"](ids, compiled["eager_target"].new_cache(1, 16)).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_compile_must_be_a_bool(compiled):
    with pytest.raises(ValueError, match="compile"):
        SpecDecoder(compiled["eager_target"], None, method="none", compile="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_forward_is_one_graph(compiled, dtype):
    """No graph break anywhere in a target or head forward: a break at every ``Linear`` (its CPU
    packing rules ran under the compiler) once made compiled decoding 2x slower than eager."""
    from spec_decode.models.eagle import load_drafter

    target = Transformer.from_pretrained(compiled["target_dir"], dtype=dtype)
    head = load_drafter(compiled["head_dir"], target, method="eagle", dtype=dtype)
    ids = torch.tensor([PROMPTS[2]])
    feats = torch.zeros(1, ids.shape[1], target.config.hidden_size, dtype=dtype)
    with torch.no_grad():
        for forward, args in ((target, (ids, target.new_cache(1, 16))),
                              (head.draft_forward, (ids, feats, head.new_cache(1, 16)))):
            explained = torch._dynamo.explain(forward)(*args)
            assert explained.graph_break_count == 0, explained.break_reasons
