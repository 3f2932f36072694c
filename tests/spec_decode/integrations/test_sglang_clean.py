"""Clean in, clean out: on logits with no non-finite value, SGLang with the plugin gives the bits SGLang gives alone.

Needs sglang (``make test-sglang``); skipped with "sglang not installed" otherwise. Each test runs
SGLang's own functions twice on the same seeded clean inputs, once without the plugin and once with
it applied through ``HookRegistry``, and compares every tensor the plugin could touch bit for bit:
- sampler: SGLang's real ``ModelRunner.sample`` and ``Sampler`` (logit_bias set, greedy and seeded
  multinomial, logprobs on): the token ids, the logits afterwards and the logprobs;
- verify: SGLang's real ``eagle_sample`` (penalties and logit_bias set), greedy on its CPU path and
  rejection sampling through its Triton chain kernel (``TRITON_INTERPRET=1``): its outputs, the
  logits afterwards, the draft probabilities afterwards and the target argmax.
"""

from __future__ import annotations

import os

import pytest
import torch

from _sglang_harness import import_sglang

_SKIP_REASON = import_sglang()
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")

if _SKIP_REASON is None:
    from _sglang_harness import (applied_plugin, eagle_sample_on_cpu, eagle_verify_case, make_forward_batch,
                                 make_model_runner, make_sampling_info, sglang_cpu_context)
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative import eagle_utils

VOCAB = 37
BS = 5
DRAFT_TOKEN_NUM = 4
POLICIES = ["sanitize", "guard", "abort", "raise"]


def _with_and_without(policy, run):
    """``run()`` without the plugin, then with it under ``policy``: (alone, hooked)."""
    alone = run()
    with applied_plugin(policy):
        hooked = run()
    return alone, hooked


def _assert_same_bits(alone: dict, hooked: dict):
    assert alone.keys() == hooked.keys()
    for name, value in alone.items():
        other = hooked[name]
        assert value.dtype == other.dtype and value.shape == other.shape, name
        # Bits, not values: -0.0 vs 0.0 and NaN payloads count as changes.
        assert torch.equal(value.view(-1).view(torch.uint8), other.view(-1).view(torch.uint8)), name


def _sampler_step(greedy: bool) -> dict:
    """SGLang's ``ModelRunner.sample`` on seeded clean logits with logit_bias and logprobs."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(BS, VOCAB, generator=g)
    info = make_sampling_info(BS, VOCAB, greedy=greedy)
    info.logit_bias = torch.randn(BS, VOCAB, generator=g)
    rids = [f"r{i}" for i in range(BS)]
    forward_batch = make_forward_batch(info, rids)
    forward_batch.return_logprob = True
    forward_batch.top_logprobs_nums = [2] * BS
    forward_batch.token_ids_logprobs = [None] * BS
    logits_output = LogitsProcessorOutput(next_token_logits=logits)
    with sglang_cpu_context():
        runner = make_model_runner(Sampler())
        torch.manual_seed(11)  # the multinomial draw
        ids = ModelRunner.sample(runner, logits_output, forward_batch)
    return {"ids": ids, "logits": logits_output.next_token_logits, "logprobs": logits_output.next_token_logprobs}


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("policy", POLICIES)
def test_sampler_on_clean_logits_is_bit_identical_to_sglang_alone(monkeypatch, policy, greedy):
    monkeypatch.setenv("SGLANG_OPT_USE_GUMBEL_SAMPLE", "0")
    _assert_same_bits(*_with_and_without(policy, lambda: _sampler_step(greedy)))


def _verify_step(rejection_sampling: bool) -> dict:
    """SGLang's ``eagle_sample`` on seeded clean inputs (penalties, logit_bias, draft probs)."""
    verify_input, batch, logits_output = eagle_verify_case(BS, DRAFT_TOKEN_NUM, VOCAB)
    biases = {name: getattr(batch.sampling_info, name) for name in ("acc_additive_penalties", "logit_bias")}
    with eagle_sample_on_cpu(rejection_sampling=rejection_sampling) as seen:
        torch.manual_seed(5)  # the rejection-sampling coins
        predict, accept_lens, accept_index = eagle_utils.eagle_sample(verify_input, batch, logits_output, None)
    for name, value in biases.items():  # the hook puts SGLang's fields back, the same objects
        assert getattr(batch.sampling_info, name) is value, name
    out = {"predict": predict, "accept_lens": accept_lens, "accept_index": accept_index,
           "logits": logits_output.next_token_logits, "draft_probs": verify_input.draft_probs}
    if "target_predict" in seen:
        out["target_predict"] = seen["target_predict"]
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="SGLang's Triton kernel on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("rejection_sampling", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_verify_on_clean_logits_is_bit_identical_to_sglang_alone(policy, rejection_sampling):
    alone, hooked = _with_and_without(policy, lambda: _verify_step(rejection_sampling))
    if rejection_sampling:
        assert int(alone["accept_lens"].sum()) > BS, "some drafts must be accepted for the draft probs to matter"
    _assert_same_bits(alone, hooked)
