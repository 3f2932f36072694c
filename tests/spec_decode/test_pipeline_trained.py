"""The pipeline on the trained tiny fixtures: losslessness on real text, batched and alone.

Trained heads accept deep drafts (random ones rarely do), which is where tree bookkeeping bugs
show: an earlier ancestor-mask bug only appeared once paths of depth >= 4 were accepted.
"""
from __future__ import annotations

import pytest
import torch

from spec_decode import SpecDecoder

pytestmark = pytest.mark.slow  # every method and tree shape end to end on the shipped models

NUM_PROMPTS, MAX_NEW = 6, 48
SHAPES = {
    "chain_k4": dict(num_steps=4, topk=1, num_draft_tokens=5),
    "tree_5_4_8": dict(num_steps=5, topk=4, num_draft_tokens=8),
    "deep_chain_k6": dict(num_steps=6, topk=1, num_draft_tokens=7),
}


@pytest.fixture(scope="module")
def prompts(safespec_tiny_prompts):
    return [p["token_ids"] for p in safespec_tiny_prompts[:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def greedy_ar(safespec_tiny_target_path, prompts):
    dec = SpecDecoder.from_pretrained(safespec_tiny_target_path, method="none", dtype=torch.float32)
    return [r.token_ids for r in dec.generate(prompts, max_new_tokens=MAX_NEW)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method, path", [("eagle", "safespec_tiny_eagle_path"),
                                          ("eagle3", "safespec_tiny_eagle3_path"),
                                          ("draft_model", "safespec_tiny_draft_path")])
def test_trained_greedy_speculation_is_lossless_in_float32(request, safespec_tiny_target_path, prompts, greedy_ar,
                                                           method, path, shape):
    dec = SpecDecoder.from_pretrained(safespec_tiny_target_path, request.getfixturevalue(path), method=method,
                                      dtype=torch.float32, nan_policy="raise", **SHAPES[shape])
    batched = dec.generate(prompts, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in batched] == greedy_ar
    alone = [dec.generate([p], max_new_tokens=MAX_NEW)[0].token_ids for p in prompts[:2]]
    assert alone == greedy_ar[:2]
    lengths = [n for r in batched for n in r.accepted_lengths]
    assert max(lengths) >= 4   # deep paths were accepted, so the test exercised them
